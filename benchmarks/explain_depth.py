"""Token rules across depth on smollm2-135m: per-layer scores against the derangement and random-init baselines.

    python benchmarks/explain_depth.py [--atlas ATLAS] [--tokens 20000] [--layers 0,5,11,17,23,29] [--random-init]
                                       [--neurons-per-layer N]

Without --atlas it scans smollm2-135m over the built-in ``pydoc`` corpus (``--tokens`` tokens, the
given layers, 200 random samples per layer, other settings default) into ``--out``. Then the
``tokens`` explainer explains every neuron side of those layers, ``kvmem score`` scores detection and
simulation (tokens judge, derangement baseline; ``--random-init`` adds the random-init copy, scanned
with the same settings), and it prints one row per layer: mean score with a 95% bootstrap interval
over neuron sides, the baselines' means, and the share of sides a token rule explains (detection's
lower 95% bound above 0.5), with the same share for the baselines. Results: ``OUT/depth.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _mean_ci(values) -> tuple[float, float, float]:
    import numpy as np

    from kvmem.experiments.stats import bootstrap_ci

    values = np.asarray(values, np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan"), float("nan"), float("nan")
    low, high = bootstrap_ci(values, n_boot=2000, seed=0)
    return float(values.mean()), low, high


def main(argv=None) -> int:
    import kvmem

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atlas", default=None)
    parser.add_argument("--out", default="explain-depth")
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--layers", default="0,5,11,17,23,29")
    parser.add_argument("--random-init", action="store_true")
    parser.add_argument("--neurons-per-layer", type=int, default=None, help="only the first N neurons of each layer")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timing = {}
    if args.atlas is None:
        atlas_dir = out / "atlas"
        if not (atlas_dir / "manifest.json").exists():
            start = time.perf_counter()
            model = kvmem.load_model("smollm2-135m", device="cpu")
            kvmem.scan(model, "pydoc", out=atlas_dir, max_tokens=args.tokens, random_samples=200, progress=False,
                       layers=[int(x) for x in args.layers.split(",")])
            timing["scan_s"] = time.perf_counter() - start
    else:
        atlas_dir = Path(args.atlas)
    atlas = kvmem.open(atlas_dir)
    start = time.perf_counter()
    per_layer = args.neurons_per_layer or atlas.d_ff
    kvmem.explain(atlas, neurons=[(layer, n) for layer in atlas.layers for n in range(per_layer)])
    timing["explain_s"] = time.perf_counter() - start
    start = time.perf_counter()
    rows = kvmem.score(atlas, scorers="detection,simulation", explainer="tokens",
                       baseline="random-init" if args.random_init else None)
    timing["score_s"] = time.perf_counter() - start
    timing["neurons"] = len(atlas.layers) * per_layer
    results = {"atlas": str(atlas_dir), "model": atlas.manifest.model["name"], "tokens": atlas.manifest.tokens,
               "timing": timing, "layers": []}
    header = (f"{'layer':>5} {'sides':>6} | {'detection [95% CI]':>22} {'derang.':>7} {'rand-init':>9} | "
              f"{'simulation [95% CI]':>22} {'derang.':>7} {'rand-init':>9} | {'explained':>9} {'derang.':>7} "
              f"{'rand-init':>9}")
    print(header)
    for layer, part in rows.groupby("layer"):
        entry = {"layer": int(layer), "sides": int(len(part))}
        cells = []
        for name in ("detection", "simulation"):
            mean, low, high = _mean_ci(part[name])
            base = _mean_ci(part[f"{name}_baseline"])
            rand = _mean_ci(part[f"{name}_random_init"])
            entry[name] = {"mean": mean, "low": low, "high": high, "median": float(part[name].median()),
                           "baseline": base, "random_init": rand}
            cells.append(f"{mean:6.3f} [{low:.3f}, {high:.3f}] {base[0]:7.3f} {rand[0]:9.3f}")
        share = float((part.detection_low > 0.5).mean())
        share_base = float((part.detection_baseline_low > 0.5).mean())
        share_rand = float((part.detection_random_init_low > 0.5).mean()) if args.random_init else float("nan")
        entry["explained_share"] = {"tokens": share, "baseline": share_base, "random_init": share_rand}
        results["layers"].append(entry)
        print(f"{layer:>5} {len(part):>6} | {cells[0]} | {cells[1]} | {share:9.1%} {share_base:7.1%} {share_rand:9.1%}")
    print(f"explain {timing['explain_s']:.1f} s, score {timing['score_s']:.1f} s for {timing['neurons']:,} neurons: "
          f"{1000 * (timing['explain_s'] + timing['score_s']) / timing['neurons']:.1f} ms per neuron")
    (out / "depth.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
