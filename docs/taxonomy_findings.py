"""Population findings of the neuron taxonomy on one atlas: the figures and numbers of docs/taxonomy.md.

    kvmem scan --model smollm2-135m --corpus pydoc --max-tokens 20000 --out ATLAS
    kvmem taxonomy --atlas ATLAS
    python docs/taxonomy_findings.py --atlas ATLAS --out docs/figures

Writes PNGs (taxonomy_*.png) and taxonomy_findings.json (every number quoted in docs/taxonomy.md) under --out.

The scan-time findings (gate/up quadrants, positional and token-frequency neurons) scan their own small atlas
(a few minutes on 2 cores) and need no taxonomy file:

    python docs/taxonomy_findings.py --scan-sums --tokens 30000 --out docs/figures

They write taxonomy_quadrants.png, taxonomy_positional.png, taxonomy_token_frequency.png and
taxonomy_scan_findings.json.
Intervals are 95% percentile bootstraps (kvmem.experiments.stats.bootstrap_ci): over a layer's neurons for the
per-layer shares, over positions for the ablation effects.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import kvmem
from kvmem.experiments.stats import bootstrap_ci
from kvmem.taxonomy.summary import layer_summary

SHARES = ("dead", "rare", "prediction", "suppression", "entropy_candidate", "enrich_gate", "enrich_up")
MEDIANS = ("value_norm", "null_space_fraction", "vocab_kurtosis", "freq_active", "detector_score")


def _figures(frame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvmem.plots import NEGATIVE, POSITIVE, plot_taxonomy

    panels = [("taxonomy_dead_rare.png", [("dead", POSITIVE), ("rare", NEGATIVE)]),
              ("taxonomy_prediction_suppression.png", [("prediction", POSITIVE), ("suppression", NEGATIVE)]),
              ("taxonomy_enrichment.png", [("enrich_gate", POSITIVE), ("enrich_up", NEGATIVE)]),
              ("taxonomy_entropy_candidates.png", [("entropy_candidate", POSITIVE)])]
    for name, columns in panels:
        fig, ax = plt.subplots(figsize=(5.0, 2.8), layout="constrained")
        for column, color in columns:
            plot_taxonomy(frame, column=column, ax=ax, color=color)
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(8.0, 2.8), layout="constrained")
    plot_taxonomy(frame, column="null_space_fraction", statistic="median", ax=axes[0])
    last = frame[frame.layer == frame.layer.max()]
    axes[1].scatter(last.value_norm, last.null_space_fraction, s=4, color=NEGATIVE, alpha=0.5)
    marked = last[last.entropy_candidate]
    axes[1].scatter(marked.value_norm, marked.null_space_fraction, s=12, color=POSITIVE, label="entropy candidate")
    axes[1].set_xlabel(f"‖v‖ (layer {int(last.layer.iloc[0])})")
    axes[1].set_ylabel("null-space fraction")
    axes[1].legend(fontsize=7, frameon=False)
    fig.savefig(out / "taxonomy_null_space.png", dpi=120)
    plt.close(fig)


def _windows(model, n_windows: int, length: int):
    """``n_windows`` windows of ``length`` pydoc tokens, BOS first [n_windows, 1 + length]."""
    from pydoc_data.topics import topics

    import torch

    ids = model.encode("\n\n".join(topics[key] for key in sorted(topics)))
    step = len(ids) // n_windows
    rows = [[model.bos_token_id] + ids[i * step:i * step + length] for i in range(n_windows)]
    return torch.tensor(rows)


def _effects(model, ids, base, edits: dict) -> dict:
    """Per-position effects of setting the coefficients in ``edits`` (vs ``base`` log-probs [B, T, vocab])."""
    import torch

    with torch.no_grad(), kvmem.intervene(model, edits):
        logp = torch.log_softmax(model.hf_model(ids).logits[:, 1:].float(), dim=-1)
    p_base = base.exp()
    entropy_base = -(p_base * base).sum(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    top = base.argmax(-1, keepdim=True)
    return {"delta_entropy": (entropy - entropy_base).flatten().numpy(),
            "top_changed": (logp.argmax(-1, keepdim=True) != top).float().flatten().numpy(),
            "delta_logp_top": (logp.gather(-1, top) - base.gather(-1, top)).flatten().numpy(),
            "kl": (p_base * (base - logp)).sum(-1).flatten().numpy()}


def _summary(effect: dict) -> dict:
    abs_dh = np.abs(effect["delta_entropy"])
    abs_dl = np.abs(effect["delta_logp_top"])
    low, high = bootstrap_ci(abs_dh)
    return {"abs_delta_entropy": float(abs_dh.mean()), "abs_delta_entropy_ci": [low, high],
            "delta_entropy": float(effect["delta_entropy"].mean()),
            "top_changed": float(effect["top_changed"].mean()),
            "abs_delta_logp_top": float(abs_dl.mean()), "kl": float(effect["kl"].mean())}


def ablations(atlas, frame, *, layers, candidates: int, random: int, n_windows: int, length: int, seed: int) -> dict:
    """Zero-ablation (m_i := 0 at every position) of each layer's top entropy-candidate neurons, ranked by
    ‖P v_i‖² = value_norm² · null_space_fraction, and of ``random`` other neurons of the same layer."""
    import torch

    from kvmem.atlas_origin import load_scanned_model

    model = load_scanned_model(atlas, device="cpu")
    ids = _windows(model, n_windows, length)
    with torch.no_grad():
        base = torch.log_softmax(model.hf_model(ids).logits[:, 1:].float(), dim=-1)
    rng = np.random.default_rng(seed)
    out = {"positions": int(ids.shape[0] * length), "windows": int(n_windows), "window_tokens": int(length),
           "score": "value_norm^2 * null_space_fraction", "layers": {}}
    for layer in layers:
        part = frame[frame.layer == layer].assign(score=lambda f: f.value_norm ** 2 * f.null_space_fraction)
        top = part.sort_values("score", ascending=False).head(candidates)
        pool = np.setdiff1d(part.neuron.to_numpy(), top.neuron.to_numpy())
        chosen = rng.choice(pool, size=random, replace=False)
        rows = []
        for neuron, kind in [(int(n), "candidate") for n in top.neuron] + [(int(n), "random") for n in chosen]:
            row = part[part.neuron == neuron].iloc[0]
            rows.append({"neuron": neuron, "kind": kind, "value_norm": float(row.value_norm),
                         "null_space_fraction": float(row.null_space_fraction),
                         "value_norm_rank": int((part.value_norm > row.value_norm).sum()),
                         **_summary(_effects(model, ids, base, {(int(layer), neuron): 0.0}))})
        randoms = [r for r in rows if r["kind"] == "random"]
        out["layers"][int(layer)] = {"neurons": rows, "random_mean": {
            key: float(np.mean([r[key] for r in randoms]))
            for key in ("abs_delta_entropy", "top_changed", "abs_delta_logp_top", "kl")}}
    return out


QUADRANT_NAMES = {"quadrant_pp": "gate > 0, up > 0", "quadrant_pn": "gate > 0, up ≤ 0",
                  "quadrant_np": "gate ≤ 0, up > 0", "quadrant_nn": "gate ≤ 0, up ≤ 0"}


def _null_alignment(model, seen, direction, *, draws: int, seed: int) -> np.ndarray:
    """|unigram alignment| of ``draws`` isotropic Gaussian directions through the same W_U and unigram direction."""
    import torch

    from kvmem.taxonomy.streaming import unigram_alignment

    generator = torch.Generator().manual_seed(seed)
    vectors = torch.randn(draws, model.d_model, generator=generator, dtype=torch.float64)
    return np.abs(unigram_alignment(vectors, model.unembedding(), seen, direction))


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    keep = np.isfinite(a) & np.isfinite(b)
    ranks = [np.argsort(np.argsort(x[keep])).astype(np.float64) for x in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def scan_findings(*, model_name: str, corpus: str, tokens: int, out: Path, draws: int, seed: int) -> dict:
    """Scan ``tokens`` tokens of ``corpus`` with the taxonomy sums, and summarise quadrants, positional and
    token-frequency neurons per layer (95% bootstrap intervals over the layer's neurons)."""
    import tempfile
    import time

    import matplotlib
    import torch

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvmem.plots import NEGATIVE, POSITIVE, plot_taxonomy
    from kvmem.taxonomy import Thresholds
    from kvmem.taxonomy.streaming import frequency_direction, scan_columns
    from kvmem.taxonomy.weights import value_vectors

    model = kvmem.load_model(model_name)
    thresholds = Thresholds()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        atlas = kvmem.scan(model, corpus, out=Path(tmp) / "atlas", max_tokens=tokens, top_k=5, random_samples=0,
                           bin_samples=0, context_activations=False, key_projections=False, conventions=("raw",),
                           top_n=5, progress=False)
        scan_seconds = time.perf_counter() - start
        frame, meta = scan_columns(atlas, model, thresholds, value_vectors=value_vectors)
        manifest = atlas.manifest
        counts = atlas.table("unigrams").sort_values("token_id")["count"].to_numpy(np.int64)
    with torch.no_grad():  # the weight cosines GLUScope relates to the gate's sign
        cosines = []
        for layer in sorted(frame.layer.unique()):
            values = value_vectors(model, int(layer)).double()
            for name, keys in (("cos_gate_value", model.gate_keys(int(layer))), ("cos_key_value", model.keys(int(layer)))):
                keys = keys.double()
                cosines.append((int(layer), name, ((keys * values).sum(1) / (keys.norm(dim=1) * values.norm(dim=1))).numpy()))
    for name in ("cos_gate_value", "cos_key_value"):
        frame[name] = np.concatenate([c for _, n, c in cosines if n == name])
    frame["gate_positive"] = frame.quadrant_pp + frame.quadrant_pn
    seen, direction = frequency_direction(counts, thresholds.unigram_min_count)
    null = _null_alignment(model, seen, direction, draws=draws, seed=seed)
    null_99 = float(np.quantile(null, 0.99))
    frame["beyond_null"] = np.abs(frame.unigram_alignment) > null_99
    frame["abs_position_correlation"] = frame.position_correlation.abs()
    frame["abs_unigram_alignment"] = frame.unigram_alignment.abs()

    per_layer: dict = {}
    for column in (*QUADRANT_NAMES, "gate_positive", "positional", "token_frequency", "beyond_null"):
        per_layer[column] = layer_summary(frame, column, seed=seed).round(5).to_dict(orient="records")
    for column in ("abs_position_correlation", "abs_unigram_alignment"):
        per_layer[f"median_{column}"] = layer_summary(frame, column, statistic="median", seed=seed).round(5).to_dict(
            orient="records")
    per_layer["spearman_gate_positive_vs_cos_gate_value"] = [
        {"layer": int(layer), "value": round(_spearman(part.cos_gate_value.to_numpy(), part.gate_positive.to_numpy()), 4)}
        for layer, part in frame.groupby("layer")]
    per_layer["spearman_gate_positive_vs_cos_key_value"] = [
        {"layer": int(layer), "value": round(_spearman(part.cos_key_value.to_numpy(), part.gate_positive.to_numpy()), 4)}
        for layer, part in frame.groupby("layer")]
    top = lambda column, n=8: (frame.reindex(frame[column].abs().sort_values(ascending=False).index)  # noqa: E731
                               .head(n)[["layer", "neuron", column]].round(4).to_dict(orient="records"))
    results = {"model": model.name, "fingerprint": model.fingerprint, "corpus": manifest.corpus.get("spec"),
               "tokens": manifest.tokens, "window": manifest.plan.window, "kvmem_version": manifest.kvmem_version,
               "scan_seconds": round(scan_seconds, 1), "thresholds": thresholds.to_dict(), "unigrams": meta,
               "null_alignment": {"draws": draws, "seed": seed, "q99": round(null_99, 4),
                                  "median": round(float(np.median(null)), 4)},
               "totals": {name: int(frame[name].sum()) for name in ("positional", "token_frequency", "beyond_null")},
               "pooled_quadrants": {name: round(float(frame[name].mean()), 5) for name in QUADRANT_NAMES},
               "spearman_gate_positive_vs_cos_gate_value_all": round(_spearman(frame.cos_gate_value.to_numpy(),
                                                                               frame.gate_positive.to_numpy()), 4),
               "spearman_gate_positive_vs_cos_key_value_all": round(_spearman(frame.cos_key_value.to_numpy(),
                                                                              frame.gate_positive.to_numpy()), 4),
               "top_positional": top("position_correlation"), "top_token_frequency": top("unigram_alignment"),
               "per_layer": per_layer}

    colors = [POSITIVE, NEGATIVE, "#7a7a7a", "#c49a00"]
    fig, ax = plt.subplots(figsize=(5.0, 2.8), layout="constrained")
    for (column, label), color in zip(QUADRANT_NAMES.items(), colors):
        plot_taxonomy(frame, column=column, statistic="mean", ax=ax, color=color, label=label)
    ax.set_ylabel("mean share of positions")
    fig.savefig(out / "taxonomy_quadrants.png", dpi=120)
    plt.close(fig)
    for name, columns in (("taxonomy_positional.png", [("positional", POSITIVE)]),
                          ("taxonomy_token_frequency.png", [("token_frequency", POSITIVE), ("beyond_null", NEGATIVE)])):
        fig, axes = plt.subplots(1, 2, figsize=(8.0, 2.8), layout="constrained")
        for column, color in columns:
            plot_taxonomy(frame, column=column, ax=axes[0], color=color)
        value = "abs_position_correlation" if "positional" in name else "abs_unigram_alignment"
        plot_taxonomy(frame, column=value, statistic="median", ax=axes[1], color=NEGATIVE)
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atlas", help="the atlas with a taxonomy table (not with --scan-sums)")
    parser.add_argument("--scan-sums", action="store_true",
                        help="the scan-time findings instead: scan --model over --corpus (--tokens) and summarise")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="pydoc")
    parser.add_argument("--tokens", type=int, default=30000)
    parser.add_argument("--null-draws", type=int, default=2000, help="random directions of the alignment's null")
    parser.add_argument("--out", default="docs/figures")
    parser.add_argument("--layers", default=None, help="layers of the ablations (default: the last two)")
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--random", type=int, default=10)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ablations", action="store_true",
                        help="figures and shares only; ablations already in --out's JSON are kept")
    args = parser.parse_args(argv)
    if args.scan_sums:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        results = scan_findings(model_name=args.model, corpus=args.corpus, tokens=args.tokens, out=out,
                                draws=args.null_draws, seed=args.seed)
        (out / "taxonomy_scan_findings.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
        print(f"wrote {out}/taxonomy_{{quadrants,positional,token_frequency}}.png and "
              f"{out}/taxonomy_scan_findings.json")
        return 0
    if not args.atlas:
        parser.error("--atlas is required (or pass --scan-sums)")
    atlas = kvmem.open(args.atlas)
    frame = atlas.taxonomy.copy()
    frame["enrich_gate"] = frame.cos_gate_value > 0  # NaN (a plain FFN) compares False; such models have no gate
    frame["enrich_up"] = frame.cos_key_value > 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _figures(frame, out)
    meta = frame.attrs["kvmem.taxonomy"]
    results = {"atlas": {"model": meta["model"]["name"], "fingerprint": meta["model"]["fingerprint"],
                         **(meta["atlas"] or {})},
               "thresholds": meta["thresholds"], "null_space_dim": meta["null_space_dim"],
               "timing_seconds": meta["timing_seconds"], "per_layer": {}, "totals": {}}
    for column in SHARES:
        summary = layer_summary(frame, column)
        results["per_layer"][column] = summary.round(5).to_dict(orient="records")
        results["totals"][column] = int(frame[column].astype(bool).sum())
    for column in MEDIANS:
        results["per_layer"][f"median_{column}"] = layer_summary(frame, column, statistic="median").round(5).to_dict(
            orient="records")
    layers = ([int(x) for x in args.layers.split(",")] if args.layers
              else sorted(frame.layer.unique())[-2:])
    previous = out / "taxonomy_findings.json"
    if args.no_ablations and previous.exists():  # redraw the figures, keep the measured ablations
        kept = json.loads(previous.read_text()).get("ablations")
        if kept is not None:
            results["ablations"] = kept
    if not args.no_ablations:
        results["ablations"] = ablations(atlas, frame, layers=layers, candidates=args.candidates, random=args.random,
                                         n_windows=args.windows, length=args.window_tokens, seed=args.seed)
    (out / "taxonomy_findings.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    print(f"wrote {out}/taxonomy_*.png and {out}/taxonomy_findings.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
