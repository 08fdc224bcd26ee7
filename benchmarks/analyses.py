"""Every analysis of an atlas, as a user runs it from the shell, beside one bare forward over its tokens.

Each analysis is a whole command in a fresh process (imports, model load where it needs the model,
the work, writing its output): every ``kvmem experiment``, ``kvmem taxonomy``, ``kvmem explain --all``
(the offline token explainer) and ``kvmem score`` (the default scorers, token judge). The bare forward
is a fresh Python that loads the atlas's model with ``AutoModelForCausalLM`` and runs its forward with
logits over exactly the batches the scan read (no kvmem import). The atlas is linked into a temporary
directory first (explain, score and taxonomy write beside its tables). ``--baseline-source DIR`` runs
each analysis of another kvmem checkout before this one's (alternated) and says whether their outputs
are equal.

How each grows, and its projection to Llama-3.1-8B (32 layers × 14,336 = 458,752 neurons, d_model
4,096, vocabulary 128,256, 8.0B parameters), are stated per analysis in :data:`GROWTH`: the measured
seconds times the ratio of the quantity that dominates, beside the bare forward over the same tokens
projected by the ratio of parameters. These are projections, not measurements.

    python benchmarks/analyses.py --atlas ATLAS [--only next-token-rank,taxonomy] [--baseline-source DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import HERE, machine

ROOT = HERE.parent
LLAMA_8B = {"neurons": 458_752, "d_model": 4_096, "vocab": 128_256, "params": 8.03e9}

# analysis -> (command words after `kvmem`, with {atlas} and {out}; output file to compare or None)
COMMANDS: dict[str, tuple[list[str], str | None]] = {
    **{name: (["experiment", name, "--atlas", "{atlas}", "--out", "{out}/" + name + ".csv"], name + ".csv")
       for name in ("agreement", "next-token-rank", "token-removal", "active-memories", "layer-vs-memories",
                    "lm-quality")},
    "taxonomy": (["taxonomy", "--atlas", "{atlas}", "--out", "{out}/taxonomy.parquet"], "taxonomy.parquet"),
    "explain": (["explain", "--atlas", "{atlas}", "--all", "--no-progress"], None),
    "score": (["score", "--atlas", "{atlas}", "--no-progress"], None),
}

# analysis -> (how its cost grows, the factor that takes it to Llama-3.1-8B given the atlas's model)
GROWTH = {
    "agreement": ("atlas rows: neurons × kept triggers, and a bootstrap over neurons per layer", "neurons"),
    "next-token-rank": ("neurons × vocab × d_model (the scores, a float32 GEMM per convention, both sides at once) + "
                        "neurons × vocab (one counting pass over each value's scores)", "neurons*vocab*d_model"),
    "token-removal": ("forwards over a fixed sample of prefixes per layer (two per window holding sampled triggers, "
                      "read at every layer, and one per sample for the random removal): layers × parameters",
                      "layers*params"),
    "active-memories": ("one forward over a fixed number of positions: parameters", "params"),
    "layer-vs-memories": ("one forward over a fixed number of positions, each memory's top token read from the "
                          "atlas: parameters", "params"),
    "lm-quality": ("a forward over the scanned text per BOS choice: parameters × atlas tokens", "params"),
    "taxonomy": ("neurons × vocab × d_model (vocabulary moments of every value) + atlas rows", "neurons*vocab*d_model"),
    "explain": ("neurons × sides × kept examples (token rules from the atlas) + neurons × vocab × d_model (each "
                "value's written tokens, projected on demand unless the per-model cache holds the tables)",
                "neurons*vocab*d_model"),
    "score": ("neurons × sides × (held-out examples + bootstrap replicates and permutations; token judge) + the "
              "written tokens' projection, as explain", "neurons"),
}


def bare_main(directory: str, batches: str) -> None:
    """The bare forward (``--bare DIR BATCHES`` in a fresh process): no kvmem import."""
    import torch
    from transformers import AutoModelForCausalLM
    from whole_scan import forward_seconds

    forward_seconds(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), torch.load(batches))


def factors(manifest: dict) -> dict[str, float]:
    """The ratio of each growth quantity between Llama-3.1-8B and the atlas's model."""
    model = manifest["model"]
    layers = len(manifest["layers"])
    neurons = layers * model["d_ff"]
    d = model["d_model"]  # parameters, about: 4 d² of attention and the FFN per layer, and the embedding
    params = model["n_layers"] * (4 * d * d + manifest["anatomy"]["ffn_params_per_layer"]) + model["vocab_size"] * d
    return {"neurons": LLAMA_8B["neurons"] / neurons,
            "neurons*vocab*d_model": (LLAMA_8B["neurons"] * LLAMA_8B["vocab"] * LLAMA_8B["d_model"])
            / (neurons * model["vocab_size"] * d),
            "params": LLAMA_8B["params"] / params,
            "layers*params": (32 * LLAMA_8B["params"]) / (layers * params)}


def timed(argv: list[str], env: dict, cwd: Path = ROOT) -> dict:
    """Seconds of one command started in ``cwd`` (``python -m kvmem`` imports the kvmem of its working
    directory first, whatever PYTHONPATH says), with the load average before and after."""
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv[-8:])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return {"seconds": round(seconds, 1), "load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1)}


def same_output(a: Path, b: Path) -> bool | None:
    if not (a.exists() and b.exists()):
        return None
    if a.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(a).equals(pd.read_parquet(b))
    return a.read_bytes() == b.read_bytes()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--atlas", help="the atlas to analyse (required)")
    parser.add_argument("--only", default=None, help="comma-separated analyses (default: all, and the bare forward)")
    parser.add_argument("--no-bare", dest="bare", action="store_false", help="skip the bare forward")
    parser.add_argument("--layers", default=None, help="the experiments' --layers (default: every layer)")
    parser.add_argument("--baseline-source", default=None, help="another kvmem checkout, run before each analysis")
    parser.add_argument("--bare-run", nargs=2, metavar=("DIRECTORY", "BATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_run:
        bare_main(*args.bare_run)
        return
    if args.atlas is None:
        parser.error("the following arguments are required: --atlas")
    names = list(COMMANDS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(COMMANDS))
    if unknown:
        sys.exit(f"unknown analyses {unknown}; choose from {', '.join(COMMANDS)}")
    source = Path(args.atlas).resolve()
    manifest = json.loads((source / "manifest.json").read_text())
    scale = factors(manifest)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    variants = {"this": (env, ROOT)}
    if args.baseline_source:
        baseline = Path(args.baseline_source).resolve()
        variants = {"baseline": ({**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(baseline), os.environ.get("PYTHONPATH", "")])}, baseline), **variants}
    folder = Path(tempfile.mkdtemp(prefix="kvmem-analyses-"))
    results: dict = {}
    try:
        bare = None
        if args.bare:
            import torch
            from whole_scan import scan_batches

            import kvmem

            model = kvmem.load_model(manifest["model"]["name"])
            batches = folder / "batches.pt"
            torch.save(scan_batches(model, manifest["corpus"]["spec"], manifest["tokens"]), batches)
            bare = timed([sys.executable, str(HERE / "analyses.py"), "--bare-run", model.source, str(batches)], env)
            del model
        for name in names:
            words, output = COMMANDS[name]
            row = {}
            for variant, (variant_env, cwd) in variants.items():
                atlas, out = folder / variant / "atlas", folder / variant / "out"
                if not atlas.exists():
                    shutil.copytree(source, atlas, copy_function=os.link)
                    out.mkdir(parents=True)
                argv = [sys.executable, "-m", "kvmem", *(w.format(atlas=atlas, out=out) for w in words)]
                if args.layers and words[0] == "experiment" and name != "lm-quality":
                    argv += ["--layers", args.layers]
                row[variant] = timed(argv, variant_env, cwd)
            if args.baseline_source and output:
                row["equal_outputs"] = same_output(folder / "baseline" / "out" / output, folder / "this" / "out" / output)
            results[name] = row
            print(json.dumps({name: row}), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\n{manifest['model']['name']} atlas: {manifest['tokens']:,} tokens, {len(manifest['layers'])} layers × "
          f"{manifest['model']['d_ff']} neurons, vocab {manifest['model']['vocab_size']:,}; {machine()}")
    if bare:
        print(f"bare forward over its tokens: {bare['seconds']} s (load average {bare['load_before']} -> "
              f"{bare['load_after']}); Llama-3.1-8B over the same tokens: about "
              f"{bare['seconds'] * scale['params'] / 3600:.1f} h on this machine")
    for name, row in results.items():
        growth, factor = GROWTH[name]
        seconds = row["this"]["seconds"]
        against = f", {seconds / bare['seconds']:.2f} × the bare forward" if bare else ""
        before = f"; baseline {row['baseline']['seconds']} s, equal outputs: {row.get('equal_outputs')}" \
            if "baseline" in row else ""
        print(f"{name:>18}: {seconds} s{against} (load {row['this']['load_before']}){before}\n"
              f"{'':>20}grows with {growth}; Llama-3.1-8B: × {scale[factor]:.0f} -> about "
              f"{seconds * scale[factor] / 3600:.1f} h here")
    print(json.dumps({"atlas": str(source), "tokens": manifest["tokens"], "bare": bare, "results": results,
                      "factors": scale, "machine": machine()}))


if __name__ == "__main__":
    main()
