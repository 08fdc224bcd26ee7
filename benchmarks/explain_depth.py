"""Token rules across depth on smollm2-135m: per-layer scores against scrambled explanations and a random-init copy.

    python benchmarks/explain_depth.py --atlas ATLAS [--layers 0,5,11,17,23,29] [--scorers ...] [--figure PATH]
                                       [--by-eye 30] [--out DIR] [--no-score] [--random-init-atlas DIR]

On an atlas (the findings in docs/explanations.md use /work/atlases' ``smollm2-100k-r100``: 100,000 tokens of
``pydoc``, default scan settings, 100 random samples per layer):

1. the ``tokens`` explainer explains every neuron side of the layers;
2. ``kvmem score`` scores them with the ``tokens`` judge (detection, fuzzing, simulation, output by default),
   each with its derangement baseline (another neuron's explanation of the same layer and side: the
   scrambled explanations), its p-value and the paired interval of score minus baseline; then the same
   pipeline runs on the random-init copy (:func:`kvmem.autointerp.randominit.random_init_atlas`, or the
   atlas ``--random-init-atlas``), whose scores are stored in the trained rows' ``S_random_init`` columns
   (what ``baseline="random-init"`` does in one call; here the two atlases can be scored by two processes,
   and ``--no-score`` reads what is stored);
3. per layer and scorer it prints, over the scorable sides (status ok): the mean with a 95% bootstrap
   interval over sides for the model, the scrambled explanations and the random-init copy; the share of
   sides with p < 0.05 in the model and in the copy; and the share whose paired interval lies above 0;
4. ``--by-eye N``: N sides spread over the layers (both sides of a gated neuron alternate) with their top
   triggers, written tokens, explanation and scores, for a reader to judge (``OUT/by_eye.md``).

Results: ``OUT/depth.json``; the costs of each phase are printed (seconds, and per side).
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


def _layer_rows(rows, scorers) -> list[dict]:
    out = []
    for layer, part in rows.groupby("layer"):
        entry = {"layer": int(layer), "sides": int(len(part))}
        for name in scorers:
            ok = part[part[f"{name}_status"] == "ok"]
            ri = part[f"{name}_random_init"]
            entry[name] = {
                "scorable": int(len(ok)), "model": _mean_ci(ok[name]), "scrambled": _mean_ci(ok[f"{name}_baseline"]),
                "random_init": _mean_ci(ri), "p05_model": _share((ok[f"{name}_p"] < 0.05).astype(float)),
                "p05_random_init": _share((part[f"{name}_random_init_p"][ri.notna()] < 0.05).astype(float)),
                "above_scrambled": _share((ok[f"{name}_diff_low"] > 0).astype(float)),
                "n_median": float(ok[f"{name}_n"].median()) if len(ok) else float("nan"),
                "n_quiet_median": float(ok[f"{name}_n_quiet"].median()) if len(ok) else float("nan")}
        out.append(entry)
    return out


def _with_random_init(atlas, rows, other, scorers):
    """``rows`` with each scorer's ``S_random_init`` columns from the sibling's rows of the same sides, stored."""
    from kvmem.autointerp import store

    key = ["layer", "neuron", "side", "explainer"]
    columns = {f"{s}{suffix}": f"{s}_random_init{suffix}" for s in scorers for suffix in ("", "_low", "_high", "_p")}
    merged = rows.drop(columns=list(columns.values())).merge(other[key + list(columns)].rename(columns=columns),
                                                             on=key, how="left")
    store.write(atlas.path, store.upsert(store.read(atlas.path), merged))
    return merged


def _markdown(results: dict, scorers) -> str:
    """The per-layer tables of docs/explanations.md."""
    unit = {"simulation": "Pearson r", "output": "balanced accuracy", "detection": "balanced accuracy",
            "fuzzing": "balanced accuracy"}
    out = []
    for name in scorers:
        out += [f"**{name}** ({unit.get(name, 'score')}; mean over the layer's scorable sides [95% interval]):", "",
                "| layer | model | scrambled explanations | random-init | p < 0.05: model | p < 0.05: random-init | "
                "above scrambled (paired) |", "|---:|---|---|---|---|---|---|"]
        for entry in results["per_layer"]:
            s = entry[name]
            pct = [f"{100 * s[k]['mean']:.1f}% [{100 * s[k]['low']:.1f}, {100 * s[k]['high']:.1f}]"
                   for k in ("p05_model", "p05_random_init", "above_scrambled")]
            out.append(f"| {entry['layer']} | {_fmt(s['model'])} | {_fmt(s['scrambled'])} | {_fmt(s['random_init'])} | "
                       f"{pct[0]} | {pct[1]} | {pct[2]} |")
        out.append("")
    return "\n".join(out)


def _figure(rows, scorers, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(set(rows.layer))
    fig, axes = plt.subplots(1, len(scorers), figsize=(4.5 * len(scorers), 3.6), squeeze=False)
    for ax, name in zip(axes[0], scorers):
        ok = rows[rows[f"{name}_status"] == "ok"]
        series = [("model", ok, name, "C0"), ("scrambled", ok, f"{name}_baseline", "C7"),
                  ("random init", rows, f"{name}_random_init", "C3")]
        width = 0.8 / len(series)
        for k, (label, frame, column, colour) in enumerate(series):
            data = [frame[frame.layer == layer][column].dropna().to_numpy() for layer in layers]
            spots = [i + (k - (len(series) - 1) / 2) * width for i in range(len(layers))]
            box = ax.boxplot(data, positions=spots, widths=width * 0.9, patch_artist=True, showfliers=False,
                             manage_ticks=False)
            for patch in box["boxes"]:
                patch.set_facecolor(colour)
                patch.set_alpha(0.6)
            ax.plot([], [], color=colour, lw=6, alpha=0.6, label=label)
        ax.set_xticks(range(len(layers)), [str(x) for x in layers])
        ax.set_xlabel("layer")
        ax.set_ylabel("Pearson r" if name == "simulation" else "balanced accuracy")
        ax.set_title(name)
        ax.axhline(0.0 if name == "simulation" else 0.5, color="k", lw=0.6, ls=":")
    axes[0][0].legend(loc="upper right", fontsize=8)
    fig.suptitle("smollm2-135m, tokens explainer and judge, every neuron side of each layer", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _by_eye(atlas, rows, count: int, path: Path) -> None:
    """``count`` sides spread over the layers: triggers, written tokens, explanation and scores, as Markdown."""
    layers = sorted(set(rows.layer))
    lines = [f"# {count} sides by eye", ""]
    for i in range(count):
        layer, neuron = layers[i % len(layers)], 11 + 149 * (i // len(layers))
        side = "positive" if (i // len(layers)) % 2 == 0 else "negative"
        row = rows[(rows.layer == layer) & (rows.neuron == neuron) & (rows.side == side)]
        if not len(row):
            continue
        row = row.iloc[0]
        triggers = atlas.triggers(layer, neuron, kind="top" if side == "positive" else "bottom").head(8)
        values = atlas.values(layer, neuron, convention=atlas.default_convention)
        up, down = ("promote", "suppress") if side == "positive" else ("suppress", "promote")
        lines += [f"## L{layer}/{neuron} {side}", "", f"explanation: {row.text}", "",
                  "triggers: " + " | ".join(repr(f"{t.context[max(0, t.span_start - 30):t.span_start]}[[{t.context[t.span_start:t.span_end]}]]")
                                            for t in triggers.itertuples()), "",
                  "writes: " + ", ".join(repr(t) for t in values[values.kind == up].sort_values("rank").token.head(12)),
                  "", "pushes down: " + ", ".join(repr(t) for t in values[values.kind == down].sort_values("rank")
                                                 .token.head(8)), "",
                  "scores: " + "; ".join(f"{s} {row[s]:.2f} (p {row[f'{s}_p']:.3g}, baseline {row[f'{s}_baseline']:.2f})"
                                         for s in ("detection", "simulation", "output") if f"{s}_p" in row), ""]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    import kvmem
    from kvmem.autointerp import explanations

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atlas", required=True)
    parser.add_argument("--out", default="explain-depth")
    parser.add_argument("--layers", default="0,5,11,17,23,29")
    parser.add_argument("--scorers", default="detection,fuzzing,simulation,output")
    parser.add_argument("--no-random-init", action="store_true")
    parser.add_argument("--random-init-atlas", default=None, help="the random-init sibling (default: made or reused)")
    parser.add_argument("--no-score", action="store_true", help="read the stored scores (explain and score skipped)")
    parser.add_argument("--by-eye", type=int, default=0, metavar="N")
    parser.add_argument("--figure", default=None, help="write a box plot of the per-layer scores here (png)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atlas = kvmem.open(args.atlas)
    layers = [layer for layer in (int(x) for x in args.layers.split(",")) if layer in atlas.layers]
    neurons = [(layer, n) for layer in layers for n in range(atlas.d_ff)]
    scorers = [s.strip() for s in args.scorers.split(",")]
    timing = {}
    for name, target in [("", atlas)] + ([] if args.no_random_init else [("random_init_", None)]):
        if target is None:
            from kvmem.autointerp.randominit import random_init_atlas

            target = kvmem.open(args.random_init_atlas) if args.random_init_atlas else random_init_atlas(atlas)
            sibling = target
        if args.no_score:
            continue
        start = time.perf_counter()
        kvmem.explain(target, neurons=neurons)
        timing[f"{name}explain_s"] = time.perf_counter() - start
        start = time.perf_counter()
        kvmem.score(target, scorers=",".join(scorers), explainer="tokens", neurons=neurons)
        timing[f"{name}score_s"] = time.perf_counter() - start
    rows = explanations(atlas, explainer="tokens", neurons=neurons)
    if not args.no_random_init:
        rows = _with_random_init(atlas, rows, explanations(sibling, explainer="tokens", neurons=neurons), scorers)
    m = atlas.manifest
    results = {"model": m.model["name"], "corpus": m.corpus.get("spec"), "tokens": m.tokens, "layers": layers,
               "scan": {k: m.scan.get(k) for k in ("random_samples", "top_k", "bin_samples", "context_before",
                                                  "context_after")},
               "kvmem_version": m.kvmem_version, "convention": atlas.default_convention, "sides": int(len(rows)),
               "timing": timing, "load_average_end": list(os.getloadavg()),
               "per_layer": _layer_rows(rows, scorers)}
    print(f"{results['model']}, {results['tokens']:,} tokens of {results['corpus']}, kvmem {results['kvmem_version']}; "
          f"{len(rows):,} sides of layers {layers}; tokens explainer and judge")
    for name in scorers:
        print(f"\n{name}: mean [95% CI over sides] | scrambled | random-init | p<0.05 model | p<0.05 random-init | "
              f"above scrambled (paired)")
        for entry in results["per_layer"]:
            s = entry[name]
            print(f"  layer {entry['layer']:>2} ({s['scorable']}/{entry['sides']} scorable, n {s['n_median']:.0f}, "
                  f"quiet {s['n_quiet_median']:.0f}): {_fmt(s['model'])} | {_fmt(s['scrambled'])} | "
                  f"{_fmt(s['random_init'])} | {_fmt(s['p05_model'])} | {_fmt(s['p05_random_init'])} | "
                  f"{_fmt(s['above_scrambled'])}")
    print("\ncosts:")
    for key, seconds in timing.items():
        print(f"  {key[:-2]}: {seconds:.1f} s, {1000 * seconds / len(rows):.2f} ms per side")
    if "explain_s" not in timing:
        print("  (read from the stored scores)")
    if args.figure:
        _figure(rows, scorers, Path(args.figure))
    if args.by_eye:
        _by_eye(atlas, rows, args.by_eye, out / "by_eye.md")
    (out / "depth.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "depth.md").write_text(_markdown(results, scorers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
