"""The neuron taxonomy's streaming sums (``docs/taxonomy.md``): Σ m·p per neuron, p the position in the
window (0 = the window's first token, scored or not), as double-double; Σp and Σp² as exact integers
(the same for every neuron); and on gated FFNs the gate/up sign-quadrant counts, with each kept entry's
gate and up pre-activations travelling in its context row (the triggers table's gate_pre and up_pre).
Columns of the neurons table: position_act_sum, position_sum, position_sq_sum, quadrant_*."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvmem.scanning.statistics.batch import LayerBatch
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic
from kvmem.scanning.statistics.sums import add_double_double, add_into, column_sum, scratch, zeros_double_double

__all__ = ["TaxonomySums", "TaxonomyState", "QUADRANTS"]

QUADRANTS = ("pp", "pn", "np", "nn")  # rows of the quadrant counts: (sign of gate, sign of up), p: > 0, n: <= 0


@dataclass
class TaxonomyState:
    """``position_product`` [2, F] float64 double-double Σ m·p; ``position_total``, ``position_sq_total`` Σp,
    Σp²; ``quadrants`` [4, F] int64 (gated FFNs; None otherwise): positions with (gate > 0, up > 0),
    (gate > 0, up <= 0), (gate <= 0, up > 0), (gate <= 0, up <= 0), gate and up the pre-activations
    W_gate x and W_up x (NaN counts as <= 0)."""

    position_product: Tensor
    position_total: int = 0
    position_sq_total: int = 0
    quadrants: Tensor | None = None


class TaxonomySums(Statistic):
    name = "taxonomy"
    needs_positions = True

    def __init__(self, config, *, gated: bool = False):
        super().__init__(config, gated=gated)
        self.needs_gate_up = gated  # the quadrants, and each kept entry's gate and up

    @classmethod
    def wanted(cls, config, *, gated: bool) -> bool:
        return config.taxonomy_sums

    def new(self, spec: LayerSpec) -> TaxonomyState:
        return TaxonomyState(zeros_double_double(spec.d_ff, spec.device), quadrants=torch.zeros(
            len(QUADRANTS), spec.d_ff, dtype=torch.int64, device=spec.device) if self.gated else None)

    @torch.inference_mode()
    def update(self, state: TaxonomyState, batch: LayerBatch) -> None:
        if batch.positions is None:
            raise ValueError("the taxonomy sums need the batch's positions")
        acts, positions = batch.acts, batch.positions
        # float32 products m·p, summed as the moments sum m
        add_into(state.position_product, column_sum(torch.mul(acts, positions.index[:, None],
                                                              out=scratch(acts.shape, torch.float32, acts.device))))
        state.position_total += positions.total
        state.position_sq_total += positions.total_sq
        if state.quadrants is not None:
            if batch.gate_up is None:
                raise ValueError("the gate/up quadrant counts need the pre-activations")
            _quadrant_counts(state.quadrants, *batch.gate_up)

    def merge(self, a: TaxonomyState, b: TaxonomyState) -> TaxonomyState:
        if (a.quadrants is None) != (b.quadrants is None):
            raise ValueError("a merge needs states that keep the same taxonomy sums")
        return TaxonomyState(add_double_double(a.position_product, b.position_product),
                             a.position_total + b.position_total, a.position_sq_total + b.position_sq_total,
                             None if a.quadrants is None else a.quadrants + b.quadrants)

    def to_tensors(self, state: TaxonomyState, prefix: str) -> tuple[dict[str, Tensor], dict]:
        tensors = {f"{prefix}.position_product": state.position_product.contiguous()}
        if state.quadrants is not None:
            tensors[f"{prefix}.quadrants"] = state.quadrants.contiguous()
        return tensors, {"position_total": state.position_total, "position_sq_total": state.position_sq_total}

    def from_tensors(self, prefix: str, tensors: dict[str, Tensor], meta: dict) -> TaxonomyState:
        return TaxonomyState(tensors[f"{prefix}.position_product"], int(meta["position_total"]),
                             int(meta["position_sq_total"]), tensors.get(f"{prefix}.quadrants"))

    def neuron_columns(self, state: TaxonomyState, d_ff: int) -> dict[str, np.ndarray]:
        out = {"position_act_sum": (state.position_product[0] + state.position_product[1]).cpu().numpy(),
               "position_sum": np.full(d_ff, state.position_total, np.int64),
               "position_sq_sum": np.full(d_ff, state.position_sq_total, np.int64)}
        if state.quadrants is not None:  # else null columns
            quadrants = state.quadrants.cpu().numpy()
            out.update({f"quadrant_{name}": quadrants[row].astype(np.int64) for row, name in enumerate(QUADRANTS)})
        return out


_EXACT_ROWS = 1 << 24  # a float32 column sum of 0/1 values is an exact integer below this many rows


def _quadrant_counts(counts: Tensor, gate: Tensor, up: Tensor) -> None:
    """counts [4, F] += the batch's sign-quadrant counts of gate, up [N, F].

    The signs are written as float32 0/1 into reused buffers and counted by float32 column sums (a
    boolean column sum costs several times as much on a CPU); every partial sum is an integer below
    2^24, so the counts are exact."""
    for start in range(0, gate.shape[0], _EXACT_ROWS):
        g, u = gate[start:start + _EXACT_ROWS], up[start:start + _EXACT_ROWS]
        n = g.shape[0]
        gate_on = torch.gt(g, 0, out=scratch(g.shape, torch.float32, g.device))  # [N, F] 0/1
        up_on = torch.gt(u, 0, out=scratch(u.shape, torch.float32, u.device, slot=1))
        gate_total, up_total = gate_on.sum(dim=0).long(), up_on.sum(dim=0).long()
        both = gate_on.mul_(up_on).sum(dim=0).long()
        counts[0] += both
        counts[1] += gate_total - both
        counts[2] += up_total - both
        counts[3] += n - gate_total - up_total + both
