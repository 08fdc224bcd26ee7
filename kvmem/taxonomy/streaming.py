"""Taxonomy columns from the scan's streaming sums (atlas format 4, scanned with the taxonomy sums on).

Every input is an exact sum the scan kept (``kvmem.scanning.state.LayerState``): the neurons table's
``count``, ``act_sum``, ``act_sq_sum``, ``position_act_sum``, ``position_sum``, ``position_sq_sum`` and the
four ``quadrant_*`` counts, and the ``unigrams`` table. The formulas are in ``docs/taxonomy.md``.

- :func:`position_correlation`: Pearson r of m_i with p, the position in the window (Voita et al. 2024's
  positional neurons);
- :func:`quadrant_shares`: the share of positions in each (sign of gate, sign of up) quadrant (GLUScope,
  Gerstner & Schütze 2026, arXiv 2602.23826);
- :func:`unigram_alignment`: the Pearson correlation, over the tokens the corpus holds, of the neuron's
  direct logit effect W_U^T v_i with the log unigram frequency (Stolfo et al. 2024's token-frequency neurons).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from kvmem.taxonomy.thresholds import Thresholds

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.models import Model

__all__ = ["SCAN_COLUMNS", "frequency_direction", "missing_sums", "position_correlation", "quadrant_shares",
           "scan_columns", "unigram_alignment"]

QUADRANT_COLUMNS = ("quadrant_pp", "quadrant_pn", "quadrant_np", "quadrant_nn")
SCAN_COLUMNS = ("position_correlation", "positional", *QUADRANT_COLUMNS, "unigram_alignment", "token_frequency")


def position_correlation(neurons: pd.DataFrame) -> np.ndarray:
    """Pearson r of m_i with the position p, per row of ``neurons`` -> [n] float64 (NaN: no sums, or m or p constant).

    r = cov / sqrt(var_m · var_p) with cov = Σmp/n − (Σm/n)(Σp/n), var_m = Σm²/n − (Σm/n)² (the neurons
    table's own variance), and var_p = (n Σp² − (Σp)²) / n² from exact integers.
    """
    n = neurons["count"].to_numpy(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_m = neurons.act_sum.to_numpy(np.float64) / n
        var_m = np.maximum(neurons.act_sq_sum.to_numpy(np.float64) / n - mean_m * mean_m, 0.0)
        p_sum = neurons.position_sum.to_numpy(np.float64, na_value=np.nan)
        var_p = np.full(len(neurons), np.nan)
        if neurons.position_sum.notna().all():  # n Σp² − (Σp)² in Python integers (int64 columns, exact)
            exact = [int(c) * int(q) - int(s) ** 2 for c, s, q in
                     zip(neurons["count"], neurons.position_sum.astype(np.int64), neurons.position_sq_sum.astype(np.int64))]
            var_p = np.asarray(exact, np.float64) / (n * n)
        cov = neurons.position_act_sum.to_numpy(np.float64, na_value=np.nan) / n - mean_m * (p_sum / n)
        r = cov / np.sqrt(var_m * var_p)
    return np.where((var_m > 0) & (var_p > 0), r, np.nan)


def quadrant_shares(neurons: pd.DataFrame) -> pd.DataFrame:
    """The four quadrant counts divided by the positions -> DataFrame of QUADRANT_COLUMNS (NaN for a plain FFN)."""
    n = neurons["count"].to_numpy(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return pd.DataFrame({name: neurons[name].to_numpy(np.float64, na_value=np.nan) / n for name in QUADRANT_COLUMNS})


def frequency_direction(counts: np.ndarray, min_count: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(token ids [T] with count >= min_count, centred log frequency g [T] float64): g_t = log(c_t / N) − its mean
    over those tokens, N = Σ_t c_t."""
    seen = np.flatnonzero(counts >= min_count)
    log_frequency = np.log(counts[seen].astype(np.float64) / counts.sum())
    return seen, log_frequency - log_frequency.mean()


def unigram_alignment(values: Tensor, w_u: Tensor, seen: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """Pearson r over the tokens ``seen`` of ℓ_t = W_U[:, t]·v_i with ``direction`` g (centred), for each row v_i
    of ``values`` [n, d_model]; w_u [d_model, vocab] -> [n] float64 (NaN for a zero v_i).

    With W = W_U[:, seen] centred over the tokens (W_c) and u = W_c g: r_i = v_i·u / (sqrt(v_iᵀ W_c W_cᵀ v_i) ‖g‖),
    computed in float64 without forming the [n, T] logit matrix.
    """
    import torch

    w = w_u.double()[:, torch.as_tensor(seen, device=w_u.device)]  # [d_model, T]
    w = w - w.mean(dim=1, keepdim=True)
    g = torch.as_tensor(direction, dtype=torch.float64, device=w.device)
    u = w @ g  # [d_model]
    gram = w @ w.T  # [d_model, d_model]
    v = values.double()
    spread = ((v @ gram) * v).sum(dim=1).clamp_min(0).sqrt()  # ‖ℓ_i − mean‖
    r = (v @ u) / (spread * g.norm())
    r[spread == 0] = float("nan")
    return r.cpu().numpy()


def missing_sums(atlas) -> str | None:
    """Why ``atlas`` holds no taxonomy sums (None when it does)."""
    if atlas.neurons.position_sum.isna().all():
        return "the atlas was scanned with --no-taxonomy-sums; scan again without it to fill these columns"
    return None


def scan_columns(atlas, model: Model, thresholds: Thresholds, *, value_vectors) -> tuple[pd.DataFrame | None, dict]:
    """The scan columns, one row per (layer, neuron) of ``atlas.neurons`` (None when the atlas holds no sums),
    and metadata (tokens of the unigram direction, or why the columns are null). ``value_vectors(model, layer)``:
    v_i as the weight columns read it."""
    import torch

    reason = missing_sums(atlas)
    if reason is not None:
        return None, {"missing": reason}
    neurons = atlas.neurons
    out = pd.DataFrame({"layer": neurons.layer.to_numpy(), "neuron": neurons.neuron.to_numpy()})
    out["position_correlation"] = position_correlation(neurons)
    out["positional"] = np.abs(out.position_correlation.to_numpy()) >= thresholds.positional_correlation
    out = pd.concat([out, quadrant_shares(neurons)], axis=1)
    counts = atlas.table("unigrams").sort_values("token_id")["count"].to_numpy(np.int64)
    seen, direction = frequency_direction(counts, thresholds.unigram_min_count)
    alignment = np.full(len(out), np.nan)
    if len(seen) > 1:
        with torch.no_grad():
            w_u = model.unembedding()
            for layer in sorted(out.layer.unique()):
                rows = np.flatnonzero(out.layer.to_numpy() == layer)
                alignment[rows] = unigram_alignment(value_vectors(model, int(layer)), w_u, seen, direction)[
                    out.neuron.to_numpy()[rows]]
    out["unigram_alignment"] = alignment
    out["token_frequency"] = np.abs(alignment) >= thresholds.unigram_alignment
    meta = {"unigram_tokens": int(counts.sum()), "unigram_types": int(len(seen)),
            "unigram_min_count": thresholds.unigram_min_count, "vocab_size": int(len(counts))}
    return out, meta
