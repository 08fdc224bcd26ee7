"""The k most extreme coefficients of each neuron on one side (top or bottom), kept sorted while
batches stream by: their storage (:class:`Side`), the search for positions that can enter, and
their sorted insertion with each one's context coefficients.

One rule orders kept entries everywhere: most extreme coefficient first, and among equal
coefficients the lowest code (earliest (doc, pos)) first. When a batch's codes increase along a
process's stream (``ordered``), a stable sort realises the rule; otherwise (length-sorted
batches, :mod:`kvmem.plan`) candidates that tie the k-th kept value are let in by code and the
kept entries are sorted by (value, code).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["EMPTY", "ContextFn", "Side", "window_context", "merge_sides", "block_extremes", "stream_side", "fold",
           "fold_entries"]

EMPTY = -1

# (flat row indices [C], neuron indices [C]) -> coefficients of that neuron around each row [C, width]
ContextFn = Callable[[Tensor, Tensor], Tensor]


def window_context(acts: Tensor, rows: Tensor, neurons: Tensor, steps: Tensor, first: Tensor, end: Tensor) -> Tensor:
    """Coefficients of neuron ``neurons[i]`` at rows ``rows[i] + steps`` -> [c, len(steps)] float32,
    NaN where that row lies outside the row's window (``first[row] <= row + step < end[row]``).

    acts [N, F]; rows, neurons [c]; steps [C]; first, end [N] each row's window bounds in acts.
    (A flat ``index_select``: advanced indexing of acts costs several times as much.)
    """
    n, d_ff = acts.shape
    around = rows[:, None] + steps[None, :]  # [c, C]
    inside = (around >= first.index_select(0, rows)[:, None]) & (around < end.index_select(0, rows)[:, None])
    flat = around.clamp_(0, n - 1).mul_(d_ff).add_(neurons[:, None])
    got = acts.view(-1).index_select(0, flat.view(-1)).view(flat.shape)
    return got.masked_fill_(~inside, float("nan"))


class Side:
    """The k most extreme coefficients of each neuron on one side, sorted (rank 0 = most extreme).

    values [k, F] float32 (∓inf where empty); codes [k, F] int64 (-1 where empty);
    context [k, F, C] float32: the neuron's coefficients at the C context tokens around the
    trigger (NaN outside the window the model read, and for empty entries).

    The context rows live in an append-only pool; kept entries hold their row's index (row 0 is
    all NaN), so reordering entries moves one integer each, not C floats. The pool is compacted
    to the live rows when it fills.
    """

    def __init__(self, values: Tensor, codes: Tensor, context: Tensor, largest: bool):
        k, d_ff, width = context.shape
        self.values, self.codes, self.largest = values, codes, largest
        self._pool = torch.cat([torch.full((1, width), float("nan"), dtype=torch.float32, device=values.device),
                                context.reshape(k * d_ff, width).float()])  # grows on the first add_context
        self._used = 1 + k * d_ff
        self.slots = torch.arange(1, 1 + k * d_ff, device=values.device).view(k, d_ff)  # [k, F] pool rows

    @classmethod
    def empty(cls, k: int, d_ff: int, width: int, *, largest: bool, device) -> Side:
        fill = float("-inf") if largest else float("inf")
        return cls(torch.full((k, d_ff), fill, dtype=torch.float32, device=device),
                   torch.full((k, d_ff), EMPTY, dtype=torch.int64, device=device),
                   torch.full((k, d_ff, width), float("nan"), dtype=torch.float32, device=device), largest)

    @property
    def context(self) -> Tensor:
        """[k, F, C] (materialised from the pool)."""
        return self._pool[self.slots]

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
        pool = torch.full((size, self.width), float("nan"), dtype=torch.float32, device=self._pool.device)
        pool[1:1 + live.numel()] = self._pool[live]
        self.slots = torch.arange(1, 1 + live.numel(), device=live.device).view_as(self.slots)
        self._pool, self._used = pool, 1 + live.numel()

    def insert(self, values: Tensor, codes: Tensor, slots: Tensor, columns: Tensor | None = None, *,
               ordered: bool = True) -> None:
        """Fold candidates in: values, codes and their context's pool rows ``slots`` (from
        :meth:`add_context`, 0 = none) [c, U] for neurons ``columns`` [U] (None = all).
        ``ordered``: the candidates have higher codes than every kept entry and are in code
        order down each column, so a stable sort by value realises the tie rule; otherwise
        entries are sorted by (value, code)."""
        k = self.values.shape[0]
        if columns is None:
            old_v, old_c, old_s = self.values, self.codes, self.slots
        else:
            old_v, old_c, old_s = (part.index_select(1, columns) for part in (self.values, self.codes, self.slots))
        all_v, all_c, all_s = torch.cat([old_v, values]), torch.cat([old_c, codes]), torch.cat([old_s, slots])
        if ordered:
            order = torch.argsort(all_v, dim=0, descending=self.largest, stable=True)[:k]  # [k, U]
        else:
            order = _order_full(all_v, all_c, k, self.largest)
        new_v, new_c, new_s = all_v.gather(0, order), all_c.gather(0, order), all_s.gather(0, order)
        if columns is None:
            self.values, self.codes, self.slots = new_v, new_c, new_s
        else:
            for part, new in ((self.values, new_v), (self.codes, new_c), (self.slots, new_s)):
                part.index_copy_(1, columns, new)


def _order_full(values: Tensor, codes: Tensor, k: int, largest: bool) -> Tensor:
    """Indices [k, F] of the k first of each column of [m, F] under (value, then code ascending); empties last."""
    sort_codes = torch.where(codes < 0, torch.iinfo(torch.int64).max, codes)
    by_code = torch.argsort(sort_codes, dim=0, stable=True)
    by_value = torch.argsort(values.gather(0, by_code), dim=0, descending=largest, stable=True)[:k]
    return by_code.gather(0, by_value)


def merge_sides(a: Side, b: Side) -> Side:
    k = a.values.shape[0]
    values, codes = torch.cat([a.values, b.values]), torch.cat([a.codes, b.codes])
    context = torch.cat([a.context, b.context])
    order = _order_full(values, codes, k, a.largest)
    return Side(values.gather(0, order), codes.gather(0, order),
                context.gather(0, order[:, :, None].expand(-1, -1, context.shape[2])), a.largest)


_ROWS = 32  # rows per block of the candidate search's block extremes


def block_extremes(acts: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) of every block of _ROWS rows, per neuron: [ceil(N / _ROWS), F] each (one pass)."""
    n, width = acts.shape
    full = n - n % _ROWS
    blocks = acts[:full].view(-1, _ROWS, width)
    low, high = blocks.amin(dim=1), blocks.amax(dim=1)  # (aminmax over dim 1 takes a slow path: 20x)
    if full < n:
        tail_low, tail_high = acts[full:].amin(dim=0), acts[full:].amax(dim=0)
        low, high = torch.cat([low, tail_low[None]]), torch.cat([high, tail_high[None]])
    return low, high


def _candidates(side: Side, acts: Tensor, codes: Tensor, extremes: Tensor, ordered: bool
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(rows, neurons, values) [c] of the positions that enter the side, grouped by neuron, rows ascending.

    Only blocks whose extreme reaches the threshold are read row by row, so after the first
    batches (when few positions beat the k-th kept value) the search costs one pass over the
    block extremes, not a comparison and a nonzero over all N × F coefficients.
    """
    n, d_ff = acts.shape
    threshold = side.threshold()
    if ordered:  # a tie never enters
        reach = extremes > threshold if side.largest else extremes < threshold  # [blocks, F]
    else:  # a tie may (checked by code below)
        reach = extremes >= threshold if side.largest else extremes <= threshold
    neurons, block = reach.T.nonzero(as_tuple=True)  # neuron-major, blocks ascending
    rows = block[:, None] * _ROWS + torch.arange(_ROWS, device=acts.device)  # [P, _ROWS]
    inside = rows < n if n % _ROWS else None
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
    pair, offset = enters.nonzero(as_tuple=True)
    return rows[pair, offset], neurons[pair], values[pair, offset]


def stream_side(side: Side, acts: Tensor, codes: Tensor, context_fn: ContextFn, ordered: bool = True,
                 extremes: Tensor | None = None) -> None:
    """Insert the positions that beat the side's current k-th value (sparse: few do after a while);
    unless ``ordered``, also those that tie it with a lower code. ``extremes``: the batch's
    block maxima (top) or minima (bottom) from :func:`block_extremes`."""
    k, d_ff = side.values.shape
    threshold = side.threshold()
    if acts.shape[0] > k and bool(torch.isinf(threshold).any()):  # not yet full: cut to this batch's k best
        mask = acts > threshold if side.largest else acts < threshold  # [N, F]
        kth = torch.topk(acts, k, dim=0, largest=side.largest, sorted=False).values
        mask &= (acts >= kth.min(0).values) if side.largest else (acts <= kth.max(0).values)
        if not ordered:
            mask |= (acts == threshold) & (codes[:, None] < side.tie_codes())
        neurons, rows = mask.T.nonzero(as_tuple=True)  # neuron-major, rows ascending
        values = acts.view(-1).index_select(0, rows * d_ff + neurons)
    else:
        if extremes is None:
            low, high = block_extremes(acts)
            extremes = high if side.largest else low
        rows, neurons, values = _candidates(side, acts, codes, extremes, ordered)
    fold(side, rows, neurons, values, codes.index_select(0, rows), context_fn, ordered)


def fold(side: Side, rows: Tensor, neurons: Tensor, values: Tensor, codes: Tensor, context_of: ContextFn,
          ordered: bool) -> None:
    """Insert the candidates (rows[i], neurons[i]) [c], grouped by neuron (rows ascending within
    one), with their values and codes [c], into ``side``; ``context_of(rows, neurons)`` gives their
    context [c, C]."""
    c = rows.numel()
    if c == 0:
        return
    device = rows.device
    columns, counts = torch.unique_consecutive(neurons, return_counts=True)  # [U] neurons with candidates
    width = columns.numel()
    column = torch.repeat_interleave(torch.arange(width, device=device), counts)  # [c]
    rank = torch.arange(c, device=device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    at = rank * width + column  # flat place in the [depth, U] candidate arrays
    depth = int(counts.max())
    fill = float("-inf") if side.largest else float("inf")
    new_values = torch.full((depth * width,), fill, dtype=torch.float32, device=device).index_copy_(0, at, values)
    new_codes = torch.full((depth * width,), EMPTY, dtype=torch.int64, device=device).index_copy_(0, at, codes)
    slots = torch.zeros(depth * width, dtype=torch.int64, device=device)  # 0: the NaN row
    slots.index_copy_(0, at, side.add_context(context_of(rows, neurons)))
    side.insert(new_values.view(depth, width), new_codes.view(depth, width), slots.view(depth, width),
                None if width == side.values.shape[1] else columns, ordered=ordered)


def fold_entries(side: Side, values: Tensor, codes: Tensor, context_of: ContextFn, ordered: bool) -> None:
    """Insert a few entries per neuron: values, codes [m, F] (m small: one per document);
    ``context_of(entries, neurons)`` gives the context [c, C] of entries (row indices into the m)
    for those neurons. Only entries that beat (or, by a lower code, tie) the side's k-th are
    touched, and only their context is read."""
    threshold, tie = side.threshold(), side.tie_codes()
    beats = values > threshold if side.largest else values < threshold
    neurons, rows = (beats | ((values == threshold) & (codes < tie))).T.nonzero(as_tuple=True)
    fold(side, rows, neurons, values[rows, neurons], codes[rows, neurons], context_of, ordered)
