"""All of what a user waits for: the ``kvmem scan`` command from the shell against a bare command.

- command: ``python -m kvmem scan --model M --corpus C --max-tokens N --out ... --overwrite --quiet``,
  from Python's start to the process's end (imports, model load, scan, writing the atlas, exit);
- bare: a fresh Python that imports torch and transformers, loads the same model directory with
  ``AutoModelForCausalLM`` (HF's own attention implementation, no TransformerLens) and runs its forward
  *with logits* over exactly the batches the scan reads, then exits the usual way, as a user's own
  script would. The batches' token ids are computed once beforehand (``whole_scan.scan_batches``) and
  read from a file, so the bare command does not even tokenize.

The two alternate, ``--rounds`` times each, every one in a fresh process; medians are reported (the
machine's drift hits both alike). By default the caches are warm (the command runs once first); with
``--cold`` every command round starts from an empty ``KVMEM_CACHE`` (a newcomer's first run: the built-in
model converted from its GGUF file, no projection tables), removed after the round. ``--projections eager``
passes that option to the command (the tables written, from the cache or computed). ``--variant
LABEL=ROOT[,NAME=VALUE...]`` (repeatable) alternates the same command run from another checkout ROOT (its
working directory and ``PYTHONPATH``) with the environment variables given, e.g. an earlier commit's
``KVMEM_KERNELS=numba`` against its ``KVMEM_KERNELS=torch``.

    python benchmarks/whole_command.py --model smollm2-135m --tokens 2000 --rounds 5 [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import HERE, machine

ROOT = HERE.parent


def bare_main(directory: str, batches: str) -> None:
    """The bare command's body (run with ``--bare`` in a fresh process): no kvmem import."""
    import torch
    from transformers import AutoModelForCausalLM
    from whole_scan import forward_seconds

    forward_seconds(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), torch.load(batches))


def prepare_bare(model_name: str, corpus: str, tokens: int, folder: Path) -> tuple[str, Path]:
    """-> (the model's HF directory, a file holding the scan's batches), computed once in this process."""
    import torch
    from whole_scan import scan_batches

    import kvmem

    model = kvmem.load_model(model_name)
    batches = folder / "batches.pt"
    torch.save(scan_batches(model, corpus, tokens), batches)
    return model.source, batches


def timed(argv: list[str], env: dict | None = None, cwd: Path = ROOT) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="pydoc")
    parser.add_argument("--tokens", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="do not run the command once first (its first round then fills the caches)")
    parser.add_argument("--cold", action="store_true", help="every command round from an empty KVMEM_CACHE")
    parser.add_argument("--projections", default=None, help="the command's --projections (default: its own)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=ROOT[,NAME=VALUE...]",
                        help="also alternate the command run from another checkout with these variables")
    parser.add_argument("--bare", nargs=2, metavar=("DIRECTORY", "BATCHES"), help=argparse.SUPPRESS)  # the bare command
    args = parser.parse_args()
    if args.bare:
        bare_main(*args.bare)
        return

    folder = Path(tempfile.mkdtemp(prefix="kvmem-command-"))
    try:  # the atlas (about 300 MB at 2,000 tokens) and the batches go with the folder
        out = folder / "atlas"
        directory, batches = prepare_bare(args.model, args.corpus, args.tokens, folder)
        def scan_command(target: Path) -> list[str]:
            return [sys.executable, "-m", "kvmem", "scan", "--model", args.model, "--corpus", args.corpus,
                    "--max-tokens", str(args.tokens), "--out", str(target), "--overwrite", "--quiet",
                    *(["--projections", args.projections] if args.projections else [])]

        command = scan_command(out)
        bare = [sys.executable, str(HERE / "whole_command.py"), "--bare", directory, str(batches)]
        variants = {}  # label -> (root, environment)
        for spec in args.variant:
            label, _, rest = spec.partition("=")
            root, *pairs = rest.split(",")
            variants[label] = (Path(root), {**os.environ, "PYTHONPATH": root, **dict(p.split("=", 1) for p in pairs)})
        if args.warm_up and not args.cold:
            timed(command)
            for label, (root, env) in variants.items():
                timed(scan_command(folder / label), env, root)
        rounds = {"command": [], "bare": [], **{label: [] for label in variants}}
        for _ in range(args.rounds):
            cache = folder / "cache"
            env = {**os.environ, "KVMEM_CACHE": str(cache)} if args.cold else None
            rounds["command"].append(round(timed(command, env), 2))
            shutil.rmtree(cache, ignore_errors=True)
            for label, (root, variant_env) in variants.items():
                variant_env = {**variant_env, "KVMEM_CACHE": str(cache)} if args.cold else variant_env
                rounds[label].append(round(timed(scan_command(folder / label), variant_env, root), 2))
                shutil.rmtree(cache, ignore_errors=True)
            rounds["bare"].append(round(timed(bare), 2))
        manifest = json.loads((out / "manifest.json").read_text())  # the last command's scan
        phases = manifest["timing"]["phases"]
        atlas_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        variant_phases = {label: json.loads((folder / label / "manifest.json").read_text())["timing"]["phases"]
                          for label in variants}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    command_s, bare_s = statistics.median(rounds["command"]), statistics.median(rounds["bare"])
    result = {"model": args.model, "corpus": args.corpus, "tokens": args.tokens, "rounds": rounds, "cold": args.cold,
              "projections": manifest["scan"].get("projections"), "command_seconds": command_s,
              "bare_seconds": bare_s, "ratio": round(bare_s / command_s, 3), "last_scan_phases": phases,
              "atlas_bytes": atlas_bytes, "variants": {label: {"seconds": statistics.median(rounds[label]),
                                                               "ratio": round(bare_s / statistics.median(rounds[label]), 3),
                                                               "last_scan_phases": variant_phases[label]}
                                                       for label in variants},
              "machine": machine()}
    print(f"{args.model}, {args.tokens:,} tokens{' (cold caches)' if args.cold else ''}: the kvmem scan command {command_s:.1f} s "
          f"(runs {rounds['command']}), a bare load + forward command {bare_s:.1f} s (runs {rounds['bare']}) "
          f"-> bare / command {result['ratio']:.2f}; the last scan's phases {phases}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
