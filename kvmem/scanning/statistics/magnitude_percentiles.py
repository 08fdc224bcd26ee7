"""Percentiles of each neuron's |m|, for ablation and steering thresholds (Neuronpedia's dashboards record
per-feature activation quantiles, computed by SAEDashboard's ``FeatureStatistics`` with ``torch.quantile``
over every activation it read; that needs them all in memory at once).

Here an exactly mergeable estimator: per neuron, counts of |m| over fine fixed log-spaced bins, 8 per
octave from 2^-16 to 2^16 (the exponent and the first three mantissa bits of |m| as float32, so a bin
spans at most 12.5% of its lower edge), plus [0, 2^-16) and [2^16, inf). Counts add, so shards and ranks
merge to the counts of one stream. A percentile is reported as the bounds of the bin that holds it: the
p-th percentile is the smallest x with #{|m| <= x} >= p·n (numpy's ``inverted_cdf``), and
``low <= x < high``. Asked for by name: ``statistics=("magnitude_percentiles",)``
(``--statistics magnitude_percentiles``); writes ``magnitude_percentiles.parquet``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from kvmem.scanning.statistics.batch import LayerBatch
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic
from kvmem.scanning.statistics.sums import scratch

__all__ = ["MagnitudePercentiles", "LEVELS", "BINS", "bin_edges"]

LEVELS = (0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 0.9999)  # the percentiles written, as fractions
_SHIFT = 20  # float32 bits >> 20: the exponent field and the first 3 mantissa bits (8 bins per octave)
_LOW = (127 - 16) << 3  # the code of 2^-16: the first edge above 0
_HIGH = (127 + 16) << 3  # the code of 2^16: the last finite edge
BINS = _HIGH - _LOW + 2  # [0, 2^-16), 256 bins of codes _LOW.._HIGH - 1, [2^16, inf)


def bin_edges() -> np.ndarray:
    """The BINS + 1 edges, float32: 0, 2^-16, ..., 2^16, inf; bin b is [edges[b], edges[b + 1])."""
    finite = (np.arange(_LOW, _HIGH + 1, dtype=np.uint32) << np.uint32(_SHIFT)).view(np.float32)
    return np.concatenate([np.zeros(1, np.float32), finite, np.full(1, np.inf, np.float32)])


class MagnitudePercentiles(Statistic):
    name = "magnitude_percentiles"
    optional = True
    layer_tables = ("magnitude_percentiles",)
    table_columns = {"magnitude_percentiles": {
        "layer": "int16",
        "neuron": "int32",
        "level": "float64, the percentile as a fraction (0.99: 99% of the scored positions have |m| at or below it)",
        "low": "float32, the lower edge of the |m| bin that holds the percentile (it is >= low)",
        "high": "float32, the upper edge of that bin (it is < high; inf for the last bin)",
    }}

    @classmethod
    def wanted(cls, config, *, gated: bool) -> bool:
        return cls.name in config.statistics

    def new(self, spec: LayerSpec) -> Tensor:
        return torch.zeros(spec.d_ff, BINS, dtype=torch.int64, device=spec.device)  # [F, BINS]

    @torch.inference_mode()  # the scratch buffer is an inference tensor
    def update(self, state: Tensor, batch: LayerBatch) -> None:
        acts = batch.acts
        n, d_ff = acts.shape
        index = scratch(acts.shape, torch.int32, acts.device)
        torch.bitwise_and(acts.contiguous().view(torch.int32), 0x7FFFFFFF, out=index)  # |m|'s bits
        index.bitwise_right_shift_(_SHIFT).clamp_(_LOW - 1, _HIGH).sub_(_LOW - 1)  # the bin, 0 .. BINS - 1
        index.mul_(d_ff).add_(torch.arange(d_ff, dtype=torch.int32, device=acts.device))  # bin-major: bin * F + neuron
        table = torch.zeros(BINS * d_ff, dtype=torch.int64, device=acts.device)
        table.index_add_(0, index.view(-1), torch.ones(1, dtype=torch.int64, device=acts.device).expand(n * d_ff))
        state += table.view(BINS, d_ff).T

    def merge(self, a: Tensor, b: Tensor) -> Tensor:
        return a + b

    def to_tensors(self, state: Tensor, prefix: str) -> tuple[dict[str, Tensor], dict]:
        return {f"{prefix}.magnitude_counts": state.contiguous()}, {}

    def from_tensors(self, prefix: str, tensors: dict[str, Tensor], meta: dict) -> Tensor:
        return tensors[f"{prefix}.magnitude_counts"]

    def layer_part(self, table: str, layer: int, state: Tensor, layer_state) -> pa.Table:
        counts = state.cpu().numpy()  # [F, BINS]
        d_ff = counts.shape[0]
        bins = percentile_bins(counts, LEVELS)  # [F, levels]
        edges = bin_edges()
        return pa.table({
            "layer": np.full(d_ff * len(LEVELS), layer, np.int16),
            "neuron": np.repeat(np.arange(d_ff, dtype=np.int32), len(LEVELS)),
            "level": np.tile(np.asarray(LEVELS, np.float64), d_ff),
            "low": edges[bins.reshape(-1)], "high": edges[bins.reshape(-1) + 1],
        })


def percentile_bins(counts: np.ndarray, levels) -> np.ndarray:
    """The bin holding each level's percentile, [F, levels] (numpy's inverted_cdf rank: the
    ceil(p·n - 1)-th smallest |m|, 0-based); 0 where a neuron saw no position."""
    cumulative = np.cumsum(counts, axis=1)  # [F, BINS]
    n = cumulative[:, -1].astype(np.float64)  # [F]
    rank = np.clip(np.ceil(n[:, None] * np.asarray(levels, np.float64)[None, :] - 1), 0, np.maximum(n - 1, 0)[:, None])
    return (cumulative[:, None, :] > rank[:, :, None]).argmax(axis=2)  # the first bin whose count passes the rank
