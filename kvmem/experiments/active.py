"""Active memories (Geva et al. 2021, sec. 5.1): how many neurons of a layer fire on a given prefix?

At positions drawn uniformly (seeded) from a corpus, tokenized by the scan's rule, each layer's
coefficients m [d_ff] are read at ``hook_post``. A neuron is *active* when m_i > ``threshold``
(Geva et al.'s ReLU: m_i > 0). Gated FFNs (SwiGLU, GeGLU) have signed coefficients, so the table
also counts |m_i| > ``abs_threshold``, and a scale-free measure: the fraction of neurons that carry
90% of the layer's total sub-update weight Σ|m_i|·‖v_i‖.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from kvmem.errors import KvmemError
from kvmem.experiments.argument_checks import check_positive, check_seed
from kvmem.experiments.atlas_inputs import as_atlas, check_fingerprint, resolve_corpus
from kvmem.experiments.forward import Sampled, read_positions, sample_positions, scan_plan
from kvmem.experiments.percent_axes import finish_percent_axes
from kvmem.experiments.result_provenance import provenance
from kvmem.experiments.stats import bootstrap_ci

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.atlas import Atlas
    from kvmem.models import Model

__all__ = [
    "ACTIVE_COLUMNS",
    "DEFAULT_ABS_THRESHOLD",
    "active_fractions",
    "active_memories",
    "plot_active_memories",
    "sample_for",
]

DEFAULT_ABS_THRESHOLD = 0.1

ACTIVE_COLUMNS = {
    "layer": "FFN layer",
    "positions": "corpus positions read",
    "active_mean": "mean over positions of the fraction of neurons with m_i > threshold (the positive side)",
    "active_mean_ci_low": "bootstrap 95% interval over positions (low end)",
    "active_mean_ci_high": "its high end",
    "active_q1": "its first quartile over positions",
    "active_median": "its median",
    "active_q3": "its third quartile",
    "abs_active_mean": "mean fraction of neurons with |m_i| > abs_threshold (signed gated coefficients: both sides)",
    "abs_active_mean_ci_low": "bootstrap 95% interval over positions (low end)",
    "abs_active_mean_ci_high": "its high end",
    "mass90_mean": "mean fraction of neurons needed to carry 90% of sum_i |m_i| * ||v_i||",
}


def active_fractions(m: Tensor, *, threshold: float = 0.0, abs_threshold: float = DEFAULT_ABS_THRESHOLD,
                     value_norms: Tensor | None = None) -> dict[str, np.ndarray]:
    """Per position: fractions of active neurons. m [n, d_ff]; value_norms [d_ff] (None: all 1).

    Returns {"active": [n] (m_i > threshold), "abs_active": [n] (|m_i| > abs_threshold),
    "mass90": [n] (fraction of neurons whose largest |m_i|·‖v_i‖ reach 90% of the total)}.
    """
    import torch

    m = m.float()
    d_ff = m.shape[1]
    weight = m.abs() if value_norms is None else m.abs() * value_norms.float()[None]  # [n, d_ff]
    ordered = torch.sort(weight, dim=1, descending=True).values.double()
    cumulative = ordered.cumsum(dim=1)  # [n, d_ff]
    needed = (cumulative < 0.9 * cumulative[:, -1:]).sum(dim=1) + 1  # neurons until 90% is reached
    return {"active": ((m > threshold).sum(dim=1).double() / d_ff).numpy(),
            "abs_active": ((m.abs() > abs_threshold).sum(dim=1).double() / d_ff).numpy(),
            "mass90": (needed.double() / d_ff).numpy()}


def sample_for(model: Model, corpus: Any, atlas: Atlas | None, *, positions: int, seed: int, window: int | None,
               prepend_bos: bool | None, max_tokens: int | None, unit: str) -> tuple[Sampled, Any, dict]:
    """Sampled positions for an experiment; settings default to the atlas's (corpus, window, BOS, tokens)."""

    check_positive("positions", positions)
    check_seed(seed)
    check_positive("max_tokens", max_tokens, allow_none=True)
    corpus = resolve_corpus(atlas, corpus, unit)
    # the atlas's own plan (its shard only), or the scan's for these settings
    plan = scan_plan(model, atlas=atlas, window=window, prepend_bos=prepend_bos, max_tokens=max_tokens)
    sampled = sample_positions(model, corpus, positions=positions, seed=seed, plan=plan)
    settings = {"positions": len(sampled.doc), "requested_positions": positions, "seed": seed, "window": plan.window,
                "prepend_bos": plan.bos_token_id is not None, "max_tokens": plan.max_tokens,
                "shard": list(plan.shard), "sampled_from_tokens": sampled.corpus_tokens}
    return sampled, corpus, settings


def active_memories(model: Model, corpus: Any = None, *, positions: int = 500, threshold: float = 0.0,
                    abs_threshold: float = DEFAULT_ABS_THRESHOLD, seed: int = 0, layers: Sequence[int] | None = None,
                    atlas: Atlas | str | None = None, window: int | None = None, prepend_bos: bool | None = None,
                    max_tokens: int | None = None, unit: str = "document", n_boot: int = 1000,
                    batch_tokens: int = 4096) -> pd.DataFrame:
    """Per layer, the fraction of memory neurons active at random corpus positions (Geva et al.: 10-50%).

    ``corpus``: anything :func:`kvmem.corpus.open_corpus` takes (with ``unit``), or None with ``atlas``
    (its corpus, window, BOS and token count are the defaults). Positions are drawn uniformly from
    the first ``max_tokens`` tokens. Columns :data:`ACTIVE_COLUMNS`; provenance in ``frame.attrs``.
    """
    import torch

    atlas = as_atlas(atlas) if atlas is not None else None
    match = check_fingerprint(atlas, model) if atlas is not None else None
    chosen = list(range(model.n_layers)) if layers is None else sorted({int(x) for x in layers})
    for layer in chosen:
        model.hook_name(layer)  # checks the range
    sampled, corpus, settings = sample_for(model, corpus, atlas, positions=positions, seed=seed, window=window,
                                           prepend_bos=prepend_bos, max_tokens=max_tokens, unit=unit)
    hooks = {layer: model.hook_name(layer, "post") for layer in chosen}
    norms = {layer: model.written_values(layer).norm(dim=1) for layer in chosen}  # [d_ff]
    parts: dict[int, list[dict[str, np.ndarray]]] = {layer: [] for layer in chosen}

    def on_batch(index: np.ndarray, captured: dict[str, torch.Tensor]) -> None:
        for layer, name in hooks.items():
            parts[layer].append(active_fractions(captured[name], threshold=threshold, abs_threshold=abs_threshold,
                                                 value_norms=norms[layer]))

    read_positions(model, sampled.sequences, sampled.reads, list(hooks.values()), on_batch, batch_tokens=batch_tokens)
    rows = []
    for layer in chosen:
        active = np.concatenate([p["active"] for p in parts[layer]])
        abs_active = np.concatenate([p["abs_active"] for p in parts[layer]])
        low, high = bootstrap_ci(active, n_boot=n_boot, seed=seed)
        abs_low, abs_high = bootstrap_ci(abs_active, n_boot=n_boot, seed=seed)
        rows.append({"layer": layer, "positions": len(active), "active_mean": float(active.mean()),
                     "active_mean_ci_low": low, "active_mean_ci_high": high,
                     "active_q1": float(np.quantile(active, 0.25)), "active_median": float(np.median(active)),
                     "active_q3": float(np.quantile(active, 0.75)), "abs_active_mean": float(abs_active.mean()),
                     "abs_active_mean_ci_low": abs_low, "abs_active_mean_ci_high": abs_high,
                     "mass90_mean": float(np.concatenate([p["mass90"] for p in parts[layer]]).mean())})
    frame = pd.DataFrame(rows, columns=list(ACTIVE_COLUMNS))
    frame.attrs = provenance("active_memories", model=model, atlas=atlas, corpus=corpus, settings={
        **settings, "threshold": threshold, "abs_threshold": abs_threshold, "layers": chosen, "n_boot": n_boot,
        "sides": "m_i > threshold: the positive side; |m_i| > abs_threshold: both sides" if model.gated
        else "m_i > threshold (the paper's positive side)",
        "active": "m_i > threshold at hook_post", "abs_active": "|m_i| > abs_threshold"})
    if match is not None:
        frame.attrs["fingerprint_match"] = match
    return frame


def plot_active_memories(frame: pd.DataFrame, *, ax=None):
    """Fraction of active neurons per layer (mean line, quartile band), |m| > threshold and the 90%-mass share."""
    import matplotlib.pyplot as plt

    if not {"layer", "active_mean", "active_q1", "active_q3"} <= set(frame.columns):
        raise KvmemError("plot_active_memories expects the frame of kvmem.experiments.active_memories")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    settings = frame.attrs.get("settings", {})
    ax.fill_between(frame.layer, 100 * frame.active_q1, 100 * frame.active_q3, alpha=0.25)
    ax.plot(frame.layer, 100 * frame.active_mean, marker="o", ms=3,
            label=f"m_i > {settings.get('threshold', 0)} (mean, quartiles)")
    if "abs_active_mean" in frame:
        ax.plot(frame.layer, 100 * frame.abs_active_mean, ls="--", label=f"|m_i| > {settings.get('abs_threshold', '?')}")
    if "mass90_mean" in frame:
        ax.plot(frame.layer, 100 * frame.mass90_mean, ls=":", label="neurons carrying 90% of Σ|m_i|·‖v_i‖")
    ax.axhspan(10, 50, color="tab:green", alpha=0.08, lw=0, label="Geva et al.: 10-50%")
    return finish_percent_axes(ax, ylabel="neurons (%)",
                               title=f"active memories per position ({frame.attrs.get('model', '?')})")
