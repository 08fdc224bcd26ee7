"""Print the markdown tables of docs/geva2021.md from a results directory.

    python docs/geva2021_tables.py data/geva2021 > /tmp/tables.md

Every number in the "Results" section of docs/geva2021.md comes from this script run on the
committed reference results (data/geva2021), so the page can be checked against them.
"""

from __future__ import annotations

import sys

import pandas as pd

from kvmem import experiments as E

LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29)


def pct(value: float, digits: int = 1) -> str:
    return f"{100 * value:.{digits}f}"


def interval(row, column: str, scale: float = 100, digits: int = 1) -> str:
    return (f"{scale * row[column]:.{digits}f} [{scale * row[column + '_ci_low']:.{digits}f}, "
            f"{scale * row[column + '_ci_high']:.{digits}f}]")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def pick(frame: pd.DataFrame, **where) -> pd.DataFrame:
    for column, value in where.items():
        frame = frame[frame[column] == value]
    return frame[frame.layer.isin(LAYERS)].sort_values("layer")


def main(path: str) -> None:
    results = E.load_results(path)
    attrs = results["agreement"].attrs
    print(f"<!-- from {path}: model {attrs['model']} ({attrs['fingerprint']}), corpus {attrs['corpus']}, "
          f"{attrs['atlas_tokens']:,} tokens, kind {attrs['settings']['kind']} -->\n")

    quality = results["lm_quality"]
    print("### The model as an LM on the scanned text\n")
    print(table(["window start", "windows", "predictions", "perplexity", "accuracy % [95% CI]"],
                [[f"`{r.bos_token}`" + (" (default)" if r.bos == "default" else ""), f"{r.windows:,}",
                  f"{r.predictions:,}", f"{r.perplexity:.2f}", interval(r, "accuracy")]
                 for _, r in quality.iterrows()]) + "\n")

    for side in ("positive", "negative"):
        agree = results["agreement"]
        if side not in set(agree.side):
            continue
        print(f"### Agreement, {side} side (% of neurons; 95% bootstrap interval over neurons)\n")
        rows = []
        for layer in LAYERS:
            raw = pick(agree, side=side, convention="raw")
            norm = pick(agree, side=side, convention="final_norm")
            r, n = raw[raw.layer == layer].iloc[0], norm[norm.layer == layer].iloc[0]
            rows.append([layer, interval(r, "agree_top1", digits=2), pct(r.null_top1, 2),
                         interval(r, "agree_top25", digits=1), pct(r.null_top25, 1),
                         interval(n, "agree_top1", digits=2), pct(n.null_top1, 2), pct(r.self_top1, 2)])
        print(table(["layer", "raw top-1", "raw null", "raw any of top-25", "its null", "final_norm top-1",
                     "its null", "raw: trigger's own token (diagnostic)"], rows) + "\n")

        ranks = results["next_token_rank"]
        print(f"### Next-token rank, {side} side (pooled over all kept triggers; paired test against "
              f"shuffled values)\n")
        rows = []
        for layer in LAYERS:
            for convention in ("raw", "final_norm"):
                part = pick(ranks, side=side, convention=convention)
                r = part[part.layer == layer].iloc[0]
                rows.append([layer, convention, f"{r['median']:,.0f} [{r.median_ci_low:,.0f}, {r.median_ci_high:,.0f}]",
                             f"{r.median_top1:,.0f}", f"{r.median_shuffled:,.0f}", f"{r.wilcoxon_z:+.1f}",
                             f"{r.wilcoxon_p:.1e}", f"{r.median_self:,.0f}"])
        print(table(["layer", "convention", "pooled median [95% CI]", "top-1 median", "shuffled median",
                     "Wilcoxon z", "p", "trigger's own token (diagnostic)"], rows) + "\n")

    removal = results["token_removal"]
    print("### Token removal (mean relative change of the coefficient, %; 95% CI over samples)\n")
    rows = []
    for side in sorted(set(removal.side), reverse=True):
        for _, r in pick(removal, side=side).iterrows():
            rows.append([r.layer, side, interval(r, "change_last", digits=0), interval(r, "change_first", digits=0),
                         interval(r, "change_random", digits=0)])
    print(table(["layer", "side", "last token removed", "first token removed", "random token removed"], rows) + "\n")

    active = pick(results["active_memories"])
    print("### Active memories (% of neurons per position; 95% CI over positions)\n")
    print(table(["layer", "m_i > 0", "\\|m_i\\| > 0.1", "neurons carrying 90% of the mass"],
                [[int(r["layer"]), interval(r, "active_mean"), interval(r, "abs_active_mean"), pct(r["mass90_mean"])]
                 for _, r in active.iterrows()]) + "\n")

    layer_vs = results["layer_vs_memories"]
    print("### The layer's prediction vs. its memories (% of positions; 95% CI over positions)\n")
    rows = []
    for layer in LAYERS:
        r = pick(layer_vs, convention="raw")
        n = pick(layer_vs, convention="final_norm")
        r, n = r[r.layer == layer].iloc[0], n[n.layer == layer].iloc[0]
        rows.append([layer, interval(r, "released_matches_none"), pct(r.released_matches_none_positive),
                     interval(n, "released_matches_none"), pct(r.ffn_matches_none), pct(r.after_is_final)])
    print(table(["layer", "raw: no memory's (as released)", "raw: no +v memory's", "final_norm: no memory's",
                 "variant: FFN output is no active memory's", "after FFN = final prediction"], rows) + "\n")

    timings = results["timings"]
    print("### Experiment wall time (s)\n")
    print(table(["step", "seconds"], [[r.step, f"{r.seconds:.0f}"] for _, r in timings.iterrows()]))


if __name__ == "__main__":
    main(sys.argv[1])
