"""The interface every streaming backend implements: one batch of one layer into its state.

A backend is chosen once per scan (:func:`kvmem.scanning.backends.select_backend`) and called by
:mod:`kvmem.scanning.step`, which holds the per-batch logic common to all backends. Each method
reads a batch acts [N, F] float32 (the scored positions in reading order), codes [N] int64, and
writes into parts of a :class:`kvmem.scanning.state.LayerState`. ``ordered``: the codes increase
along the batch and exceed every code folded in before (ties can then never enter).

A method whose work needs a size from the device (a candidate count) may hand that work to
:attr:`Backend.reads` as a pending step (:mod:`kvmem.scanning.reads`): the caller runs a layer's
calls inside ``backend.reads.collecting()``, so the reads of all its steps share one synchronisation
per round; a call made outside that block completes before it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvmem.scanning.reads import Reads
from kvmem.scanning.state import BinSample, RandomSample, Side

__all__ = ["Backend", "BatchStatistics", "ContextFn", "Documents"]

# (flat row indices [C], neuron indices [C]) -> coefficients of that neuron around each row [C, width]
ContextFn = Callable[[Tensor, Tensor], Tensor]


class BatchStatistics(NamedTuple):
    """Block minima and maxima [ceil(N / BLOCK_ROWS), F] float32; Σm, Σm² [F] float64."""

    low: Tensor
    high: Tensor
    total: Tensor
    total_sq: Tensor


class Documents(NamedTuple):
    """A batch's documents, laid out once per batch for every layer: document s is rows starts[s] ..
    starts[s] + lengths[s] - 1 of acts [N, F] (in order; on the device). ``longest_complete``: the
    most rows of a document but the last; ``last_length``: the last one's rows (host integers)."""

    starts: Tensor
    lengths: Tensor
    longest_complete: int
    last_length: int

    @property
    def count(self) -> int:
        return self.starts.shape[0]

    @classmethod
    def of(cls, lengths, device) -> Documents:
        """From the documents' lengths in rows (host integers, in order), one copy to ``device``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        parts = to_device(np.concatenate([np.cumsum(lengths) - lengths, lengths]), device)
        s = len(lengths)
        return cls(parts[:s], parts[s:], int(lengths[:-1].max()) if s > 1 else 0, int(lengths[-1]))


def to_device(array: np.ndarray, device) -> Tensor:
    """A host array on ``device`` without waiting: on CUDA through pinned memory, a copy queued on
    the current stream (a copy from pageable memory makes the host wait for the device)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class Backend:
    """One implementation of the streaming step. ``name`` goes into the manifest."""

    name: str = ""

    @cached_property
    def reads(self) -> Reads:
        """The pending steps of the layer being folded (see the module docstring)."""
        return Reads()

    def prepare(self) -> None:
        """Load what the backend needs before the stream (compiled kernels); nothing by default."""

    def window_context(self, acts: Tensor, rows: Tensor, neurons: Tensor, steps: Tensor, first: Tensor,
                       end: Tensor, extras: Tensor | None = None) -> Tensor:
        """Coefficients of neuron ``neurons[i]`` at rows ``rows[i] + steps``, NaN where that row lies outside
        the row's window (``first[row] <= row + step < end[row]``), then ``extras[e, rows[i], neurons[i]]``
        for each e -> [c, C + E] float32. acts [N, F]; rows, neurons [c]; steps [C] (may be empty);
        first, end [N] each row's window bounds in acts; extras [E, N, F] float32 or None (E = 0).
        Every backend returns the same bits (values are copied, never computed)."""
        raise NotImplementedError

    def statistics(self, acts: Tensor, histogram: Tensor, positive: Tensor) -> BatchStatistics:
        """Add the batch's per-neuron histogram into ``histogram`` [F, HIST_BINS] int64 and its
        #{m > 0} into ``positive`` [F] int64; return the block extremes and the sums. Sums may differ
        between backends in rounding only (see each backend)."""
        raise NotImplementedError

    def stream_side(self, side: Side, acts: Tensor, codes: Tensor, context_fn: ContextFn, ordered: bool,
                    extremes: Tensor) -> None:
        """Insert the positions that enter ``side`` (beat its k-th value, or, unless ``ordered``, tie
        it with a lower code), with their context; ``extremes``: the batch's block maxima (a top
        side) or minima (a bottom side)."""
        raise NotImplementedError

    def fold_documents(self, pairs: Sequence[tuple[Side, Side | None]], acts: Tensor, codes: Tensor,
                       documents: Documents, context_fn: ContextFn, ordered: bool) -> list[Side]:
        """For each (side, open_side) of ``pairs``: fold the batch's complete documents' bests into
        side and return the last document's best (k = 1). ``documents``: the batch's layout;
        ``open_side``: the best so far of the first document when it continues from the previous
        batch (None otherwise). A document's best is its most extreme value at the first position
        holding it."""
        raise NotImplementedError

    def fold_entries(self, side: Side, values: Tensor, codes: Tensor, context_of: ContextFn, ordered: bool) -> None:
        """Insert a few entries per neuron (values, codes [m, F]); ``context_of(entries, neurons)``
        gives the context of the entries that enter."""
        raise NotImplementedError

    def random_sample(self, sample: RandomSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor,
                      context_fn: ContextFn) -> None:
        """Fold the batch into the uniform random sample: ``rows`` [m] are its positions with the m
        smallest (key, code) (m = min(sample size, N); no other can enter), with their keys and codes [m]."""
        raise NotImplementedError

    def bin_sample(self, sample: BinSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor) -> None:
        """Fold the thinned positions ``rows`` [r] (their keys and codes [r]) into the bin samples."""
        raise NotImplementedError

    def position_product(self, acts: Tensor, positions: Tensor) -> Tensor:
        """Σ_r m[r] · positions[r] -> [F] float64 (positions [N] float32, exact small integers). Every
        backend must return the same bits for the same batch (the taxonomy's sums do not differ by backend)."""
        raise NotImplementedError

    def quadrant_counts(self, counts: Tensor, gate: Tensor, up: Tensor) -> None:
        """Add the batch's sign-quadrant counts of gate, up [N, F] into ``counts`` [4, F] int64 (rows:
        :data:`kvmem.scanning.state.QUADRANTS`, "p" is > 0 and "n" is <= 0; NaN counts as "n")."""
        raise NotImplementedError
