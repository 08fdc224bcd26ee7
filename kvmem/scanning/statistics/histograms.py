"""The histogram: per neuron, counts over the fixed bins of :mod:`kvmem.scanning.bins`, and
#{m > 0} (the neurons table's ``frac_positive``); the histograms table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from kvmem.scanning.bins import HIST_BINS, histogram_fold
from kvmem.scanning.statistics.batch import LayerBatch
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic
from kvmem.scanning.statistics.sums import scratch

__all__ = ["Histograms", "HistogramState"]


@dataclass
class HistogramState:
    """``counts`` [F, HIST_BINS] int64; ``positive`` [F] int64 #{m > 0}; ``count``: positions folded in."""

    counts: Tensor
    positive: Tensor
    count: int = 0


class Histograms(Statistic):
    name = "histogram"
    layer_tables = ("histograms",)

    @classmethod
    def wanted(cls, config, *, gated: bool) -> bool:
        return True

    def new(self, spec: LayerSpec) -> HistogramState:
        return HistogramState(torch.zeros(spec.d_ff, HIST_BINS, dtype=torch.int64, device=spec.device),
                              torch.zeros(spec.d_ff, dtype=torch.int64, device=spec.device))

    @torch.inference_mode()  # the scratch buffer is an inference tensor
    def update(self, state: HistogramState, batch: LayerBatch) -> None:
        acts = batch.acts
        index = scratch(acts.shape, torch.int32, acts.device).view(-1)
        batch.reads.defer(histogram_fold(state.counts, state.positive, acts, index))
        state.count += acts.shape[0]

    def merge(self, a: HistogramState, b: HistogramState) -> HistogramState:
        return HistogramState(a.counts + b.counts, a.positive + b.positive, a.count + b.count)

    def to_tensors(self, state: HistogramState, prefix: str) -> tuple[dict[str, Tensor], dict]:
        return {f"{prefix}.histogram": state.counts.contiguous(), f"{prefix}.positive": state.positive.contiguous()}, \
            {"count": state.count}

    def from_tensors(self, prefix: str, tensors: dict[str, Tensor], meta: dict) -> HistogramState:
        return HistogramState(tensors[f"{prefix}.histogram"], tensors[f"{prefix}.positive"], int(meta["count"]))

    def neuron_columns(self, state: HistogramState, d_ff: int) -> dict[str, np.ndarray]:
        with np.errstate(invalid="ignore", divide="ignore"):  # an empty shard: NaN, count 0
            return {"frac_positive": state.positive.cpu().numpy() / state.count}

    def layer_part(self, table: str, layer: int, state: HistogramState, layer_state) -> pa.Table:
        d_ff = state.counts.shape[0]
        return pa.table({
            "layer": np.full(d_ff, layer, np.int16),
            "neuron": np.arange(d_ff, dtype=np.int32),
            "counts": pa.FixedSizeListArray.from_arrays(pa.array(state.counts.cpu().numpy().reshape(-1), pa.int64()),
                                                        HIST_BINS),
        })
