"""The extremes: each neuron's top-k and bottom-k coefficients with their context (the ``top`` and
``bottom`` triggers), and the neurons table's ``min`` and ``max``. The triggers table is written here,
from every kept side of the layer (the per-document bests add theirs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from kvmem.scanning.statistics.batch import LayerBatch
from kvmem.scanning.statistics.sides import (
    Side,
    block_extremes,
    merge_sides,
    side_from_tensors,
    side_tensors,
    stream_side,
    trigger_part,
)
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic

__all__ = ["Extremes", "ExtremesState"]


@dataclass
class ExtremesState:
    """``top``, ``bottom``: the sides [k, F]; ``seen``: coefficients folded in per neuron (k finite ones fill
    a side, which lets the search skip the dense first cut)."""

    top: Side
    bottom: Side
    seen: int = 0


class Extremes(Statistic):
    name = "extremes"
    layer_tables = ("triggers",)

    @classmethod
    def wanted(cls, config, *, gated: bool) -> bool:
        return True

    def new(self, spec: LayerSpec) -> ExtremesState:
        k = self.config.top_k
        return ExtremesState(Side.empty(k, spec.d_ff, spec.width, largest=True, device=spec.device),
                             Side.empty(k, spec.d_ff, spec.width, largest=False, device=spec.device))

    @torch.inference_mode()  # no autograd; pools written in and out of the forward alike
    def update(self, state: ExtremesState, batch: LayerBatch) -> None:
        low, high = block_extremes(batch.acts)  # [blocks, F] each
        for side, extremes in ((state.top, high), (state.bottom, low)):
            side.full = side.full or state.seen >= side.values.shape[0]  # k finite values seen: all k held
            batch.reads.defer(stream_side(side, batch.acts, batch.codes, batch.context, batch.ordered, extremes))
        state.seen += batch.acts.shape[0]

    @torch.inference_mode()
    def merge(self, a: ExtremesState, b: ExtremesState) -> ExtremesState:
        return ExtremesState(merge_sides(a.top, b.top), merge_sides(a.bottom, b.bottom), a.seen + b.seen)

    def to_tensors(self, state: ExtremesState, prefix: str) -> tuple[dict[str, Tensor], dict]:
        return {**side_tensors(state.top, f"{prefix}.top"), **side_tensors(state.bottom, f"{prefix}.bottom")}, \
            {"seen": state.seen}

    def from_tensors(self, prefix: str, tensors: dict[str, Tensor], meta: dict) -> ExtremesState:
        return ExtremesState(side_from_tensors(f"{prefix}.top", tensors, largest=True),
                             side_from_tensors(f"{prefix}.bottom", tensors, largest=False), int(meta["seen"]))

    def sides(self, state: ExtremesState) -> dict[str, Side]:
        return {"top": state.top, "bottom": state.bottom}

    def neuron_columns(self, state: ExtremesState, d_ff: int) -> dict[str, np.ndarray]:
        return {"min": state.bottom.values[0].cpu().numpy().astype(np.float32),
                "max": state.top.values[0].cpu().numpy().astype(np.float32)}

    def layer_part(self, table: str, layer: int, state: ExtremesState, layer_state) -> pa.Table:
        """The triggers: every side the layer's statistics keep, top and bottom first."""
        return trigger_part(layer, layer_state.sides(), layer_state.extras)
