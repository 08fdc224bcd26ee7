"""What a statistic is: the one interface every module of :mod:`kvmem.scanning.statistics` implements.

A statistic is something the scan accumulates. Its module defines, in one torch implementation that
runs on any device:

- its **state** per layer (or per scan: ``scope = "scan"``): :meth:`Statistic.new`;
- its **update** from one batch: :meth:`Statistic.update` (device reads deferred to ``batch.reads``);
- its **exact merge** of two states that saw disjoint documents: :meth:`Statistic.merge`;
- its **serialisation**, tensors + plain JSON (a checkpoint, a shard's state, a rank's state):
  :meth:`Statistic.to_tensors` / :meth:`Statistic.from_tensors`;
- what it **writes**: columns of the neurons table (:meth:`Statistic.neuron_columns`), tables written a
  layer at a time (:attr:`Statistic.layer_tables`, :meth:`Statistic.layer_part`), whole tables
  (:meth:`Statistic.scan_tables`), kept triggers (:meth:`Statistic.sides`) and the positions whose text
  the atlas needs (:meth:`Statistic.codes`).

The scan composes the statistics its :class:`~kvmem.scanning.config.ScanConfig` asks for
(:func:`kvmem.scanning.statistics.compose`). A statistic reads the config it was built with; it
never reads another statistic's state, except where the layer's tables gather every statistic's
kept sides (:class:`~kvmem.scanning.statistics.scan_state.LayerState`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
from torch import Tensor

from kvmem.scanning.statistics.batch import LayerBatch

__all__ = ["Statistic", "LayerSpec"]


@dataclass(frozen=True)
class LayerSpec:
    """What a statistic needs to build an empty state.

    ``d_ff``: neurons per layer; ``vocab_size``: the model's vocabulary (scan-wide statistics);
    ``device``: where the state lives; ``context_width``: context coefficients kept per entry (0 without
    them); ``extras``: values after them in every kept entry's context row (2 when the scan keeps each
    entry's gate and up pre-activations, else 0)."""

    d_ff: int
    vocab_size: int
    device: Any
    context_width: int
    extras: int

    @property
    def width(self) -> int:
        """A kept entry's context row: the context coefficients, then the extras."""
        return self.context_width + self.extras


class Statistic:
    """The interface (see the module docstring). Subclasses set ``name`` (the registry's key, the
    checkpoint's section) and implement what they keep; the defaults keep and write nothing."""

    name: ClassVar[str] = ""
    scope: ClassVar[str] = "layer"  # "layer": one state per scanned layer; "scan": one state per scan
    layer_tables: ClassVar[tuple[str, ...]] = ()  # tables written a layer at a time by layer_part
    table_columns: ClassVar[dict[str, dict[str, str]]] = {}  # columns of tables kvmem.schema does not define
    needs_documents: ClassVar[bool] = False  # the batch layout's documents
    needs_keys: ClassVar[bool] = False  # the positions' sampling keys
    needs_positions: ClassVar[bool] = False  # each position's place in its window
    needs_gate_up: ClassVar[bool] = False  # the gate and up pre-activations (gated FFNs)

    def __init__(self, config, *, gated: bool = False):
        self.config = config
        self.gated = gated

    @classmethod
    def wanted(cls, config, *, gated: bool) -> bool:
        """Whether a scan under ``config`` keeps this statistic."""
        raise NotImplementedError

    def new(self, spec: LayerSpec) -> Any:
        raise NotImplementedError

    def update(self, state: Any, batch: LayerBatch) -> None:
        raise NotImplementedError

    def close(self, state: Any) -> None:
        """The end of a stream (and before a merge): fold in what is still open."""

    def merge(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def to_tensors(self, state: Any, prefix: str) -> tuple[dict[str, Tensor], dict]:
        raise NotImplementedError

    def from_tensors(self, prefix: str, tensors: dict[str, Tensor], meta: dict) -> Any:
        raise NotImplementedError

    # ---- what it writes ----
    def sides(self, state: Any) -> dict:
        """Kind (as in the triggers table) -> :class:`~kvmem.scanning.statistics.sides.Side` kept."""
        return {}

    def codes(self, state: Any, *, open_documents: bool = False) -> list[Tensor]:
        """Codes of the positions whose text the atlas needs (kept triggers and samples)."""
        return [side.codes for side in self.sides(state).values()]

    def neuron_columns(self, state: Any, d_ff: int) -> dict[str, np.ndarray]:
        """Columns of the neurons table for one layer's neurons."""
        return {}

    def layer_part(self, table: str, layer: int, state: Any, layer_state) -> pa.Table | None:
        """The rows of ``table`` (one of :attr:`layer_tables`) of one layer; ``layer_state``: every
        statistic's state of that layer (:class:`~kvmem.scanning.statistics.scan_state.LayerState`)."""
        raise NotImplementedError

    def scan_tables(self, state: Any) -> dict[str, pa.Table]:
        """Whole tables of a scan-wide statistic."""
        return {}

    @classmethod
    def absent_tables(cls) -> dict[str, pa.Table]:
        """Tables an atlas holds (empty) when the scan did not keep this statistic."""
        return {}
