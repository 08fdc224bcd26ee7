"""Scan a fixed set of settings, and compare two such sets file by file.

Used to show that a change leaves every table and every command's output byte-identical:

    python benchmarks/compare_atlases.py scan BEFORE        # on the old code
    python benchmarks/compare_atlases.py outputs BEFORE     # on the old code: every command on two atlases
    python benchmarks/compare_atlases.py scan AFTER --models BEFORE/models   # on the new code
    python benchmarks/compare_atlases.py outputs AFTER --models BEFORE/models
    python benchmarks/compare_atlases.py compare BEFORE AFTER

``outputs`` copies the tiny GPT-2 and tiny Llama atlases and runs the command line on each, in a fresh
process per command (:data:`COMMANDS`: info, neuron, top, trace, generate, project, taxonomy, explain, score,
every experiment, reports in each format, the neuron-explainer export), into ``DIR/outputs-<setting>``: what a
command prints becomes a ``.txt`` file, what it writes stays where it wrote it. Only the command line is used,
so the same script runs on code before and after a move.

Each setting is scanned in a fresh process, with the projection tables written (``projections="eager"``),
into ``DIR/<setting>-torch`` (the torch reference, the one streaming path). ``compare`` checks every
parquet file (and any other file, e.g. a shard's kept state) for equal bytes, and where bytes
differ, reports whether the Arrow tables are equal; manifests are compared as JSON without the
timing and without the fields only one side has (printed). A shard's kept state is compared by
content: every tensor exactly, and its JSON without the save's random generation tag, its
streaming seconds and the fields only one side has (printed). Exit status 1 if anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from common import tiny_llama_dir

# name -> (model, corpus, settings): tiny random-init models (tests/conftest.py's shapes) and SmolLM2
SETTINGS: dict[str, tuple[str, str, dict]] = {
    "gpt2-sorted": ("tiny-gpt2", "pydoc", dict(max_tokens=3000, window=64, batch_size=4, per_document=True)),
    "gpt2-ordered": ("tiny-gpt2", "pydoc", dict(max_tokens=3000, window=64, batch_size=4, per_document=True,
                                                 sort_by_length=False, top_k=7)),
    "gpt2-shard": ("tiny-gpt2", "pydoc", dict(max_tokens=3000, window=64, batch_size=4, per_document=True,
                                              shard=(1, 2), block_documents=8)),
    "gpt2-windows": ("tiny-gpt2", "pydoc", dict(max_tokens=3000, window=64, batch_size=4)),  # longest windows first
    "llama-sorted": ("tiny-llama", "pydoc", dict(max_tokens=3000, window=64, batch_size=4, per_document=True)),
    "smollm2": ("smollm2-135m", "pydoc", dict(max_tokens=4000, per_document=True)),
}


def model_dir(name: str, models: Path) -> str:
    """The model to load for a setting's model name (tiny models built once under ``models``)."""
    if name == "tiny-gpt2":
        from kvmem.builtin import gpt2_random_dir

        return str(gpt2_random_dir(n_layer=2, n_embd=64, n_head=4, n_positions=128))
    if name == "tiny-llama":
        return str(tiny_llama_dir(models))
    return name


def scan_one(setting: str, out: Path, models: Path) -> None:
    import kvmem
    from kvmem.scanning.config import ScanConfig

    model_name, corpus, settings = SETTINGS[setting]
    model = kvmem.load_model(model_dir(model_name, models), device="cpu")
    if "projections" in {f.name for f in fields(ScanConfig)}:
        settings = {**settings, "projections": "eager"}  # the tables a scan wrote before they became lazy
    kvmem.scan(model, corpus, out=out, overwrite=True, progress=False, **settings)


def scan_all(root: Path, models: Path, only: list[str] | None) -> None:
    models.mkdir(parents=True, exist_ok=True)
    for setting in only or SETTINGS:
        target = root / f"{setting}-torch"
        subprocess.run([sys.executable, __file__, "_one", setting, str(target), "--models", str(models)],
                       env={**os.environ, "KVMEM_KERNELS": "torch"}, check=True)  # read by a kvmem that had a choice
        print(f"scanned {target.name}", flush=True)


# the command lines of ``outputs``, run in DIR/outputs-<setting> with ATLAS and MODEL filled in: (name, arguments);
# a name ending in .txt saves what the command prints
COMMANDS: list[tuple[str, list[str]]] = [
    ("info.txt", ["info", "--atlas", "ATLAS"]),
    ("neuron.txt", ["neuron", "--atlas", "ATLAS", "0:3,1:5"]),
    ("top-value.txt", ["top", "--atlas", "ATLAS", "--token", " the", "--by", "value", "-k", "5"]),
    ("top-trigger.txt", ["top", "--atlas", "ATLAS", "--token", " the", "--by", "trigger", "-k", "5"]),
    ("trace.txt", ["trace", "--model", "MODEL", "--top", "3", "The name of the function is"]),
    ("generate.txt", ["generate", "--model", "MODEL", "--set", "1:5=4", "--position", "-1",
                      "--max-new-tokens", "4", "It is"]),
    ("taxonomy.txt", ["taxonomy", "--atlas", "ATLAS"]),
    ("explain.txt", ["explain", "--atlas", "ATLAS", "--all", "--no-progress"]),
    ("score.txt", ["score", "--atlas", "ATLAS", "--layers", "1", "--n-boot", "200", "--no-progress"]),
    ("score-delphi.txt", ["score", "--atlas", "ATLAS", "--neurons", "0:0-7", "--protocol", "delphi",
                          "--scorers", "detection,fuzzing", "--n-boot", "100", "--no-progress"]),
    ("report-html.txt", ["report", "--atlas", "ATLAS", "--neurons", "0:3,1:5", "--format", "html", "--out",
                         "report-html", "--no-progress"]),
    ("report-md.txt", ["report", "--atlas", "ATLAS", "--neurons", "0:3,1:5", "--format", "md", "--out",
                       "report-md", "--no-progress"]),
    ("report-json.txt", ["report", "--atlas", "ATLAS", "--neurons", "0:3,1:5", "--format", "json", "--out",
                         "report-json", "--no-progress"]),
    ("export.txt", ["export", "--atlas", "ATLAS", "--format", "neuron-explainer", "--neurons", "0:3,1:5",
                    "--model", "MODEL", "--out", "export", "--no-progress"]),
    *[(f"experiment-{name}.txt", ["experiment", name, "--atlas", "ATLAS", "--model", "MODEL", "--out",
                                  f"experiment-{name}", *extra])
      for name, extra in [("agreement", []), ("next-token-rank", []),
                          ("token-removal", ["--neurons-per-layer", "4", "--top-triggers", "3"]),
                          ("active-memories", ["--positions", "200"]), ("layer-vs-memories", ["--positions", "100"]),
                          ("lm-quality", [])]],
    ("project.txt", ["project", "--atlas", "ATLAS", "--quiet"]),
]
OUTPUT_SETTINGS = ("gpt2-sorted", "llama-sorted")


def outputs_all(root: Path, models: Path) -> None:
    """Run :data:`COMMANDS` on a copy of each atlas of :data:`OUTPUT_SETTINGS` (scanned by ``scan`` into ``root``)."""
    import shutil

    for setting in OUTPUT_SETTINGS:
        work = root / f"outputs-{setting}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        shutil.copytree(root / f"{setting}-torch", work / "atlas")
        model = model_dir(SETTINGS[setting][0], models)
        for name, arguments in COMMANDS:
            line = [a.replace("ATLAS", "atlas").replace("MODEL", model) if a in ("ATLAS", "MODEL") else a
                    for a in arguments]
            done = subprocess.run([sys.executable, "-m", "kvmem", *line], cwd=work, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONHASHSEED": "0", "COLUMNS": "120"})
            text = done.stdout + (f"\n[exit {done.returncode}]\n" + done.stderr[-2000:] if done.returncode else "")
            text = re.sub(r"\d+(\.\d+)? ?(s|ms|seconds)\b", "TIME", text.replace(str(work), "WORK").replace(model, "MODEL"))
            (work / name).write_text(text)
        print(f"ran {len(COMMANDS)} commands in {work.name}", flush=True)


def _manifest_view(path: Path) -> dict:
    data = json.loads(path.read_text())
    data.pop("timing", None)
    return data


def _flatten(data, prefix: str = "") -> dict:
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def _compare_state(left: Path, right: Path) -> str:
    """'' when equal by content, 'same content; ...' when equal but for fields on one side, else what differs."""
    if left.suffix == ".safetensors":
        import torch
        from safetensors.torch import load_file

        x, y = load_file(left), load_file(right)
        if x.keys() != y.keys():
            return f"DIFFERS: tensors {sorted(x.keys() ^ y.keys())}"

        def same_bits(a, b) -> bool:  # NaN == NaN, -0.0 != 0.0
            return a.dtype == b.dtype and a.shape == b.shape and a.reshape(-1).view(torch.uint8).equal(
                b.reshape(-1).view(torch.uint8))

        bad = [name for name in x if not same_bits(x[name], y[name])]
        return f"DIFFERS: tensors {bad}" if bad else ""
    x, y = (_flatten({k: v for k, v in json.loads(p.read_text()).items() if k not in ("generation", "seconds")})
            for p in (left, right))
    changed = sorted(k for k in x.keys() & y.keys() if x[k] != y[k])
    if changed:
        return f"DIFFERS at {changed}"
    only = sorted(x.keys() ^ y.keys())
    return ("same content; fields on one side only: " + ", ".join(f"{k}={(x | y)[k]!r}" for k in only)) if only else ""


def compare(a: Path, b: Path) -> bool:
    import pyarrow.parquet as pq

    same = True
    for atlas in sorted(p for p in a.iterdir() if p.is_dir() and p.name != "models"):
        other = b / atlas.name
        if not other.exists():
            print(f"{atlas.name}: missing in {b.name}")
            same = False
            continue
        files = sorted({p.relative_to(atlas) for p in atlas.rglob("*") if p.is_file()}
                       | {p.relative_to(other) for p in other.rglob("*") if p.is_file()})
        equal, notes = 0, []
        for rel in files:
            left, right = atlas / rel, other / rel
            if rel.name == "manifest.json":
                x, y = _flatten(_manifest_view(left)), _flatten(_manifest_view(right))
                changed = sorted(k for k in x.keys() & y.keys() if x[k] != y[k])
                only = sorted(x.keys() ^ y.keys())
                if changed:
                    notes.append(f"manifest differs at {changed}")
                    same = False
                if only:
                    notes.append("manifest fields on one side only: "
                                 + ", ".join(f"{k}={(x | y)[k]!r}" for k in only))
                continue
            if rel.name in ("state.json", "state.safetensors") and left.exists() and right.exists():
                problem = _compare_state(left, right)
                if problem:
                    notes.append(f"{rel}: {problem}")
                    same = same and problem.startswith("same")
                else:
                    equal += 1
                continue
            if not (left.exists() and right.exists()):
                notes.append(f"{rel}: only in {'before' if left.exists() else 'after'}")
                same = False
            elif left.read_bytes() == right.read_bytes():
                equal += 1
            elif rel.suffix == ".parquet" and pq.read_table(left).equals(pq.read_table(right)):
                notes.append(f"{rel}: bytes differ, Arrow tables equal")
                same = False
            else:
                notes.append(f"{rel}: DIFFERS")
                same = False
        print(f"{atlas.name}: {equal}/{len(files) - 1} files equal (tables byte for byte, a kept state by content)" + "".join(f"\n  {n}" for n in notes))
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    scan = sub.add_parser("scan", help="scan every setting into DIR/<setting>-torch")
    scan.add_argument("root", type=Path)
    scan.add_argument("--models", type=Path, help="where the tiny Llama is built (default DIR/models)")
    scan.add_argument("--only", help="comma-separated settings (default all: " + ", ".join(SETTINGS) + ")")
    one = sub.add_parser("_one")
    one.add_argument("setting")
    one.add_argument("out", type=Path)
    one.add_argument("--models", type=Path, required=True)
    outs = sub.add_parser("outputs", help="run every command on copies of two scanned atlases (after 'scan')")
    outs.add_argument("root", type=Path)
    outs.add_argument("--models", type=Path, help="where the tiny Llama is built (default DIR/models)")
    cmp = sub.add_parser("compare", help="compare two directories written by 'scan' (and 'outputs')")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "scan":
        scan_all(args.root, args.models or args.root / "models", args.only.split(",") if args.only else None)
        return 0
    if args.command == "outputs":
        outputs_all(args.root, args.models or args.root / "models")
        return 0
    if args.command == "_one":
        scan_one(args.setting, args.out, args.models)
        return 0
    return 0 if compare(args.before, args.after) else 1


if __name__ == "__main__":
    sys.exit(main())
