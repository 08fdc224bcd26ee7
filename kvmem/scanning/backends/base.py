"""The interface every streaming backend implements: one batch of one layer into its state.

A backend is chosen once per scan (:func:`kvmem.scanning.backends.select_backend`) and called by
:mod:`kvmem.scanning.step`, which holds the per-batch logic common to all backends. Each method
reads a batch acts [N, F] float32 (the scored positions in reading order), codes [N] int64, and
writes into parts of a :class:`kvmem.scanning.state.LayerState`. ``ordered``: the codes increase
along the batch and exceed every code folded in before (ties can then never enter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from torch import Tensor

from kvmem.scanning.state import BinSample, RandomSample, Side

__all__ = ["Backend", "BatchStatistics", "ContextFn"]

# (flat row indices [C], neuron indices [C]) -> coefficients of that neuron around each row [C, width]
ContextFn = Callable[[Tensor, Tensor], Tensor]


class BatchStatistics(NamedTuple):
    """Block minima and maxima [ceil(N / BLOCK_ROWS), F] float32; Σm, Σm² [F] float64."""

    low: Tensor
    high: Tensor
    total: Tensor
    total_sq: Tensor


class Backend:
    """One implementation of the streaming step. ``name`` goes into the manifest."""

    name: str = ""

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
                       starts: Tensor, lengths: Tensor, context_fn: ContextFn, ordered: bool) -> list[Side]:
        """For each (side, open_side) of ``pairs``: fold the batch's complete documents' bests into
        side and return the last document's best (k = 1). Documents are rows starts[s] ..
        starts[s] + lengths[s] - 1; ``open_side``: the best so far of the first document when it
        continues from the previous batch (None otherwise). A document's best is its most extreme
        value at the first position holding it."""
        raise NotImplementedError

    def fold_entries(self, side: Side, values: Tensor, codes: Tensor, context_of: ContextFn, ordered: bool) -> None:
        """Insert a few entries per neuron (values, codes [m, F]); ``context_of(entries, neurons)``
        gives the context of the entries that enter."""
        raise NotImplementedError

    def random_sample(self, sample: RandomSample, acts: Tensor, codes: Tensor, keys: Tensor,
                      context_fn: ContextFn) -> None:
        """Fold the batch (keys [N], any code order) into the uniform random sample."""
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
