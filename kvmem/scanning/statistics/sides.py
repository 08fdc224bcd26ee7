"""Kept sides: the k most extreme coefficients of each neuron on one side, with their context, and the
one way entries get in (the candidate search, the sorted insertion, the exact merge). The extremes
(:mod:`~kvmem.scanning.statistics.extremes`) and the per-document bests
(:mod:`~kvmem.scanning.statistics.document_bests`) keep sides; the triggers table is every side of a layer
(:func:`trigger_part`).

Positions are int64 codes (``kvmem.plan.pack``: doc << 32 | pos); EMPTY (-1) marks an empty entry.
Entries are ordered under the tie rule of :mod:`kvmem.scanning.ordering` (most extreme first, then the
lowest code).

**Reads of the device.** The steps whose output size is data (the candidates entering a side) are
pending steps (:mod:`kvmem.scanning.reads`) of at most two reads each. No operator that makes a GPU's
host wait (``nonzero``, ``bincount``, boolean-mask indexing, ``bool()`` / ``int()`` of a device tensor)
runs outside those reads.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

from kvmem.plan import unpack
from kvmem.scanning.ordering import BLOCK_ROWS, EMPTY, order_by_value
from kvmem.scanning.reads import Pending, sizes
from kvmem.scanning.statistics.batch import ContextFn
from kvmem.schema import TRIGGER_KINDS

__all__ = ["Side", "merge_sides", "side_tensors", "side_from_tensors", "block_extremes", "stream_side", "fold",
           "fold_entries", "fold_sizes", "nonzero_static", "nonzero", "list_column", "doc_pos", "trigger_part"]


class Side:
    """The k most extreme coefficients of each neuron on one side, sorted (rank 0 = most extreme).

    values [k, F] float32 (∓inf where empty); codes [k, F] int64 (-1 where empty);
    context [k, F, C] float32: the neuron's coefficients at the C context tokens around the
    trigger (NaN outside the window the model read, and for empty entries).

    The context rows live in an append-only pool; kept entries hold their row's index, ``slots``
    [k, F] int64 (row 0 is all NaN), so reordering entries moves one integer each, not C floats.
    Whoever inserts entries moves values, codes and slots together, and appends the new
    entries' context with :meth:`add_context`. The pool is compacted to the live rows when it fills.
    ``full`` is a host-side note that every neuron holds k entries (once true it stays true), set by
    the caller from what it folded in (k finite coefficients per neuron fill a side); the search may
    take a faster search once it is set, and finds the same entries either way.
    """

    def __init__(self, values: Tensor, codes: Tensor, context: Tensor | None, largest: bool, *, width: int = 0):
        """``context`` [k, F, C]; None for a side with no entries (``width`` = C): every slot is then the NaN
        row, and the pool has room for the entries of the first two batches (at most k·F each), unwritten,
        so memory is touched only where a context is written."""
        k, d_ff = values.shape
        self.values, self.codes, self.largest = values, codes, largest
        self.full = False
        if context is None:
            self._pool, self._used = _pool_with_room(1 + 2 * k * d_ff, width, values.device), 1
            self.slots = torch.zeros((k, d_ff), dtype=torch.int64, device=values.device)
            return
        width = context.shape[2]
        self._pool = torch.cat([torch.full((1, width), float("nan"), dtype=torch.float32, device=values.device),
                                context.reshape(k * d_ff, width).float()])  # grows on the first add_context
        self._used = 1 + k * d_ff
        self.slots = torch.arange(1, 1 + k * d_ff, device=values.device).view(k, d_ff)  # [k, F] pool rows

    @classmethod
    def empty(cls, k: int, d_ff: int, width: int, *, largest: bool, device) -> Side:
        fill = float("-inf") if largest else float("inf")
        return cls(torch.full((k, d_ff), fill, dtype=torch.float32, device=device),
                   torch.full((k, d_ff), EMPTY, dtype=torch.int64, device=device), None, largest, width=width)

    @property
    def context(self) -> Tensor:
        """[k, F, C] (materialised from the pool)."""
        return self._gather(self.slots)

    def neuron_context(self) -> Tensor:
        """[F, k, C]: the context rows neuron by neuron (one gather from the pool, no transpose copy)."""
        return self._gather(self.slots.T)

    def _gather(self, slots: Tensor) -> Tensor:
        """Pool rows at ``slots`` [*S] -> [*S, C]; a flat ``index_select`` (advanced indexing: 2-3 times slower)."""
        return self._pool.index_select(0, slots.reshape(-1)).view(*slots.shape, self.width)

    @property
    def width(self) -> int:
        return self._pool.shape[1]

    def threshold(self) -> Tensor:
        """The value a new coefficient must beat (strictly) to enter: the k-th kept one [F]."""
        return self.values[-1]

    def tie_codes(self) -> Tensor:
        """The code a candidate equal to the threshold must be below to enter [F] (-1 where empty)."""
        return self.codes[-1]

    def add_context(self, rows: Tensor) -> Tensor:
        """Append context rows [n, C] to the pool -> their pool indices [n]."""
        n = rows.shape[0]
        if self._used + n > self._pool.shape[0]:
            self._compact(n)
        index = torch.arange(self._used, self._used + n, device=rows.device)
        self._pool[self._used:self._used + n] = rows
        self._used += n
        return index

    def _compact(self, room: int) -> None:
        """Keep only the rows kept entries point to (row 0 stays the NaN row); make room for ``room`` more."""
        live = self.slots.reshape(-1)
        size = 1 + 2 * live.numel() + room  # shrinks again after the dense first batches
        pool = _pool_with_room(size, self.width, self._pool.device)
        pool[1:1 + live.numel()] = self._pool[live]
        self.slots = torch.arange(1, 1 + live.numel(), device=live.device).view_as(self.slots)
        self._pool, self._used = pool, 1 + live.numel()


def _pool_with_room(rows: int, width: int, device) -> Tensor:
    """A context pool [rows, width] float32 whose row 0 is NaN (the row of empty entries); the other rows
    are left unwritten: :meth:`Side.add_context` writes each before any slot names it."""
    pool = torch.empty((rows, width), dtype=torch.float32, device=device)
    pool[0] = float("nan")
    return pool


def merge_sides(a: Side, b: Side) -> Side:
    """The k first of both sides' entries under the tie rule (:func:`kvmem.scanning.ordering.order_by_value`)."""
    k = a.values.shape[0]
    values, codes = torch.cat([a.values, b.values]), torch.cat([a.codes, b.codes])
    context = torch.cat([a.context, b.context])
    order = order_by_value(values, codes, k, a.largest)
    return Side(values.gather(0, order), codes.gather(0, order),
                context.gather(0, order[:, :, None].expand(-1, -1, context.shape[2])), a.largest)



def _insert(side: Side, values: Tensor, codes: Tensor, slots: Tensor, columns: Tensor | None = None, *,
            ordered: bool = True) -> None:
    """Fold candidates in: values, codes and their context's pool rows ``slots`` (from
    :meth:`Side.add_context`, 0 = none) [c, U] for neurons ``columns`` [U] (None = all).
    ``ordered``: the candidates have higher codes than every kept entry and are in code
    order down each column, so a stable sort by value realises the tie rule; otherwise
    entries are sorted by (value, code)."""
    k = side.values.shape[0]
    if columns is None:
        old_v, old_c, old_s = side.values, side.codes, side.slots
    else:
        old_v, old_c, old_s = (part.index_select(1, columns) for part in (side.values, side.codes, side.slots))
    all_v, all_c, all_s = torch.cat([old_v, values]), torch.cat([old_c, codes]), torch.cat([old_s, slots])
    if ordered:
        order = torch.argsort(all_v, dim=0, descending=side.largest, stable=True)[:k]  # [k, U]
    else:
        order = order_by_value(all_v, all_c, k, side.largest)
    new_v, new_c, new_s = all_v.gather(0, order), all_c.gather(0, order), all_s.gather(0, order)
    if columns is None:
        side.values, side.codes, side.slots = new_v, new_c, new_s
    else:
        for part, new in ((side.values, new_v), (side.codes, new_c), (side.slots, new_s)):
            part.index_copy_(1, columns, new)


def block_extremes(acts: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) of every block of BLOCK_ROWS rows, per neuron: [ceil(N / BLOCK_ROWS), F] each (one pass)."""
    n, width = acts.shape
    full = n - n % BLOCK_ROWS
    blocks = acts[:full].view(-1, BLOCK_ROWS, width)
    low, high = blocks.amin(dim=1), blocks.amax(dim=1)  # (aminmax over dim 1 takes a slow path: 20x)
    if full < n:
        tail_low, tail_high = acts[full:].amin(dim=0), acts[full:].amax(dim=0)
        low, high = torch.cat([low, tail_low[None]]), torch.cat([high, tail_high[None]])
    return low, high


def nonzero_static(mask: Tensor, count: int) -> Tensor:
    """Indices [count, mask.dim()] of the nonzero entries of ``mask`` in row-major order, whose number
    the caller has read: no device-to-host read (``nonzero`` asks the device for the size)."""
    try:
        return torch.nonzero_static(mask, size=count)
    except (NotImplementedError, RuntimeError):  # a device without nonzero_static
        return mask.nonzero()


def nonzero(flags: Tensor, count: int) -> Tensor:
    """Indices [count] of the nonzero entries of the 1-d ``flags``, whose number the caller knows."""
    return nonzero_static(flags, count).squeeze(1)


def fold_sizes(per_neuron: Tensor) -> Tensor:
    """The read :func:`fold` needs: candidates in all, neurons with any, the most of one neuron."""
    return sizes(per_neuron.sum(), (per_neuron > 0).sum(), per_neuron.max())


def stream_side(side: Side, acts: Tensor, codes: Tensor, context_fn: ContextFn, ordered: bool,
                extremes: Tensor) -> Pending:
    """A pending step (two reads): insert the positions that beat the side's current k-th value
    (sparse: few do after a while); unless ``ordered``, also those that tie it with a lower code.
    ``extremes``: the batch's block maxima (top) or minima (bottom) (:func:`block_extremes`).

    Until ``side.full`` (the caller's note that every neuron holds k entries) the batch is first
    cut to its k best per neuron, densely; then only blocks whose extreme reaches the threshold are
    read row by row, so the search costs one pass over the block extremes, not a comparison over all
    N × F coefficients. Both ways give the same entries; the note only picks the faster one.
    """
    k, d_ff = side.values.shape
    n = acts.shape[0]
    threshold = side.threshold()
    if n > k and not side.full:
        mask = acts > threshold if side.largest else acts < threshold  # [N, F]
        kth = torch.topk(acts, k, dim=0, largest=side.largest, sorted=False).values
        mask &= (acts >= kth.min(0).values) if side.largest else (acts <= kth.max(0).values)
        if not ordered:
            mask |= (acts == threshold) & (codes[:, None] < side.tie_codes())
        per_neuron = mask.sum(0)
        count, width, depth = yield fold_sizes(per_neuron)
        if count == 0:
            return
        neurons, rows = nonzero_static(mask.T, count).unbind(1)  # neuron-major, rows ascending
        values = acts.view(-1).index_select(0, rows * d_ff + neurons)
    else:
        if ordered:  # a tie never enters
            reach = extremes > threshold if side.largest else extremes < threshold  # [blocks, F]
        else:  # a tie may (checked by code below)
            reach = extremes >= threshold if side.largest else extremes <= threshold
        (pairs,) = yield sizes(reach.sum())
        if pairs == 0:
            return
        neurons, block = nonzero_static(reach.T, pairs).unbind(1)  # neuron-major, blocks ascending
        rows = block[:, None] * BLOCK_ROWS + torch.arange(BLOCK_ROWS, device=acts.device)  # [P, BLOCK_ROWS]
        inside = rows < n if n % BLOCK_ROWS else None
        if inside is not None:
            rows = rows.clamp(max=n - 1)
        values = acts.view(-1).index_select(0, (rows * d_ff + neurons[:, None]).view(-1)).view(rows.shape)
        limit = threshold.index_select(0, neurons)[:, None]
        enters = (values > limit) if side.largest else (values < limit)
        if not ordered:
            row_codes = codes.index_select(0, rows.view(-1)).view(rows.shape)
            enters |= (values == limit) & (row_codes < side.tie_codes().index_select(0, neurons)[:, None])
        if inside is not None:
            enters &= inside
        per_neuron = torch.zeros(d_ff, dtype=torch.int64, device=acts.device).index_add_(0, neurons, enters.sum(1))
        count, width, depth = yield fold_sizes(per_neuron)
        if count == 0:
            return
        pair, offset = nonzero_static(enters, count).unbind(1)
        rows, neurons, values = rows[pair, offset], neurons[pair], values[pair, offset]
    fold(side, rows, neurons, values, codes.index_select(0, rows), context_fn, ordered, per_neuron, width, depth)


def fold(side: Side, rows: Tensor, neurons: Tensor, values: Tensor, codes: Tensor, context_of: ContextFn,
         ordered: bool, per_neuron: Tensor, width: int, depth: int) -> None:
    """Insert the candidates (rows[i], neurons[i]) [c], grouped by neuron (rows ascending within
    one), with their values and codes [c], into ``side``; ``context_of(rows, neurons)`` gives their
    context [c, C]. ``per_neuron`` [F]: candidates of each neuron; ``width``, ``depth``: neurons with
    any, and the most of one (read with the candidates' count, :func:`fold_sizes`)."""
    c = rows.numel()
    if c == 0:
        return
    device = rows.device
    columns = nonzero(per_neuron, width)  # [U] neurons with candidates, ascending (as the groups come)
    counts = per_neuron.index_select(0, columns)
    column = torch.repeat_interleave(torch.arange(width, device=device), counts, output_size=c)  # [c]
    rank = torch.arange(c, device=device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts, output_size=c)
    at = rank * width + column  # flat place in the [depth, U] candidate arrays
    fill = float("-inf") if side.largest else float("inf")
    new_values = torch.full((depth * width,), fill, dtype=torch.float32, device=device).index_copy_(0, at, values)
    new_codes = torch.full((depth * width,), EMPTY, dtype=torch.int64, device=device).index_copy_(0, at, codes)
    slots = torch.zeros(depth * width, dtype=torch.int64, device=device)  # 0: the NaN row
    slots.index_copy_(0, at, side.add_context(context_of(rows, neurons)))
    _insert(side, new_values.view(depth, width), new_codes.view(depth, width), slots.view(depth, width),
            None if width == side.values.shape[1] else columns, ordered=ordered)


def fold_entries(side: Side, values: Tensor, codes: Tensor, context_of: ContextFn, ordered: bool) -> Pending:
    """A pending step (one read): insert a few entries per neuron: values, codes [m, F] (m small: one
    per document); ``context_of(entries, neurons)`` gives the context [c, C] of entries (row indices
    into the m) for those neurons. Only entries that beat (or, by a lower code, tie) the side's k-th
    are touched, and only their context is read."""
    threshold, tie = side.threshold(), side.tie_codes()
    beats = values > threshold if side.largest else values < threshold
    enters = beats | ((values == threshold) & (codes < tie))  # [m, F]
    per_neuron = enters.sum(0)
    count, width, depth = yield fold_sizes(per_neuron)
    if count == 0:
        return
    neurons, rows = nonzero_static(enters.T, count).unbind(1)
    fold(side, rows, neurons, values[rows, neurons], codes[rows, neurons], context_of, ordered, per_neuron, width,
         depth)



def side_tensors(side: Side, prefix: str) -> dict[str, Tensor]:
    """A side as tensors named ``prefix.values``, ``.codes``, ``.context`` (its pool gathered in order)."""
    return {f"{prefix}.{part}": getattr(side, part).contiguous() for part in ("values", "codes", "context")}


def side_from_tensors(prefix: str, tensors: dict[str, Tensor], *, largest: bool) -> Side:
    return Side(tensors[f"{prefix}.values"], tensors[f"{prefix}.codes"], tensors[f"{prefix}.context"], largest)


# ---- the triggers table: every kept side of a layer ----
def list_column(matrix: np.ndarray, *, at: np.ndarray | None = None, rows: int | None = None) -> pa.Array:
    """[R, width] float32 with NaN outside the window -> list<float32> of the valid entries per row.
    ``at`` (ascending [R]) and ``rows``: the matrix holds rows ``at`` of a column of ``rows`` rows, the
    others are empty lists."""
    valid = ~np.isnan(matrix)
    counts = np.count_nonzero(valid, axis=1)
    if at is not None:
        placed = np.zeros(rows, np.int64)
        placed[at] = counts
        counts = placed
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = matrix.reshape(-1) if offsets[-1] == matrix.size else matrix[valid]
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float32()))


def doc_pos(codes: np.ndarray) -> dict[str, pa.Array]:
    """The doc and pos columns from packed codes (:func:`kvmem.plan.unpack`)."""
    doc, pos = unpack(codes)
    return {"doc": pa.array(doc, pa.int64()), "pos": pa.array(pos.astype(np.int32), pa.int32())}


def _trigger_layer(layer: int, sides: dict[str, Side], extras: int) -> dict[str, np.ndarray]:
    """One layer's kept triggers, sorted by (neuron, kind, rank); empty entries dropped. ``context``
    [rows, C] float32 (NaN outside the window)."""
    k, d_ff = sides["top"].values.shape
    shape = (d_ff, len(sides), k)  # [F, kinds, k]: the table's row order
    values = np.stack([side.values.cpu().numpy().T for side in sides.values()], axis=1)
    codes = np.stack([side.codes.cpu().numpy().T for side in sides.values()], axis=1)
    keep = (codes >= 0).reshape(-1)
    every = bool(keep.all())  # a scan of more than k positions keeps every entry: no masking copies
    context = np.empty((*shape, sides["top"].width), np.float32)
    for j, side in enumerate(sides.values()):
        context[:, j] = side.neuron_context().cpu().numpy()
    context = context.reshape(len(keep), context.shape[-1])
    if not every:
        context = context[keep]

    def flat(array: np.ndarray) -> np.ndarray:
        array = np.broadcast_to(array, shape).reshape(-1)
        return array if every else array[keep]

    kinds = np.array([TRIGGER_KINDS.index(name) for name in sides], np.int64)
    width = context.shape[1] - extras  # gate, up after the context coefficients (or none)
    nan = np.full(len(context), np.nan, np.float32)
    return {"layer": np.full(len(context), layer, np.int16), "neuron": flat(np.arange(d_ff, dtype=np.int32)[:, None, None]),
            "kind": flat(kinds[None, :, None]), "rank": flat(np.arange(k, dtype=np.int16)[None, None, :]),
            "activation": flat(values), "code": flat(codes), "context": context[:, :width],
            "gate_pre": context[:, width] if extras else nan,
            "up_pre": context[:, width + 1] if extras else nan}


def trigger_part(layer: int, sides: dict[str, Side], extras: int) -> pa.Table:
    """The triggers table's rows of one layer, from its kept sides (kind -> side, in the table's kind order):
    one row per kept trigger, sorted by (neuron, kind, rank); its text is the row (doc, pos) of the contexts
    table. ``extras``: values after the context coefficients in each context row (2: gate, up)."""
    part = _trigger_layer(layer, sides, extras)
    return pa.table({
        "layer": part["layer"], "neuron": part["neuron"],
        "kind": pc.take(pa.array(TRIGGER_KINDS, pa.string()), pa.array(part["kind"])),
        "rank": part["rank"], "activation": pa.array(part["activation"], pa.float32()),
        **doc_pos(part["code"]),
        "context_activations": list_column(part["context"]),
        "gate_pre": pa.array(part["gate_pre"], pa.float32()), "up_pre": pa.array(part["up_pre"], pa.float32()),
    })
