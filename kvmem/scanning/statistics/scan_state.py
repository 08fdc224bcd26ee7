"""The statistics of one scan, composed: every layer's states (:class:`LayerState`), the scan's state
(:class:`ScanState`: what a checkpoint stores) and the one exact merge of kvmem (ranks under torchrun and
``kvmem merge`` of shard atlases both use :meth:`ScanState.merge`).

Memory is O(layers · d_ff · what each statistic keeps); no tensor of shape (all tokens × d_ff) is ever held.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from kvmem.plan import StreamPosition, distinct_codes, pack, unpack
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic
from kvmem.scanning.texts import TextStore

__all__ = ["Composition", "LayerState", "ScanState", "GATE_UP_EXTRAS"]

GATE_UP_EXTRAS = 2  # context-row values after the context coefficients: the entry's gate, then up pre-activation


class Composition:
    """The statistics a scan keeps, in registry order, and what they need of every batch."""

    def __init__(self, statistics: list[Statistic]):
        self.statistics = statistics
        self.layer = [s for s in statistics if s.scope == "layer"]
        self.scan = [s for s in statistics if s.scope == "scan"]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.statistics]

    def __repr__(self) -> str:
        return f"Composition({', '.join(self.names)})"

    def __getitem__(self, name: str) -> Statistic:
        for statistic in self.statistics:
            if statistic.name == name:
                return statistic
        raise KeyError(name)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    @property
    def needs_documents(self) -> bool:
        return any(s.needs_documents for s in self.layer)

    @property
    def needs_keys(self) -> bool:
        return any(s.needs_keys for s in self.layer)

    @property
    def needs_positions(self) -> bool:
        return any(s.needs_positions for s in self.layer)

    @property
    def needs_gate_up(self) -> bool:
        return any(s.needs_gate_up for s in self.layer)

    @property
    def extras(self) -> int:
        """Values after the context coefficients in every kept entry's context row."""
        return GATE_UP_EXTRAS if self.needs_gate_up else 0

    @property
    def random_size(self) -> int:
        return max([getattr(s, "random_size", 0) for s in self.layer], default=0)

    @property
    def bin_limit(self) -> int | None:
        limits = [s.bin_limit for s in self.layer if getattr(s, "bin_limit", None) is not None]
        return limits[0] if limits else None

    def spec(self, d_ff: int, vocab_size: int, device, context_width: int) -> LayerSpec:
        return LayerSpec(d_ff, vocab_size, device, context_width, self.extras)

    def new_state(self, layers: list[int], spec: LayerSpec) -> ScanState:
        """An empty scan state of ``layers``."""
        return ScanState(self, layers, {layer: LayerState(self, {s.name: s.new(spec) for s in self.layer})
                                        for layer in layers},
                         {s.name: s.new(spec) for s in self.scan})

    def layer_tables(self) -> Iterator[tuple[str, Statistic]]:
        """(table, statistic writing it) of the tables written a layer at a time."""
        for statistic in self.layer:
            for table in statistic.layer_tables:
                yield table, statistic

    def table_columns(self) -> dict[str, dict[str, str]]:
        """Columns of the tables the statistics define themselves (the rest are :data:`kvmem.schema.COLUMNS`)."""
        return {name: columns for s in self.statistics for name, columns in s.table_columns.items()}


class LayerState:
    """One layer's states, one per statistic (by name)."""

    def __init__(self, composition: Composition, parts: dict[str, Any]):
        self.composition, self.parts = composition, parts

    def __getitem__(self, name: str) -> Any:
        return self.parts[name]

    def __contains__(self, name: str) -> bool:
        return name in self.parts

    @property
    def extras(self) -> int:
        return self.composition.extras

    def sides(self) -> dict:
        """Kind (as in the triggers table) -> kept side, of every statistic that keeps sides."""
        out = {}
        for statistic in self.composition.layer:
            out.update(statistic.sides(self.parts[statistic.name]))
        return out

    def codes(self, *, open_documents: bool = False) -> list[Tensor]:
        return [codes for s in self.composition.layer
                for codes in s.codes(self.parts[s.name], open_documents=open_documents)]

    def close(self) -> None:
        for statistic in self.composition.layer:
            statistic.close(self.parts[statistic.name])

    @torch.inference_mode()
    def merge(self, other: LayerState) -> LayerState:
        """The state one stream over both inputs gives (they saw disjoint documents, in any order)."""
        return LayerState(self.composition, {s.name: s.merge(self.parts[s.name], other.parts[s.name])
                                             for s in self.composition.layer})

    def neuron_columns(self, d_ff: int) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for statistic in self.composition.layer:
            out.update(statistic.neuron_columns(self.parts[statistic.name], d_ff))
        return out

    def part(self, table: str, layer: int, statistic: Statistic) -> pa.Table | None:
        return statistic.layer_part(table, layer, self.parts[statistic.name], self)


@dataclass
class ScanState:
    """Everything a process holds during a scan; what a checkpoint stores (as tensors and JSON)."""

    statistics: Composition
    layers: list[int]
    layer_states: dict[int, LayerState]
    scan_states: dict[str, Any] = field(default_factory=dict)  # scan-wide statistics, by name
    texts: TextStore = field(default_factory=TextStore)
    position: StreamPosition = field(default_factory=StreamPosition)
    tokens: int = 0  # scored by this process
    windows: int = 0
    batches: int = 0  # forwards run by this process (resumed runs included)
    seconds: float = 0.0  # streaming seconds so far

    def merge(self, other: ScanState) -> ScanState:
        """The state of one process that had read both (disjoint shares of one stream)."""
        if self.statistics.names != other.statistics.names:
            raise ValueError(f"a merge needs states that keep the same statistics, not {self.statistics.names} "
                             f"and {other.statistics.names}")
        return ScanState(self.statistics, self.layers,
                         {layer: self.layer_states[layer].merge(other.layer_states[layer]) for layer in self.layers},
                         {s.name: s.merge(self.scan_states[s.name], other.scan_states[s.name])
                          for s in self.statistics.scan},
                         TextStore({**self.texts.windows, **other.texts.windows}), self.position,
                         self.tokens + other.tokens, self.windows + other.windows, self.batches + other.batches,
                         max(self.seconds, other.seconds))

    def close(self) -> None:
        """The end of a stream: every statistic folds in what is still open (before writing or merging)."""
        for layer_state in self.layer_states.values():
            layer_state.close()

    def kept_positions(self, *, open_documents: bool = False) -> np.ndarray:
        """Sorted distinct codes of every kept trigger and sample (and, with ``open_documents``, of the
        per-document bests still open): the positions whose text the atlas needs."""
        return distinct_codes([codes.cpu().numpy() for s in self.layer_states.values()
                               for codes in s.codes(open_documents=open_documents)])

    def referenced_windows(self, window: int) -> set[int]:
        docs, pos = unpack(self.kept_positions(open_documents=True))
        return set(pack(docs, pos - pos % window).tolist())
