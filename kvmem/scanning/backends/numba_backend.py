"""The numba backend: compiled CPU kernels for the statistics, the candidate search and insertion
of the top/bottom and per-document sides, and the bin samples.

One batch's per-neuron statistics (histogram, #{m > 0}, Σm, Σm², block extremes) read every
coefficient of an [N, F] batch. In eager torch they take a dozen passes over it, several of them
serial (the histogram is a scatter); the kernels read each coefficient once, in neuron strips
spread over the cores. numba compiles them once per install and caches them on disk; a scan
loads them in its 'kernels' phase (:meth:`NumbaBackend.prepare`). The rest of the step (the
random sample, closing a document, the taxonomy's Σ m·position) is the torch backend's, inherited;
the taxonomy's gate/up quadrant counts have a kernel of their own (integers: the same counts).

Against the torch backend: the same histogram, counts, extremes, kept entries and samples to the
bit; the sums differ only in rounding (float64 along the rows here, float32 blocks of 32 rows then
float64 there), so atlases of the two backends are not merged (the manifest records which ran).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from kvmem.scanning.backends.base import BatchStatistics, ContextFn, Documents
from kvmem.scanning.backends.torch_backend import TorchBackend
from kvmem.scanning.rules import BLOCK_ROWS, key_salt, keys_or_none, order_by_key
from kvmem.scanning.state import BinSample, Side, new_layer_state

__all__ = ["NumbaBackend"]

_NO_EXTRAS = torch.empty((0, 1, 1), dtype=torch.float32)  # extras [E = 0, N, F] (the kernel reads none)


class NumbaBackend(TorchBackend):
    """The compiled kernels on float32 CPU tensors (:mod:`kvmem.scanning.backends.numba_kernels`)."""

    name = "numba"

    def __init__(self):
        from kvmem.scanning.backends import numba_kernels  # an ImportError where numba is not installed
        from kvmem.scanning.numba_threads import set_numba_threads

        self._kernels, self._set_threads = numba_kernels, set_numba_threads

    def _threads(self) -> None:
        """numba's threads set to torch's (at most one per core; torch's count unchanged)."""
        self._set_threads(torch.get_num_threads())

    def prepare(self) -> None:
        """Compile (or load from numba's disk cache) every kernel, on a tiny state that takes every path."""
        state = new_layer_state(4, 2, per_document=True, context_width=1, random_samples=2, bin_samples=2,
                                sample_rate=1.0)
        acts, codes = torch.ones(4, 4), torch.tensor([0, 1, 1 << 32, (1 << 32) + 1])
        no_context = lambda rows, neurons: torch.zeros(rows.numel(), 1)  # noqa: E731
        statistics = self.statistics(acts, state.histogram, state.positive)
        self.stream_side(state.top, acts, codes, no_context, True, statistics.high)
        self.fold_documents([(state.doc_top, None)], acts, codes, Documents.of([2, 2], "cpu"), no_context, True)
        rows = torch.arange(4)
        self.bin_sample(state.bins, acts, rows, keys_or_none(codes, 0), codes)
        self.quadrant_counts(torch.zeros(4, 4, dtype=torch.int64), acts, -acts)
        for extras in (None, torch.stack([acts, -acts])):
            self.window_context(acts, rows[:2], rows[1:3], torch.arange(-1, 2), torch.zeros(4, dtype=torch.int64),
                                torch.full((4,), 4), extras)

    def window_context(self, acts: Tensor, rows: Tensor, neurons: Tensor, steps: Tensor, first: Tensor,
                       end: Tensor, extras: Tensor | None = None) -> Tensor:
        """One pass over the entries, spread over the cores, the extras read in the same pass (the torch
        path builds five [c, C] index arrays, then gathers and joins the extras)."""
        self._threads()
        extras = _NO_EXTRAS if extras is None else extras.contiguous()
        out = torch.empty((rows.shape[0], steps.shape[0] + extras.shape[0]), dtype=torch.float32)
        if rows.shape[0]:
            self._kernels.window_context(acts.contiguous().numpy(), rows.contiguous().numpy(),
                                         neurons.contiguous().numpy(), steps.contiguous().numpy(),
                                         first.contiguous().numpy(), end.contiguous().numpy(), extras.numpy(),
                                         out.numpy())
        return out

    @torch.inference_mode()
    def statistics(self, acts: Tensor, histogram: Tensor, positive: Tensor) -> BatchStatistics:
        """The kernel sums in float64 along the rows."""
        self._threads()
        n, d_ff = acts.shape
        acts = acts.contiguous()
        blocks = -(-n // BLOCK_ROWS)
        low = torch.empty(blocks, d_ff, dtype=torch.float32)
        high = torch.empty(blocks, d_ff, dtype=torch.float32)
        total = torch.empty(d_ff, dtype=torch.float64)
        total_sq = torch.empty(d_ff, dtype=torch.float64)
        self._kernels.statistics(acts.numpy(), BLOCK_ROWS, histogram.numpy(), positive.numpy(), total.numpy(),
                                 total_sq.numpy(), low.numpy(), high.numpy())
        return BatchStatistics(low, high, total, total_sq)

    def stream_side(self, side: Side, acts: Tensor, codes: Tensor, context_fn: ContextFn, ordered: bool,
                    extremes: Tensor) -> None:
        """The neurons go in strips of one cache line. Each neuron has a bar (its k-th kept value, raised
        to the k-th most extreme block extreme, which k rows of the batch reach); a strip reads its rows
        in order when its neurons share the blocks that reach their bars (a dense batch), else each neuron
        reads its own reaching blocks (a full side's later batches). A coefficient that reaches its bar is
        inserted under the tie rule, in row order, so a position pushed out later in the same batch never
        has its context read: only the entries still kept at the end are looked up."""
        self._threads()
        entered = _writable(side)
        self._kernels.side_insert(acts.contiguous().numpy(), codes.contiguous().numpy(), extremes.contiguous().numpy(),
                                  BLOCK_ROWS, side.values.numpy(), side.codes.numpy(), side.slots.numpy(),
                                  entered.numpy(), side.largest, ordered)
        _add_context(side, entered, context_fn)

    def fold_documents(self, pairs: Sequence[tuple[Side, Side | None]], acts: Tensor, codes: Tensor,
                       documents: Documents, context_fn: ContextFn, ordered: bool) -> list[Side]:
        """Context is read only for the entries still kept at the end, and for the last document."""
        self._threads()
        return [self._fold_documents(side, open_side, acts, codes, documents.starts, documents.lengths, context_fn,
                                     ordered) for side, open_side in pairs]

    def _fold_documents(self, side: Side, open_side: Side | None, acts: Tensor, codes: Tensor, starts: Tensor,
                        lengths: Tensor, context_fn: ContextFn, ordered: bool) -> Side:
        entered = _writable(side)
        d_ff = acts.shape[1]
        continues = open_side is not None
        open_value = open_side.values[0].contiguous() if continues else torch.zeros(d_ff)
        open_code = open_side.codes[0].contiguous() if continues else torch.zeros(d_ff, dtype=torch.int64)
        last_value, last_code = torch.empty(d_ff), torch.empty(d_ff, dtype=torch.int64)
        last_row = torch.empty(d_ff, dtype=torch.int64)
        self._kernels.document_insert(
            acts.contiguous().numpy(), codes.contiguous().numpy(), starts.contiguous().numpy(),
            lengths.contiguous().numpy(), open_value.numpy(), open_code.numpy(), continues, side.values.numpy(),
            side.codes.numpy(), side.slots.numpy(), entered.numpy(), last_value.numpy(), last_code.numpy(),
            last_row.numpy(), side.largest, ordered)

        def context_of(rows: Tensor, neurons: Tensor) -> Tensor:  # row -2: the open document's earlier best
            context = context_fn(rows.clamp(min=0), neurons)
            earlier = rows == -2
            if continues and bool(earlier.any()):
                context[earlier] = open_side.context[0].index_select(0, neurons[earlier])
            return context

        _add_context(side, entered, context_of)
        neurons = torch.arange(d_ff)
        return Side(last_value[None], last_code[None], context_of(last_row, neurons)[None], side.largest)

    def quadrant_counts(self, counts: Tensor, gate: Tensor, up: Tensor) -> None:
        """One read of gate and up per neuron strip; integer counts, so the same as the torch backend's.
        (``position_product`` is the torch backend's own code, inherited: the same bits on a CPU.)"""
        self._threads()
        if not counts.is_contiguous():
            raise ValueError("quadrant counts must be contiguous")
        self._kernels.quadrant_counts(gate.float().contiguous().numpy(), up.float().contiguous().numpy(), counts.numpy())

    def bin_sample(self, sample: BinSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor) -> None:
        """Each neuron inserts every position whose key is under its bin's q-th kept one, in (key, code)
        order: an entry then goes in after the last it is compared with, and the kept ones are the same in
        any order (a dense first batch: a quarter less time)."""
        self._threads()
        order = order_by_key(row_keys, row_codes, 0)
        rows, row_keys, row_codes = rows[order], row_keys[order], row_codes[order]
        if sample.last_keys is None or not sample.last_keys.is_contiguous():
            sample.last_keys = keys_or_none(sample.codes[:, :, -1], sample.seed).T.contiguous()  # [B, F]
        if not (sample.codes.is_contiguous() and sample.values.is_contiguous()):
            sample.codes, sample.values = sample.codes.contiguous(), sample.values.contiguous()
        self._kernels.bin_insert(acts.contiguous().numpy(), rows.numpy(), row_keys.numpy(), row_codes.numpy(),
                                 sample.codes.numpy(), sample.values.numpy(), sample.last_keys.numpy(),
                                 np.uint64(key_salt(sample.seed)))
        sample.last_high = None  # the torch path's first cut, stale now


def _writable(side: Side) -> Tensor:
    """Make the side's values, codes and slots contiguous (the kernels write them in place) -> a
    fresh ``entered`` [k, F] int64 for the kernel to mark the new entries' rows in."""
    for name in ("values", "codes", "slots"):
        if not getattr(side, name).is_contiguous():
            setattr(side, name, getattr(side, name).contiguous())
    return torch.empty(side.values.shape, dtype=torch.int64)


def _add_context(side: Side, entered: Tensor, context_of: ContextFn) -> None:
    """Read the context of the entries a kernel let in (``entered`` [k, F]: their row, -1 for kept
    entries) and point their slots at it."""
    rank, neuron = (entered != -1).nonzero(as_tuple=True)
    if rank.numel():
        side.slots[rank, neuron] = side.add_context(context_of(entered[rank, neuron], neuron))
