"""Token rules across depth on smollm2-135m: per-layer scores against the derangement and random-init baselines.

    python benchmarks/explain_depth.py [--atlas ATLAS] [--tokens 20000] [--layers 0,5,11,17,23,29] [--random-init]
                                       [--fuzzing] [--hf N] [--figure PATH] [--out DIR]

Without --atlas it scans smollm2-135m over the built-in ``pydoc`` corpus (``--tokens`` tokens, the
given layers, 200 random samples per layer, other settings default) into ``OUT/atlas``. Then:

1. the ``tokens`` explainer explains every neuron side of those layers;
2. ``kvmem score`` scores them with the ``tokens`` judge, one scorer at a time (detection, simulation,
   and fuzzing with ``--fuzzing``), each with its derangement baseline; ``--random-init`` then runs the
   same pipeline on a random-init copy (scanned with the same settings);
3. it prints one row per layer and scorer: mean over sides with a 95% bootstrap interval over sides,
   the quartiles, the baselines' means with intervals, and the share of sides a token rule explains
   (detection's lower 95% bound above 0.5) with its interval, for the model and both baselines;
4. with ``--hf N``: the ``hf:smollm2-135m`` explainer (SmolLM2-135M-Instruct, the model the atlas was
   scanned from) on the positive side of N neurons spread over the layers, scored with the same
   model as judge (detection and simulation, ``--hf-per-band`` activating examples per band and at
   most ``--hf-quiet`` non-activating ones, derangement baseline among those N).

Costs are printed in seconds per neuron for each explainer and scorer. Results: ``OUT/depth.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def _mean_ci(values) -> dict:
    from kvmem.experiments.stats import bootstrap_ci

    values = np.asarray(values, np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        return {"mean": float("nan"), "low": float("nan"), "high": float("nan"), "n": 0}
    low, high = bootstrap_ci(values, n_boot=2000, seed=0)
    q1, median, q3 = np.quantile(values, [0.25, 0.5, 0.75])
    return {"mean": float(values.mean()), "low": low, "high": high, "q1": float(q1), "median": float(median),
            "q3": float(q3), "n": int(len(values))}


def _share(flags) -> dict:
    return _mean_ci(np.asarray(flags, np.float64))


def _fmt(stats: dict, digits: int = 3) -> str:
    return f"{stats['mean']:.{digits}f} [{stats['low']:.{digits}f}, {stats['high']:.{digits}f}]"


def _explained(low) -> np.ndarray:
    """1.0 where a side's lower 95% bound of detection lies above 0.5, 0.0 where not, NaN where unscored."""
    low = np.asarray(low, np.float64)
    return np.where(np.isfinite(low), (low > 0.5).astype(float), np.nan)


def _layer_rows(rows, scorers, random_init: bool) -> list[dict]:
    out = []
    for layer, part in rows.groupby("layer"):
        entry = {"layer": int(layer), "sides": int(len(part))}
        for name in scorers:
            entry[name] = {"model": _mean_ci(part[name]), "derangement": _mean_ci(part[f"{name}_baseline"]),
                           "random_init": _mean_ci(part[f"{name}_random_init"]) if random_init else None}
        shares = {"model": _share(_explained(part.detection_low)),
                  "derangement": _share(_explained(part.detection_baseline_low))}
        if random_init:
            shares["random_init"] = _share(_explained(part.detection_random_init_low))
        entry["explained_share"] = shares
        out.append(entry)
    return out


def _figure(rows, scorers, random_init: bool, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(set(rows.layer))
    fig, axes = plt.subplots(1, len(scorers), figsize=(5 * len(scorers), 3.6), squeeze=False)
    for ax, name in zip(axes[0], scorers):
        series = [("model", name, "C0"), ("derangement", f"{name}_baseline", "C7")]
        if random_init:
            series.append(("random init", f"{name}_random_init", "C3"))
        width = 0.8 / len(series)
        for k, (label, column, colour) in enumerate(series):
            data = [rows[rows.layer == layer][column].dropna().to_numpy() for layer in layers]
            spots = [i + (k - (len(series) - 1) / 2) * width for i in range(len(layers))]
            box = ax.boxplot(data, positions=spots, widths=width * 0.9, patch_artist=True, showfliers=False,
                             manage_ticks=False)
            for patch in box["boxes"]:
                patch.set_facecolor(colour)
                patch.set_alpha(0.6)
            ax.plot([], [], color=colour, lw=6, alpha=0.6, label=label)
        ax.set_xticks(range(len(layers)), [str(x) for x in layers])
        ax.set_xlabel("layer")
        ax.set_ylabel("balanced accuracy" if name != "simulation" else "Pearson r")
        ax.set_title(name)
        ax.axhline(0.5 if name != "simulation" else 0.0, color="k", lw=0.6, ls=":")
    axes[0][0].legend(loc="upper right", fontsize=8)
    fig.suptitle("smollm2-135m, tokens explainer and judge, every neuron side of each layer", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hf_run(atlas, *, neurons: int, judged: int, per_band: int, quiet: int, sim_random: int, timing: dict) -> dict:
    import kvmem
    from kvmem.autointerp.explainers import BackendOptions

    layers = atlas.layers
    chosen = [(layers[i % len(layers)], 7 + 97 * (i // len(layers))) for i in range(neurons)]  # spread, fixed
    options = BackendOptions(batch_size=8)
    start = time.perf_counter()
    kvmem.explain(atlas, neurons=chosen, explainer="hf:smollm2-135m", sides=["positive"], options=options)
    timing["hf_explain_s"] = time.perf_counter() - start
    # judged: all of them, or (fewer) from the first and the last layer, several each, so that each has a
    # derangement baseline in its layer
    judged_pairs = chosen if judged >= len(chosen) else [p for p in chosen if p[0] == layers[0]][:judged // 2] + \
        [p for p in chosen if p[0] == layers[-1]][:judged - judged // 2]
    result = {"neurons": chosen, "judged": judged_pairs, "per_band": per_band, "quiet": quiet,
              "sim_random": sim_random}
    for name in ("detection", "simulation"):
        start = time.perf_counter()
        rows = kvmem.score(atlas, scorers=name, judge="hf:smollm2-135m", explainer="hf:smollm2-135m",
                           neurons=judged_pairs, per_band=per_band if name == "detection" else 1,
                           max_quiet=quiet if name == "detection" else sim_random, options=options)
        timing[f"hf_judge_{name}_s"] = time.perf_counter() - start
        result[name] = {"model": _mean_ci(rows[name]), "derangement": _mean_ci(rows[f"{name}_baseline"]),
                        "above_chance": _share(np.where(np.isfinite(rows[f"{name}_low"]),
                                                        (rows[f"{name}_low"] > (0.5 if name == "detection" else 0))
                                                        .astype(float), np.nan))}
    texts = atlas.explanations(explainer="hf:smollm2-135m")
    result["texts"] = [{"layer": int(r.layer), "neuron": int(r.neuron), "text": r.text,
                        "detection": [float(r.detection), float(r.detection_low), float(r.detection_high),
                                      float(r.detection_baseline)],
                        "simulation": [float(r.simulation), float(r.simulation_low), float(r.simulation_high),
                                       float(r.simulation_baseline)]}
                       for r in texts.itertuples()]
    return result


def _report_hf(atlas, args, results: dict, timing: dict) -> None:
    judged = args.hf_judged or args.hf
    results["hf"] = _hf_run(atlas, neurons=args.hf, judged=judged, per_band=args.hf_per_band,
                            quiet=args.hf_quiet, sim_random=args.hf_sim_random, timing=timing)
    where = "every one" if judged >= args.hf else f"{judged} of them, half from the first and half from the last layer"
    print(f"\nhf:smollm2-135m explainer, positive side of {args.hf} neurons; the same model as judge on {where} "
          f"(detection: {args.hf_per_band} activating examples per band, at most {args.hf_quiet} "
          f"non-activating; simulation: 1 top and {args.hf_sim_random} random records):")
    for t in results["hf"]["texts"]:
        print(f"  L{t['layer']}/{t['neuron']}: {t['text'][:150]!r}")
    for name in ("detection", "simulation"):
        h = results["hf"][name]
        print(f"  {name}: {_fmt(h['model'])}; derangement {_fmt(h['derangement'])}; sides whose interval "
              f"lies above chance {_fmt(h['above_chance'])}")


def main(argv=None) -> int:
    import kvmem

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atlas", default=None)
    parser.add_argument("--out", default="explain-depth")
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--layers", default="0,5,11,17,23,29")
    parser.add_argument("--random-init", action="store_true")
    parser.add_argument("--fuzzing", action="store_true", help="also score fuzzing (tokens judge)")
    parser.add_argument("--hf", type=int, default=0, metavar="N", help="run the hf: explainer on N neurons")
    parser.add_argument("--hf-judged", type=int, default=None, help="score the first N of them (default: all)")
    parser.add_argument("--hf-per-band", type=int, default=2, help="activating examples per band, hf detection")
    parser.add_argument("--hf-quiet", type=int, default=10, help="non-activating examples per side, hf detection")
    parser.add_argument("--hf-sim-random", type=int, default=20,
                        help="random records per side (plus one top record), hf simulation")
    parser.add_argument("--only-hf", action="store_true", help="skip the tokens explainer part (atlas given)")
    parser.add_argument("--figure", default=None, help="write a box plot of the per-layer scores here (png)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = [int(x) for x in args.layers.split(",")]
    timing = {}
    if args.atlas is None:
        atlas_dir = out / "atlas"
        if not (atlas_dir / "manifest.json").exists():
            start = time.perf_counter()
            model = kvmem.load_model("smollm2-135m", device="cpu")
            kvmem.scan(model, "pydoc", out=atlas_dir, max_tokens=args.tokens, random_samples=200, progress=False,
                       layers=layers)
            timing["scan_s"] = time.perf_counter() - start
    else:
        atlas_dir = Path(args.atlas)
    atlas = kvmem.open(atlas_dir)
    layers = [layer for layer in layers if layer in atlas.layers]
    neurons = [(layer, n) for layer in layers for n in range(atlas.d_ff)]
    manifest = atlas.manifest
    provenance = {"model": manifest.model["name"], "corpus": manifest.corpus.get("spec"), "tokens": manifest.tokens,
                  "layers": layers, "kvmem_version": manifest.kvmem_version, "convention": atlas.default_convention}
    if args.only_hf:
        results = dict(provenance, timing=timing)
        _report_hf(atlas, args, results, timing)
        for key, seconds in timing.items():
            count = args.hf if key == "hf_explain_s" else args.hf_judged or args.hf
            print(f"  {key[:-2]}: {seconds:.1f} s, {seconds / count:.2f} s per neuron")
        results["load_average_end"] = list(os.getloadavg())
        (out / "depth-hf.json").write_text(json.dumps(results, indent=1) + "\n")
        return 0
    start = time.perf_counter()
    kvmem.explain(atlas, neurons=neurons)
    timing["tokens_explain_s"] = time.perf_counter() - start
    scorers = ["detection", "simulation"] + (["fuzzing"] if args.fuzzing else [])
    for name in scorers:
        start = time.perf_counter()
        rows = kvmem.score(atlas, scorers=name, explainer="tokens", neurons=neurons)
        timing[f"tokens_judge_{name}_s"] = time.perf_counter() - start
    if args.random_init:
        start = time.perf_counter()
        rows = kvmem.score(atlas, scorers=",".join(scorers), explainer="tokens", neurons=neurons,
                           baseline="random-init")
        timing["random_init_s"] = time.perf_counter() - start
    timing["neurons"] = len(neurons)
    results = dict(provenance, load_average_end=list(os.getloadavg()), timing=timing,
                   per_layer=_layer_rows(rows, scorers, args.random_init))
    print(f"{results['model']}, {results['tokens']:,} tokens of {results['corpus']}, kvmem {results['kvmem_version']}; "
          f"every neuron side of layers {layers} ({len(rows):,} sides); tokens explainer and judge")
    for name in scorers:
        print(f"\n{name}: mean [95% CI over sides] (quartiles) | derangement | random-init")
        for entry in results["per_layer"]:
            s = entry[name]
            rand = _fmt(s["random_init"]) if s["random_init"] else "-"
            print(f"  layer {entry['layer']:>2} ({entry['sides']} sides): {_fmt(s['model'])} "
                  f"({s['model']['q1']:.2f} / {s['model']['median']:.2f} / {s['model']['q3']:.2f}) | "
                  f"{_fmt(s['derangement'])} | {rand}")
    print("\nexplained by a token rule (detection's 95% interval above 0.5): model | derangement | random-init")
    for entry in results["per_layer"]:
        e = entry["explained_share"]
        rand = _fmt(e["random_init"], 3) if "random_init" in e else "-"
        print(f"  layer {entry['layer']:>2}: {_fmt(e['model'])} | {_fmt(e['derangement'])} | {rand}")
    if args.hf:
        _report_hf(atlas, args, results, timing)
    print("\ncosts (seconds per neuron):")
    for key, seconds in timing.items():
        if key.endswith("_s") and key != "scan_s":
            count = (args.hf if key == "hf_explain_s" else args.hf_judged or args.hf) if key.startswith("hf_") \
                else len(neurons)
            print(f"  {key[:-2]}: {seconds:.1f} s, {seconds / count:.4f} s per neuron")
    if "scan_s" in timing:
        print(f"  scan: {timing['scan_s']:.0f} s")
    if args.figure:
        _figure(rows, scorers, args.random_init, Path(args.figure))
    (out / "depth.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
