"""Weight statistics of every neuron: norms, key-value cosines, vocabulary-projection moments, null-space share.

Every value vector comes from :func:`value_vectors` (what neuron i writes into the residual stream: kvmem's
``raw`` convention, through :func:`kvmem.conventions.value_vectors`) and W_U from ``model.unembedding()``
[d_model, vocab], so architecture-specific value semantics (post-FFN norm gains, residual multipliers, OPT's
``project_out``) apply here exactly as they do everywhere else in kvmem.

The vocabulary-wide statistics are computed in blocks of neurons: a block's cosines [block, vocab] are the
largest array held (the whole [n_layers · d_ff, vocab] matrix never exists).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from kvmem.buffers import Buffers
from kvmem.conventions import value_vectors as convention_values
from kvmem.errors import KvmemError
from kvmem.taxonomy.thresholds import Thresholds

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.models import Model

__all__ = ["VALUE_CONVENTION", "null_space_basis", "unit_unembedding", "value_vectors", "vocab_moments",
           "weight_statistics"]

VALUE_CONVENTION = "raw"  # v_i as it reaches the residual stream; no final norm


def value_vectors(model: Model, layer: int) -> Tensor:
    """What each neuron of ``layer`` writes into the residual stream per unit coefficient [d_ff, d_model] float32."""
    return convention_values(model, layer, VALUE_CONVENTION)


def unit_unembedding(model: Model) -> Tensor:
    """W_U with unit columns [d_model, vocab] float32 (a zero column stays zero)."""
    w_u = model.unembedding().float()  # [d_model, vocab]
    norms = w_u.norm(dim=0, keepdim=True)
    return w_u / norms.clamp_min(1e-30)


def null_space_basis(w_u: Tensor, k: int) -> Tensor:
    """Orthonormal basis [d_model, k] float64 of the span of W_U's k smallest left singular directions.

    W_U [d_model, vocab]; its left singular vectors are the eigenvectors of W_U W_U^T [d_model, d_model]
    (eigenvalues σ², ascending), computed in float64.
    """
    import torch

    d_model = w_u.shape[0]
    if not 1 <= k <= d_model:
        raise KvmemError(f"null-space dimension {k} must lie in 1..{d_model} (d_model)")
    w = w_u.double()
    _, vectors = torch.linalg.eigh(w @ w.T)  # ascending eigenvalues
    return vectors[:, :k]


def vocab_moments(values: Tensor, unit_w_u: Tensor, *, block: int = 512) -> dict[str, np.ndarray]:
    """Moments over the vocabulary of c_t = cos(W_U[:, t], v_i) for each row v_i of ``values`` [n, d_model].

    Returns ``mean``, ``std`` (population), ``skew`` (m3 / m2^1.5) and ``kurtosis`` (excess: m4 / m2² − 3),
    each [n] float64, with m_k the k-th central moment over the vocabulary (no bias correction, as
    ``scipy.stats.skew`` / ``kurtosis`` with their defaults). A zero vector gets NaN.
    """
    import torch

    n = values.shape[0]
    out = {name: np.empty(n) for name in ("mean", "std", "skew", "kurtosis")}
    unit_w_u = unit_w_u.float()
    buffers = Buffers()  # the blocks' [b, vocab] scratch tensors, reused
    vocab, device = unit_w_u.shape[1], unit_w_u.device

    def buffer(name: str, rows: int, dtype) -> Tensor:
        return buffers.get(name, (rows, vocab), dtype, device)

    for start in range(0, n, block):
        v = values[start:start + block].float()  # [b, d_model]
        b = v.shape[0]
        norms = v.norm(dim=1, keepdim=True)
        scores = torch.matmul(v / norms.clamp_min(1e-30), unit_w_u, out=buffer("scores", b, torch.float32))  # [b, vocab]
        for lo, hi in _row_groups(b, MOMENT_ROWS):
            _moments_into(out, start + lo, scores[lo:hi], norms[lo:hi, 0], buffer)
    return out


MOMENT_ROWS = 16  # rows whose float64 moments are taken together: their [rows, vocab] arrays stay in the CPU's cache


def _row_groups(rows: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) groups of ``size`` rows covering ``rows``; a last group of one row joins the one before, since torch
    sums a lone row's reduction in another order (split over threads) than a row among several (each row whole)."""
    groups = [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]
    if len(groups) > 1 and groups[-1][1] - groups[-1][0] == 1:
        groups[-2:] = [(groups[-2][0], rows)]
    return groups


def _moments_into(out: dict[str, np.ndarray], at: int, scores: Tensor, norms: Tensor, buffer) -> None:
    """The float64 central moments of the rows of ``scores`` [r, vocab] (float32 cosines) into ``out`` at ``at``."""
    import torch

    r = scores.shape[0]
    cos = buffer("cos", r, torch.float64).copy_(scores)
    mean = cos.mean(dim=1, keepdim=True)
    centred = cos.sub_(mean)
    sq = torch.mul(centred, centred, out=buffer("sq", r, torch.float64))
    m2 = sq.mean(dim=1)
    m3 = torch.mul(sq, centred, out=buffer("cube", r, torch.float64)).mean(dim=1)
    m4 = sq.square_().mean(dim=1)
    zero = (norms == 0) | (m2 == 0)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=m2.device)
    rows = slice(at, at + r)
    out["mean"][rows] = torch.where(zero, nan, mean[:, 0]).cpu().numpy()
    out["std"][rows] = torch.where(zero, nan, m2.sqrt()).cpu().numpy()
    out["skew"][rows] = torch.where(zero, nan, m3 / m2.pow(1.5)).cpu().numpy()
    out["kurtosis"][rows] = torch.where(zero, nan, m4 / m2.square() - 3.0).cpu().numpy()
    return out


def _cosine_rows(a: Tensor, b: Tensor) -> np.ndarray:
    """Row-wise cosine of a [n, d] and b [n, d] -> [n] float64 (NaN where either row is zero)."""
    a, b = a.double(), b.double()
    denominator = a.norm(dim=1) * b.norm(dim=1)
    cos = (a * b).sum(dim=1) / denominator
    cos[denominator == 0] = float("nan")
    return cos.cpu().numpy()


def weight_statistics(model: Model, *, layers=None, thresholds: Thresholds | None = None, block: int = 512,
                      timing: dict | None = None) -> pd.DataFrame:
    """One row per (layer, neuron) of the weight columns of :data:`kvmem.taxonomy.table.COLUMNS`.

    ``layers``: the layers (default all). ``timing``: a dict that receives seconds per phase
    (``null_space``, ``vocab``, ``other``).
    """
    import torch

    thresholds = thresholds or Thresholds()
    layers = list(range(model.n_layers)) if layers is None else [int(layer) for layer in layers]
    clock = timing if timing is not None else {}
    frames = []
    with torch.no_grad():
        t0 = time.perf_counter()
        w_u = model.unembedding().float()  # [d_model, vocab]
        basis = null_space_basis(w_u, thresholds.null_space_dim(model.d_model))  # [d_model, k]
        unit_w_u = unit_unembedding(model)
        clock["null_space"] = time.perf_counter() - t0
        clock.setdefault("vocab", 0.0)
        clock.setdefault("other", 0.0)
        for layer in layers:
            t1 = time.perf_counter()
            values = value_vectors(model, layer)  # [d_ff, d_model]
            keys = model.keys(layer).float()  # [d_ff, d_model]
            gates = model.gate_keys(layer)
            value_sq = values.double().square().sum(dim=1)
            null_sq = (values.double() @ basis).square().sum(dim=1)
            null_fraction = (null_sq / value_sq).cpu().numpy()
            null_fraction[value_sq.cpu().numpy() == 0] = np.nan
            frame = {
                "layer": np.full(model.d_ff, layer, np.int16),
                "neuron": np.arange(model.d_ff, dtype=np.int32),
                "key_norm": keys.norm(dim=1).cpu().numpy(),
                "gate_norm": (gates.float().norm(dim=1).cpu().numpy() if gates is not None
                              else np.full(model.d_ff, np.nan, np.float32)),
                "value_norm": values.norm(dim=1).cpu().numpy(),
                "cos_key_value": _cosine_rows(keys, values),
                "cos_gate_value": (_cosine_rows(gates, values) if gates is not None
                                   else np.full(model.d_ff, np.nan)),
                "null_space_fraction": null_fraction,
            }
            t2 = time.perf_counter()
            moments = vocab_moments(values, unit_w_u, block=block)
            clock["vocab"] += time.perf_counter() - t2
            clock["other"] += t2 - t1
            frame.update({"vocab_mean": moments["mean"], "vocab_std": moments["std"],
                          "vocab_skew": moments["skew"], "vocab_kurtosis": moments["kurtosis"]})
            frames.append(pd.DataFrame(frame))
    out = pd.concat(frames, ignore_index=True)
    high = out.vocab_kurtosis.to_numpy() > thresholds.kurtosis
    out["prediction"] = high & (out.vocab_skew.to_numpy() > 0)
    out["suppression"] = high & (out.vocab_skew.to_numpy() < 0)
    norm_cut = out.groupby("layer").value_norm.transform(lambda s: s.quantile(thresholds.entropy_norm_quantile))
    out["entropy_candidate"] = ((out.value_norm.to_numpy() >= norm_cut.to_numpy())
                                & (out.null_space_fraction.to_numpy() >= thresholds.entropy_null_fraction))
    return out
