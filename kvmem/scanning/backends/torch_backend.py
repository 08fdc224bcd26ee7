"""The torch backend: one batch's statistics, candidate search, sorted insertion and sample
updates as torch ops, on any device (the path a GPU runs).

Each step reads a batch acts [N, F] float32 of one layer and writes into that layer's state
(:mod:`kvmem.scanning.state`). The tie rule and the sampling order are
:mod:`kvmem.scanning.rules`'; the bins are :mod:`kvmem.scanning.histogram`'s.

**Reads of the device.** The steps whose output size is data (the candidates entering a side, the
sampled positions reaching a cell, the random sample's entries) are pending steps
(:mod:`kvmem.scanning.reads`) of at most two reads each, handed to :attr:`Backend.reads`: folded
under ``reads.collecting()``, a layer costs two host synchronisations in all, per-document sides
included. Every other size is known on the host (shapes, or the batch's layout read once before
the forward, :class:`~kvmem.scanning.backends.base.Documents`). No operator that makes a GPU's host
wait (``nonzero``, ``bincount``, boolean-mask indexing, ``bool()`` / ``int()`` of a device tensor)
runs outside those reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.scanning.backends.base import Backend, BatchStatistics, ContextFn, Documents
from kvmem.scanning.histogram import bin_of, histogram_fold
from kvmem.scanning.reads import Pending, sizes
from kvmem.scanning.rules import BLOCK_ROWS, EMPTY, NO_KEY, keys_or_none, order_by_key, order_by_value
from kvmem.scanning.state import BinSample, RandomSample, Side

__all__ = ["TorchBackend", "block_extremes"]


class TorchBackend(Backend):
    """Torch ops on the state's device."""

    name = "torch"

    def window_context(self, acts: Tensor, rows: Tensor, neurons: Tensor, steps: Tensor, first: Tensor,
                       end: Tensor, extras: Tensor | None = None) -> Tensor:
        """A flat ``index_select`` (advanced indexing of acts costs several times as much)."""
        n, d_ff = acts.shape
        around = rows[:, None] + steps[None, :]  # [c, C]
        inside = (around >= first.index_select(0, rows)[:, None]) & (around < end.index_select(0, rows)[:, None])
        flat = around.clamp_(0, n - 1).mul_(d_ff).add_(neurons[:, None])
        got = acts.reshape(-1).index_select(0, flat.view(-1)).view(flat.shape).masked_fill_(~inside, float("nan"))
        if extras is None or extras.shape[0] == 0:
            return got
        at = rows * d_ff + neurons
        return torch.cat([got, extras.reshape(extras.shape[0], -1).index_select(1, at).T], dim=1)

    @torch.inference_mode()  # the scratch buffers are inference tensors
    def statistics(self, acts: Tensor, histogram: Tensor, positive: Tensor) -> BatchStatistics:
        low, high = block_extremes(acts)
        total = _column_sum(acts)
        total_sq = _column_sum(torch.mul(acts, acts, out=_scratch(acts.shape, torch.float32, acts.device)))
        self.reads.defer(histogram_fold(histogram, positive, acts, _scratch(acts.shape, torch.int32, acts.device).view(-1)))
        return BatchStatistics(low, high, total, total_sq)

    def stream_side(self, side: Side, acts: Tensor, codes: Tensor, context_fn: ContextFn, ordered: bool,
                    extremes: Tensor) -> None:
        self.reads.defer(stream_side(side, acts, codes, context_fn, ordered, extremes))

    def fold_documents(self, pairs, acts: Tensor, codes: Tensor, documents: Documents,
                       context_fn: ContextFn, ordered: bool) -> list[Side]:
        block = _Documents(acts, documents)
        opened = []
        for side, open_side in pairs:
            last, pending = _fold_documents(side, open_side, block, codes, context_fn, ordered)
            self.reads.defer(pending)
            opened.append(last)
        return opened

    def fold_entries(self, side: Side, values: Tensor, codes: Tensor, context_of: ContextFn, ordered: bool) -> None:
        self.reads.defer(fold_entries(side, values, codes, context_of, ordered))

    def random_sample(self, sample: RandomSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor,
                      context_fn: ContextFn) -> None:
        self.reads.defer(random_sample(sample, acts, rows, row_keys, row_codes, context_fn))

    def bin_sample(self, sample: BinSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor) -> None:
        self.reads.defer(bin_sample(sample, acts, rows, row_keys, row_codes))

    @torch.inference_mode()
    def position_product(self, acts: Tensor, positions: Tensor) -> Tensor:
        """float32 products m·p, summed as :func:`_column_sum` sums m (the numba backend runs this same code)."""
        return _column_sum(torch.mul(acts, positions[:, None], out=_scratch(acts.shape, torch.float32, acts.device)))

    @torch.inference_mode()
    def quadrant_counts(self, counts: Tensor, gate: Tensor, up: Tensor) -> None:
        n = gate.shape[0]
        gate_on, up_on = gate > 0, up > 0  # [N, F] bool
        both = torch.logical_and(gate_on, up_on).sum(dim=0)
        gate_total, up_total = gate_on.sum(dim=0), up_on.sum(dim=0)
        counts[0] += both
        counts[1] += gate_total - both
        counts[2] += up_total - both
        counts[3] += n - gate_total - up_total + both


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


def _nonzero_static(mask: Tensor, count: int) -> Tensor:
    """Indices [count, mask.dim()] of the nonzero entries of ``mask`` in row-major order, whose number
    the caller has read: no device-to-host read (``nonzero`` asks the device for the size)."""
    try:
        return torch.nonzero_static(mask, size=count)
    except (NotImplementedError, RuntimeError):  # a device without nonzero_static
        return mask.nonzero()


def _nonzero(flags: Tensor, count: int) -> Tensor:
    """Indices [count] of the nonzero entries of the 1-d ``flags``, whose number the caller knows."""
    return _nonzero_static(flags, count).squeeze(1)


def _fold_sizes(per_neuron: Tensor) -> Tensor:
    """The read :func:`fold` needs: candidates in all, neurons with any, the most of one neuron."""
    return sizes(per_neuron.sum(), (per_neuron > 0).sum(), per_neuron.max())


def stream_side(side: Side, acts: Tensor, codes: Tensor, context_fn: ContextFn, ordered: bool,
                extremes: Tensor) -> Pending:
    """A pending step (two reads): insert the positions that beat the side's current k-th value
    (sparse: few do after a while); unless ``ordered``, also those that tie it with a lower code.
    ``extremes``: the batch's block maxima (top) or minima (bottom) (:class:`BatchStatistics`).

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
        count, width, depth = yield _fold_sizes(per_neuron)
        if count == 0:
            return
        neurons, rows = _nonzero_static(mask.T, count).unbind(1)  # neuron-major, rows ascending
        values = acts.view(-1).index_select(0, rows * d_ff + neurons)
    else:
        if ordered:  # a tie never enters
            reach = extremes > threshold if side.largest else extremes < threshold  # [blocks, F]
        else:  # a tie may (checked by code below)
            reach = extremes >= threshold if side.largest else extremes <= threshold
        (pairs,) = yield sizes(reach.sum())
        if pairs == 0:
            return
        neurons, block = _nonzero_static(reach.T, pairs).unbind(1)  # neuron-major, blocks ascending
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
        count, width, depth = yield _fold_sizes(per_neuron)
        if count == 0:
            return
        pair, offset = _nonzero_static(enters, count).unbind(1)
        rows, neurons, values = rows[pair, offset], neurons[pair], values[pair, offset]
    fold(side, rows, neurons, values, codes.index_select(0, rows), context_fn, ordered, per_neuron, width, depth)


def fold(side: Side, rows: Tensor, neurons: Tensor, values: Tensor, codes: Tensor, context_of: ContextFn,
         ordered: bool, per_neuron: Tensor, width: int, depth: int) -> None:
    """Insert the candidates (rows[i], neurons[i]) [c], grouped by neuron (rows ascending within
    one), with their values and codes [c], into ``side``; ``context_of(rows, neurons)`` gives their
    context [c, C]. ``per_neuron`` [F]: candidates of each neuron; ``width``, ``depth``: neurons with
    any, and the most of one (read with the candidates' count, :func:`_fold_sizes`)."""
    c = rows.numel()
    if c == 0:
        return
    device = rows.device
    columns = _nonzero(per_neuron, width)  # [U] neurons with candidates, ascending (as the groups come)
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
    count, width, depth = yield _fold_sizes(per_neuron)
    if count == 0:
        return
    neurons, rows = _nonzero_static(enters.T, count).unbind(1)
    fold(side, rows, neurons, values[rows, neurons], codes[rows, neurons], context_of, ordered, per_neuron, width,
         depth)


class _Documents:
    """A batch's documents (:class:`~kvmem.scanning.backends.base.Documents`) read from acts [N, F]
    in memory linear in N, whatever their lengths (a padded [documents, longest, F] block grows with
    the square of the batch when one long document shares it with many short ones)."""

    def __init__(self, acts: Tensor, documents: Documents):
        self.acts, self.documents = acts, documents
        self.starts, self.lengths = documents.starts, documents.lengths

    def best(self, largest: bool) -> Tensor:
        """Each document's largest (or smallest) value per neuron [S, F] (one segmented reduction)."""
        return torch.segment_reduce(self.acts, "max" if largest else "min", lengths=self.lengths, axis=0)

    def first_row(self, documents: Tensor, neurons: Tensor, values: Tensor, longest: int) -> Tensor:
        """The first row of acts where document documents[i] holds values[i] for neuron neurons[i] -> [c]
        (the document's first row when none does: a value carried over from an earlier batch);
        ``longest``: the most rows of those documents. Read in chunks of at most N × F / 4 places."""
        n, d_ff = self.acts.shape
        c = documents.shape[0]
        offsets = torch.arange(max(longest, 1), device=self.acts.device)
        per_chunk = max(1, n * d_ff // (4 * max(longest, 1)))
        found_rows = []
        for at in range(0, c, per_chunk):
            doc, neuron, value = documents[at:at + per_chunk], neurons[at:at + per_chunk], values[at:at + per_chunk]
            start, length = self.starts.index_select(0, doc), self.lengths.index_select(0, doc)
            inside = offsets[None, :] < length[:, None]  # [c, longest]
            flat = (start[:, None] + torch.minimum(offsets[None, :], length[:, None] - 1)) * d_ff + neuron[:, None]
            found = self.acts.view(-1).index_select(0, flat.view(-1)).view(flat.shape) == value[:, None]
            found &= inside
            found_rows.append(start + found.to(torch.uint8).argmax(dim=1))  # argmax: the first
        return torch.cat(found_rows) if len(found_rows) != 1 else found_rows[0]


def _fold_documents(side: Side, open_side: Side | None, documents: _Documents, codes: Tensor, context_fn: ContextFn,
                    ordered: bool) -> tuple[Side, Pending | None]:
    """The batch's last document's best (k = 1) now, and -> a pending step (two reads) that folds the
    complete documents' bests into ``side`` (None when the batch holds one document). ``open_side``:
    the best so far of the batch's first document when it continues from the previous batch."""
    largest = side.largest
    values = documents.best(largest)  # [n, F]
    n, d_ff = values.shape
    earlier = None  # [F]: the open document's earlier best stays (it wins ties: lower code)
    if open_side is not None:
        earlier = ~(values[0] > open_side.values[0] if largest else values[0] < open_side.values[0])
        values[0] = torch.where(earlier, open_side.values[0], values[0])

    def rows_and_codes(doc: Tensor, neuron: Tensor, longest: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Rows [c] and codes [c] of documents doc's best (at most ``longest`` rows each) for neurons
        neuron, and which of them the open document's earlier best holds (None when none continues)."""
        rows = documents.first_row(doc, neuron, values[doc, neuron], longest)
        entry_codes = codes.index_select(0, rows)
        if earlier is None:
            return rows, entry_codes, None
        from_earlier = (doc == 0) & earlier.index_select(0, neuron)
        return rows, torch.where(from_earlier, open_side.codes[0].index_select(0, neuron), entry_codes), from_earlier

    def context_of(rows: Tensor, neuron: Tensor, from_earlier: Tensor | None) -> Tensor:
        context = context_fn(rows, neuron)
        if from_earlier is None:
            return context
        return torch.where(from_earlier[:, None], open_side.context[0].index_select(0, neuron), context)

    def complete_documents() -> Pending:
        """Fold every document but the last (complete) whose best enters."""
        complete = values[:-1]
        threshold = side.threshold()
        beats = complete > threshold if largest else complete < threshold
        k = side.values.shape[0]
        if n - 1 > k:  # no more than this batch's k best enter (the others have k better beside them)
            kth = torch.topk(complete, k, dim=0, largest=largest, sorted=False).values
            beats &= (complete >= kth.amin(0)) if largest else (complete <= kth.amax(0))
        maybe = beats | (complete == threshold)  # a tie enters with a lower code
        (pairs,) = yield sizes(maybe.sum())
        if pairs == 0:
            return
        neuron, doc = _nonzero_static(maybe.T, pairs).unbind(1)  # neuron-major
        rows, entry_codes, from_earlier = rows_and_codes(doc, neuron, documents.documents.longest_complete)
        enter = beats[doc, neuron] | (entry_codes < side.tie_codes().index_select(0, neuron))  # tie: lower code
        per_neuron = torch.zeros(d_ff, dtype=torch.int64, device=values.device).index_add_(0, neuron, enter.long())
        count, width, depth = yield _fold_sizes(per_neuron)
        if count == 0:
            return
        if count < pairs:
            keep = _nonzero(enter, count)
            doc, neuron, rows, entry_codes = (t.index_select(0, keep) for t in (doc, neuron, rows, entry_codes))
            from_earlier = from_earlier.index_select(0, keep) if from_earlier is not None else None
        context = context_of(rows, neuron, from_earlier)
        fold(side, doc, neuron, values[doc, neuron], entry_codes, lambda r, x: context, ordered, per_neuron, width,
             depth)

    neurons = torch.arange(d_ff, device=values.device)
    rows, open_codes, from_earlier = rows_and_codes(torch.full_like(neurons, n - 1), neurons,
                                                    documents.documents.last_length)
    last = Side(values[-1:], open_codes[None], context_of(rows, neurons, from_earlier)[None], largest)
    return last, (complete_documents() if n > 1 else None)


def random_sample(sample: RandomSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor,
                  context_fn: ContextFn) -> Pending | None:
    """A pending step (one read): fold a batch into the random sample: acts [N, F]; ``rows`` [m] the
    batch's positions with the m smallest (key, code), their keys and codes [m]."""
    size, d_ff = sample.values.shape
    if size == 0 or rows.numel() == 0:
        return None
    return _random_entries(sample, acts, rows, row_keys, row_codes, context_fn)


def _random_entries(sample: RandomSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor,
                    context_fn: ContextFn) -> Pending:
    size, d_ff = sample.values.shape
    own = keys_or_none(sample.codes, sample.seed)
    all_codes = torch.cat([sample.codes, row_codes])
    order = order_by_key(torch.cat([own, row_keys]), all_codes, 0, check_ties=False)[:size]  # into [old S, new m]
    is_new = order >= size
    (n,) = yield sizes(is_new.sum())  # the new rows kept
    if n == 0:
        return
    entering = order.index_select(0, _nonzero(is_new, n)) - size
    slots = sample.slots if sample.slots is not None else torch.arange(size, device=acts.device)
    kept_old = torch.zeros(size, dtype=torch.bool, device=acts.device)
    kept_old[order.index_select(0, _nonzero(~is_new, size - n))] = True
    freed = slots.index_select(0, _nonzero(~kept_old, n))  # as many as enter
    new_rows = rows.index_select(0, entering)
    neurons = torch.arange(d_ff, device=acts.device)
    sample.store[freed] = context_fn(new_rows.repeat_interleave(d_ff), neurons.repeat(n)).view(n, d_ff, -1)
    slot_of_new = torch.zeros(rows.numel(), dtype=torch.int64, device=acts.device)
    slot_of_new[entering] = freed
    sample.slots = torch.cat([slots, slot_of_new])[order]
    sample.codes = all_codes[order]
    sample.values = torch.cat([sample.values, acts.index_select(0, rows)])[order]


def _high_bits(keys: Tensor) -> Tensor:
    """int32 that orders like the keys, coarsely: key >> 22 (keys < 2^53), NO_KEY as the int32 maximum.
    ``_high_bits(a) > _high_bits(b)`` implies ``a > b``."""
    return (keys >> 22).clamp_(max=torch.iinfo(torch.int32).max).int()


def bin_sample(sample: BinSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor) -> Pending:
    """A pending step (two reads): fold the thinned positions ``rows`` [r] of acts [N, F] (their keys
    and codes [r]) into the bin samples."""
    d_ff, bins, q = sample.codes.shape
    order = order_by_key(row_keys, row_codes, 0, check_ties=False)  # by (key, code): candidates come out in that order
    rows, row_keys, row_codes = rows[order], row_keys[order], row_codes[order]
    sub = acts.index_select(0, rows)  # [r, F]
    if sample.last_keys is None or sample.last_high is None:  # the key each (bin, neuron) must beat, kept up to date below
        sample.last_keys = keys_or_none(sample.codes[:, :, -1], sample.seed).T.contiguous()  # [B, F]
        sample.last_high = _high_bits(sample.last_keys)
    # (bin, neuron) of each value, flat in [B, F]: bin * F + neuron, int32
    at = torch.add(torch.arange(d_ff, dtype=torch.int32, device=acts.device), bin_of(sub, wide=False), alpha=d_ff)
    # a first cut on the keys' high bits (int32, a table half the size), then the exact keys
    high = sample.last_high.view(-1).index_select(0, at.view(-1)).view(at.shape)
    first_cut = _high_bits(row_keys)[:, None] <= high  # [r, F]
    (cut,) = yield sizes(first_cut.sum())
    if cut == 0:
        return
    at_row, neuron = _nonzero_static(first_cut, cut).unbind(1)  # by (key, code), then neuron
    at = at.view(-1).index_select(0, at_row * d_ff + neuron)
    exact = row_keys.index_select(0, at_row) <= sample.last_keys.view(-1).index_select(0, at)
    cell = neuron * bins + at.div(d_ff, rounding_mode="floor")  # flat (neuron, bin) of codes.view(-1, q)
    per_cell = torch.zeros(d_ff * bins, dtype=torch.int64, device=acts.device).index_add_(0, cell, exact.long())
    # the sizes in one read: candidates, cells with candidates, and candidates among a cell's q first
    total, width, kept = yield sizes(exact.sum(), (per_cell > 0).sum(), per_cell.clamp(max=q).sum())
    if total == 0:
        return
    exact = _nonzero(exact, total)
    at_row, neuron, cell = at_row.index_select(0, exact), neuron.index_select(0, exact), cell.index_select(0, exact)
    by_cell = torch.argsort(cell, stable=True)  # grouped by cell, (key, code) order kept within
    cell, at_row, neuron = cell[by_cell], at_row[by_cell], neuron[by_cell]
    cells = _nonzero(per_cell, width)  # ascending, as the groups come
    counts = per_cell.index_select(0, cells)
    which = torch.repeat_interleave(torch.arange(width, device=acts.device), counts, output_size=total)
    rank = torch.arange(total, device=acts.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts,
                                                                             output_size=total)
    first = _nonzero(rank < q, kept)  # only a cell's q smallest new keys can be kept
    place = (which * q + rank).index_select(0, first)
    at_row, neuron = at_row.index_select(0, first), neuron.index_select(0, first)
    new_keys = torch.full((width * q,), NO_KEY, dtype=torch.int64, device=acts.device)
    new_keys.index_copy_(0, place, row_keys.index_select(0, at_row))
    new_codes = torch.full((width * q,), -1, dtype=torch.int64, device=acts.device)
    new_codes.index_copy_(0, place, row_codes.index_select(0, at_row))
    new_values = torch.full((width * q,), float("nan"), dtype=torch.float32, device=acts.device)
    new_values.index_copy_(0, place, sub.view(-1).index_select(0, at_row * d_ff + neuron))
    flat_codes, flat_values = sample.codes.view(-1, q), sample.values.view(-1, q)
    old_codes = flat_codes.index_select(0, cells)  # [U, q], sorted by (key, code), empties last
    all_codes = torch.cat([old_codes, new_codes.view(width, q)], dim=1)  # [U, 2q]
    all_keys = torch.cat([keys_or_none(old_codes, sample.seed), new_keys.view(width, q)], dim=1)
    keep = order_by_key(all_keys, all_codes, 1, check_ties=False)[:, :q]
    kept_codes = all_codes.gather(1, keep)
    kept_values = torch.cat([flat_values.index_select(0, cells), new_values.view(width, q)], dim=1).gather(1, keep)
    kept_keys = all_keys.gather(1, keep)
    flat_codes.index_copy_(0, cells, kept_codes)
    flat_values.index_copy_(0, cells, kept_values)
    at = (cells % bins) * d_ff + cells.div(bins, rounding_mode="floor")
    sample.last_keys.view(-1).index_copy_(0, at, kept_keys[:, -1])
    sample.last_high.view(-1).index_copy_(0, at, _high_bits(kept_keys[:, -1]))


_BLOCK = 32  # rows summed in float32 before the float64 accumulation


def _column_sum(values: Tensor) -> Tensor:
    """Σ over rows of values [N, F] -> [F] float64: float32 over blocks of 32 rows, then float64.

    A block's float32 sum errs by at most ~32·2⁻²⁴ of Σ|m| in the worst case (measured 2e-8 on
    SmolLM2's coefficients), well under a float32 coefficient's own precision, and costs a tenth of
    a float64 sum of every value on a GPU. Deterministic for a given batch.
    """
    n, width = values.shape
    full = n - n % _BLOCK
    total = values[:full].view(-1, _BLOCK, width).sum(dim=1).sum(dim=0, dtype=torch.float64)
    return total + values[full:].sum(dim=0, dtype=torch.float64) if full < n else total


_SCRATCH: dict[tuple[torch.dtype, str], Tensor] = {}


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """A reused buffer of ``shape`` for one batch's temporaries (one per dtype and device): a fresh
    [N, F] tensor per layer and batch would be allocated, and its pages faulted in, every time."""
    numel = 1
    for size in shape:
        numel *= size
    key = (dtype, str(device))
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)
