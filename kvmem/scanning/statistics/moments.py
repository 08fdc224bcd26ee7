"""The moments: per neuron the count of positions, Σm and Σm² (exact to the merge: double-double), and
the neurons table's count, mean, std, act_sum and act_sq_sum. Its batch sum also gives the scan's
non-finite check: Σm is finite exactly when every coefficient is (finite float32 values cannot
overflow a float64 sum; the float32 blocks of 32 rows overflow only past |m| ~ 1e37)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvmem.scanning.statistics.batch import LayerBatch
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic
from kvmem.scanning.statistics.sums import add_double_double, add_into, column_sum, scratch, zeros_double_double

__all__ = ["Moments", "MomentsState"]


@dataclass
class MomentsState:
    """``count`` positions seen (the same for every neuron); ``total``, ``total_sq`` [2, F] float64
    double-double sums of m and m² (row 0 high part, row 1 low part)."""

    count: int
    total: Tensor
    total_sq: Tensor

    def sums(self) -> tuple[Tensor, Tensor]:
        """(Σm, Σm²) [F] float64."""
        return self.total[0] + self.total[1], self.total_sq[0] + self.total_sq[1]


class Moments(Statistic):
    name = "moments"

    @classmethod
    def wanted(cls, config, *, gated: bool) -> bool:
        return True

    def new(self, spec: LayerSpec) -> MomentsState:
        return MomentsState(0, zeros_double_double(spec.d_ff, spec.device), zeros_double_double(spec.d_ff, spec.device))

    @torch.inference_mode()  # the scratch buffer is an inference tensor
    def update(self, state: MomentsState, batch: LayerBatch) -> None:
        acts = batch.acts
        total = column_sum(acts)
        total_sq = column_sum(torch.mul(acts, acts, out=scratch(acts.shape, torch.float32, acts.device)))
        state.count += acts.shape[0]
        add_into(state.total, total)
        add_into(state.total_sq, total_sq)
        batch.finite = torch.isfinite(total).all()

    def merge(self, a: MomentsState, b: MomentsState) -> MomentsState:
        return MomentsState(a.count + b.count, add_double_double(a.total, b.total),
                            add_double_double(a.total_sq, b.total_sq))

    def to_tensors(self, state: MomentsState, prefix: str) -> tuple[dict[str, Tensor], dict]:
        return {f"{prefix}.total": state.total.contiguous(), f"{prefix}.total_sq": state.total_sq.contiguous()}, \
            {"count": state.count}

    def from_tensors(self, prefix: str, tensors: dict[str, Tensor], meta: dict) -> MomentsState:
        return MomentsState(int(meta["count"]), tensors[f"{prefix}.total"], tensors[f"{prefix}.total_sq"])

    def neuron_columns(self, state: MomentsState, d_ff: int) -> dict[str, np.ndarray]:
        n = state.count
        total, total_sq = (t.cpu().numpy() for t in state.sums())
        with np.errstate(invalid="ignore", divide="ignore"):  # an empty shard: NaN statistics, count 0
            mean = total / n
            variance = np.maximum(total_sq / n - mean * mean, 0.0)
        return {"count": np.full(d_ff, n, np.int64), "mean": mean, "std": np.sqrt(variance),
                "act_sum": total, "act_sq_sum": total_sq}
