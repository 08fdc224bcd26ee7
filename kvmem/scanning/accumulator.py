"""Streaming, mergeable per-neuron state: top-k / bottom-k triggers with their context
coefficients, exact moments and histograms.

Memory is O(layers · d_ff · top_k · context); no tensor of shape (all tokens × d_ff) is ever held.
Positions are int64 codes (``kvmem.plan.pack``: doc << 32 | pos); -1 marks an empty entry.

One rule orders kept triggers everywhere: most extreme coefficient first, and among equal
coefficients the lowest code (earliest (doc, pos)) first. When a batch's codes increase along a
process's stream (``ordered``), a stable sort realises the rule; otherwise (length-sorted
batches, :mod:`kvmem.plan`) candidates that tie the k-th kept value are let in by code and the
kept entries are sorted by (value, code), as :func:`merge_states` always does.

Sums are kept as double-double (``hi + lo``) so that merging the states of several processes gives
the same float64 totals, to the last bit, as one process adding the same batches in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from kvmem.scanning.histogram import HIST_BINS, histogram_update
from kvmem.scanning.sampling import BinSample, RandomSample

__all__ = ["Side", "LayerState", "new_layer_state", "update", "merge_states", "close_open_document", "EMPTY",
           "ContextFn", "window_context"]

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


def _merge_sides(a: Side, b: Side) -> Side:
    k = a.values.shape[0]
    values, codes = torch.cat([a.values, b.values]), torch.cat([a.codes, b.codes])
    context = torch.cat([a.context, b.context])
    order = _order_full(values, codes, k, a.largest)
    return Side(values.gather(0, order), codes.gather(0, order),
                context.gather(0, order[:, :, None].expand(-1, -1, context.shape[2])), a.largest)


@dataclass
class LayerState:
    """Running state of one layer. F = d_ff, B = HIST_BINS.

    ``count`` positions seen (the same for every neuron); ``total``/``total_sq`` [2, F] float64
    double-double sums of m and m² (row 0 high part, row 1 low part); ``positive`` [F] int64
    #{m > 0}; ``histogram`` [F, B] int64. ``doc_top``/``doc_bottom``: the best position of each
    document (only with per_document), with the still-open document's running best in ``open_*``.
    ``random``/``bins``: the samples of :mod:`kvmem.scanning.sampling` (None when switched off).
    """

    top: Side
    bottom: Side
    count: int
    total: Tensor
    total_sq: Tensor
    positive: Tensor
    histogram: Tensor
    doc_top: Side | None = None
    doc_bottom: Side | None = None
    open_doc: int = EMPTY
    open_top: Side | None = None  # k = 1
    open_bottom: Side | None = None
    random: RandomSample | None = None
    bins: BinSample | None = None

    def sides(self) -> dict[str, Side]:
        """Kind name (as in the triggers table) -> side, for the kinds this state keeps."""
        out = {"top": self.top, "bottom": self.bottom}
        if self.doc_top is not None:
            out.update(top_doc=self.doc_top, bottom_doc=self.doc_bottom)
        return out

    def sums(self) -> tuple[Tensor, Tensor]:
        """(Σm, Σm²) [F] float64."""
        return self.total[0] + self.total[1], self.total_sq[0] + self.total_sq[1]

    # ---- serialisation: tensors + plain JSON (no pickle) ----
    def to_tensors(self, prefix: str) -> tuple[dict[str, Tensor], dict]:
        tensors: dict[str, Tensor] = {}
        for name in ("total", "total_sq", "positive", "histogram"):
            tensors[f"{prefix}.{name}"] = getattr(self, name).contiguous()
        for field_name in ("top", "bottom", "doc_top", "doc_bottom", "open_top", "open_bottom"):
            side = getattr(self, field_name)
            if side is not None:
                for part in ("values", "codes", "context"):
                    tensors[f"{prefix}.{field_name}.{part}"] = getattr(side, part).contiguous()
        if self.random is not None:
            for part in ("codes", "values", "context"):
                tensors[f"{prefix}.random.{part}"] = getattr(self.random, part).contiguous()
        if self.bins is not None:
            tensors[f"{prefix}.bins.codes"], tensors[f"{prefix}.bins.values"] = self.bins.codes, self.bins.values
        meta = {"count": self.count, "open_doc": self.open_doc,
                "sides": [f.name for f in fields(self) if isinstance(getattr(self, f.name), Side)],
                "random_seed": self.random.seed if self.random is not None else None,
                "bins": [self.bins.seed, self.bins.rate] if self.bins is not None else None}
        return tensors, meta

    @classmethod
    def from_tensors(cls, prefix: str, tensors: dict[str, Tensor], meta: dict) -> LayerState:
        sides = {name: Side(tensors[f"{prefix}.{name}.values"], tensors[f"{prefix}.{name}.codes"],
                            tensors[f"{prefix}.{name}.context"], largest=name in ("top", "doc_top", "open_top"))
                 for name in meta["sides"]}
        random = bins = None
        if meta.get("random_seed") is not None:
            random = RandomSample(*(tensors[f"{prefix}.random.{part}"] for part in ("codes", "values", "context")),
                                  seed=int(meta["random_seed"]))
        if meta.get("bins") is not None:
            seed, rate = meta["bins"]
            bins = BinSample(tensors[f"{prefix}.bins.codes"], tensors[f"{prefix}.bins.values"], int(seed), float(rate))
        return cls(**sides, count=int(meta["count"]), open_doc=int(meta["open_doc"]), random=random, bins=bins,
                   **{name: tensors[f"{prefix}.{name}"] for name in ("total", "total_sq", "positive", "histogram")})


def new_layer_state(d_ff: int, top_k: int, *, per_document: bool, context_width: int,
                    device: str | torch.device = "cpu", random_samples: int = 0, bin_samples: int = 0,
                    sample_rate: float = 0.125, seed: int = 0) -> LayerState:
    def side(largest: bool, k: int = top_k) -> Side:
        return Side.empty(k, d_ff, context_width, largest=largest, device=device)

    state = LayerState(
        top=side(True), bottom=side(False), count=0,
        total=torch.zeros(2, d_ff, dtype=torch.float64, device=device),
        total_sq=torch.zeros(2, d_ff, dtype=torch.float64, device=device),
        positive=torch.zeros(d_ff, dtype=torch.int64, device=device),
        histogram=torch.zeros(d_ff, HIST_BINS, dtype=torch.int64, device=device),
    )
    if per_document:
        state.doc_top, state.doc_bottom = side(True), side(False)
    if random_samples:
        state.random = RandomSample.empty(random_samples, d_ff, context_width, device, seed=seed)
    if bin_samples:
        state.bins = BinSample.empty(bin_samples, d_ff, device, seed=seed, rate=sample_rate)
    return state


def _two_sum_into(acc: Tensor, value: Tensor) -> None:
    """acc [2, F] (hi, lo) += value [F] float64, error-free (Knuth's TwoSum)."""
    hi = acc[0] + value
    bp = hi - acc[0]
    err = (acc[0] - (hi - bp)) + (value - bp)
    acc[0] = hi
    acc[1] += err


def _add_double_double(a: Tensor, b: Tensor) -> Tensor:
    out = a.clone()
    _two_sum_into(out, b[0])
    out[1] += b[1]
    # renormalise so equal sums have equal representations whatever the order
    _renormalise(out)
    return out


def _renormalise(acc: Tensor) -> None:
    hi = acc[0] + acc[1]
    acc[1] = acc[1] - (hi - acc[0])
    acc[0] = hi


_BLOCK = 32  # rows summed in float32 before the float64 accumulation


def _column_sum(values: Tensor) -> Tensor:
    """Σ over rows of values [N, F] -> [F] float64: float32 over blocks of 32 rows, then float64.

    A block's float32 sum errs by at most ~32·2⁻²⁴ of Σ|m| in the worst case (measured 2e-8 on
    SmolLM2's coefficients), well under a float32 coefficient's own precision, and costs a tenth of
    a float64 sum of every value. Deterministic for a given batch.
    """
    n, width = values.shape
    full = n - n % _BLOCK
    total = values[:full].view(-1, _BLOCK, width).sum(dim=1).sum(dim=0, dtype=torch.float64)
    return total + values[full:].sum(dim=0, dtype=torch.float64) if full < n else total


@torch.inference_mode()  # no autograd; pools written in and out of the forward alike
def update(state: LayerState, acts: Tensor, codes: Tensor, context_fn: ContextFn, *, docs: Tensor | None = None,
           keys: Tensor | None = None, ordered: bool = True) -> None:
    """Fold one batch of coefficients into the state.

    acts [N, F] float32, the scored positions in reading order; codes [N] int64; ``ordered``:
    codes increase along the batch and exceed every code folded in before (the fast path);
    context_fn gives each candidate's context coefficients; docs [N] document indices (each
    document's rows contiguous and in position order; needed only with per_document); keys [N]
    the positions' sampling keys (:func:`kvmem.scanning.sampling.position_keys`; needed only
    with samples).
    """
    if acts.shape[0] == 0:
        return
    acts = acts.float()
    low, high = _block_extremes(acts)
    _stream_side(state.top, acts, codes, context_fn, ordered, high)
    _stream_side(state.bottom, acts, codes, context_fn, ordered, low)

    state.count += acts.shape[0]
    _two_sum_into(state.total, _column_sum(acts))
    _two_sum_into(state.total_sq, _column_sum(torch.mul(acts, acts, out=_scratch(acts.shape, torch.float32, acts.device))))
    _renormalise(state.total)
    _renormalise(state.total_sq)
    state.positive += histogram_update(state.histogram, acts, _scratch(acts.shape, torch.int32, acts.device).view(-1))

    if state.doc_top is not None:
        _update_per_document(state, acts, codes, docs, context_fn, ordered)
    if state.random is not None:
        state.random.update(acts, codes, keys, context_fn)
    if state.bins is not None:
        state.bins.update(acts, codes, keys)


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


_ROWS = 32  # rows per block of the candidate search's block extremes


def _block_extremes(acts: Tensor) -> tuple[Tensor, Tensor]:
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


def _stream_side(side: Side, acts: Tensor, codes: Tensor, context_fn: ContextFn, ordered: bool = True,
                 extremes: Tensor | None = None) -> None:
    """Insert the positions that beat the side's current k-th value (sparse: few do after a while);
    unless ``ordered``, also those that tie it with a lower code. ``extremes``: the batch's
    block maxima (top) or minima (bottom) from :func:`_block_extremes`."""
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
            low, high = _block_extremes(acts)
            extremes = high if side.largest else low
        rows, neurons, values = _candidates(side, acts, codes, extremes, ordered)
    _fold(side, rows, neurons, values, codes.index_select(0, rows), context_fn, ordered)


def _fold(side: Side, rows: Tensor, neurons: Tensor, values: Tensor, codes: Tensor, context_of: ContextFn,
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


def _fold_entries(side: Side, values: Tensor, codes: Tensor, context_of: ContextFn, ordered: bool) -> None:
    """Insert a few entries per neuron: values, codes [m, F] (m small: one per document);
    ``context_of(entries, neurons)`` gives the context [c, C] of entries (row indices into the m)
    for those neurons. Only entries that beat (or, by a lower code, tie) the side's k-th are
    touched, and only their context is read."""
    threshold, tie = side.threshold(), side.tie_codes()
    beats = values > threshold if side.largest else values < threshold
    neurons, rows = (beats | ((values == threshold) & (codes < tie))).T.nonzero(as_tuple=True)
    _fold(side, rows, neurons, values[rows, neurons], codes[rows, neurons], context_of, ordered)


class _Documents:
    """A batch's documents (rows starts[s] .. starts[s] + lengths[s] - 1 of acts [N, F], in order)
    gathered into one padded block [S, longest, F] (length-sorted batches keep the padding small),
    so that each document's extremes cost one reduction, not scatters over N × F."""

    def __init__(self, acts: Tensor, starts: Tensor, lengths: Tensor):
        self.starts, self.lengths, self.longest = starts, lengths, int(lengths.max())
        self.offsets = torch.arange(self.longest, device=acts.device)
        self.padding = self.offsets[None, :] >= lengths[:, None]  # [S, longest]
        rows = (starts[:, None] + self.offsets[None, :]).masked_fill_(self.padding, 0)
        self.block = acts.index_select(0, rows.view(-1)).view(*rows.shape, acts.shape[1])
        self.padded_rows = self.padding.view(-1).nonzero().squeeze(1)  # rows of block.view(-1, F)

    def best(self, largest: bool) -> Tensor:
        """Each document's largest (or smallest) value per neuron [S, F]."""
        if self.padded_rows.numel():
            fill = float("-inf") if largest else float("inf")
            self.block.view(-1, self.block.shape[2]).index_fill_(0, self.padded_rows, fill)
        return self.block.amax(dim=1) if largest else self.block.amin(dim=1)

    def first_row(self, documents: Tensor, neurons: Tensor, values: Tensor) -> Tensor:
        """The first row of acts where document documents[i] holds values[i] for neuron neurons[i] -> [c]
        (the document's first row when none does: a value carried over from an earlier batch)."""
        d_ff = self.block.shape[2]
        flat = (documents[:, None] * self.longest + self.offsets[None, :]) * d_ff + neurons[:, None]  # [c, longest]
        found = self.block.view(-1).index_select(0, flat.view(-1)).view(flat.shape) == values[:, None]
        found &= ~self.padding.index_select(0, documents)
        return self.starts.index_select(0, documents) + found.to(torch.uint8).argmax(dim=1)  # argmax: the first


def _update_per_document(state: LayerState, acts: Tensor, codes: Tensor, docs: Tensor, context_fn: ContextFn,
                         ordered: bool = True) -> None:
    """Fold each document's best position into doc_top / doc_bottom; the batch's last document
    stays open (its best so far in open_top / open_bottom) in case the next batch continues it.
    A document's best is its most extreme value, at its first position holding it; the context is
    read only for the documents that enter the kept ones, and for the open one."""
    unique_docs, lengths = torch.unique_consecutive(docs, return_counts=True)
    documents = _Documents(acts, lengths.cumsum(0) - lengths, lengths)
    continues = state.open_doc == int(unique_docs[0])
    if not continues and state.open_doc != EMPTY:  # the open document ended with the previous batch
        close_open_document(state)
    state.open_top = _fold_documents(state.doc_top, state.open_top if continues else None, documents, codes,
                                     context_fn, ordered)
    state.open_bottom = _fold_documents(state.doc_bottom, state.open_bottom if continues else None, documents,
                                        codes, context_fn, ordered)
    state.open_doc = int(unique_docs[-1])


def _fold_documents(side: Side, open_side: Side | None, documents: _Documents, codes: Tensor, context_fn: ContextFn,
                    ordered: bool) -> Side:
    """Fold the complete documents' bests into ``side``; ``open_side``: the best so far of the
    batch's first document when it continues from the previous batch. -> the last document's best (k = 1)."""
    largest = side.largest
    values = documents.best(largest)  # [n, F]
    n, d_ff = values.shape
    earlier = None  # [F]: the open document's earlier best stays (it wins ties: lower code)
    if open_side is not None:
        earlier = ~(values[0] > open_side.values[0] if largest else values[0] < open_side.values[0])
        values[0] = torch.where(earlier, open_side.values[0], values[0])

    def rows_and_codes(doc: Tensor, neuron: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Rows [c] and codes [c] of documents doc's best for neurons neuron, and which of them the
        open document's earlier best holds (None when none continues)."""
        rows = documents.first_row(doc, neuron, values[doc, neuron])
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

    if n > 1:  # every document but the last is complete: fold those that enter
        complete = values[:-1]
        threshold = side.threshold()
        beats = complete > threshold if largest else complete < threshold
        k = side.values.shape[0]
        if n - 1 > k and bool(torch.isinf(threshold).any()):  # not yet full: no more than this batch's k best enter
            kth = torch.topk(complete, k, dim=0, largest=largest, sorted=False).values
            beats &= (complete >= kth.amin(0)) if largest else (complete <= kth.amax(0))
        neuron, doc = (beats | (complete == threshold)).T.nonzero(as_tuple=True)  # neuron-major
        if neuron.numel():
            rows, entry_codes, from_earlier = rows_and_codes(doc, neuron)
            enter = beats[doc, neuron] | (entry_codes < side.tie_codes().index_select(0, neuron))  # tie: lower code
            if not bool(enter.all()):
                doc, neuron, rows, entry_codes = doc[enter], neuron[enter], rows[enter], entry_codes[enter]
                from_earlier = from_earlier[enter] if from_earlier is not None else None
            context = context_of(rows, neuron, from_earlier)
            _fold(side, doc, neuron, values[doc, neuron], entry_codes, lambda r, x: context, ordered)
    neurons = torch.arange(d_ff, device=values.device)
    rows, open_codes, from_earlier = rows_and_codes(torch.full_like(neurons, n - 1), neurons)
    return Side(values[-1:], open_codes[None], context_of(rows, neurons, from_earlier)[None], largest)


@torch.inference_mode()  # no autograd; pools written in and out of the forward alike
def close_open_document(state: LayerState) -> None:
    """Move the open document's best into the per-document top-k (when it ends, and at the end of a stream)."""
    if state.doc_top is None or state.open_doc == EMPTY:
        return
    # the open document's code need not exceed the kept ones' (length-sorted batches): sort fully
    for side, open_side in ((state.doc_top, state.open_top), (state.doc_bottom, state.open_bottom)):
        context = open_side.context  # [1, F, C]
        _fold_entries(side, open_side.values, open_side.codes, lambda r, n, x=context: x[r, n], ordered=False)
    state.open_doc = EMPTY
    state.open_top = state.open_bottom = None


@torch.inference_mode()  # no autograd; pools written in and out of the forward alike
def merge_states(a: LayerState, b: LayerState) -> LayerState:
    """The state one stream over both inputs gives (a and b saw disjoint documents, any order).

    The one merge of kvmem: ranks under torchrun and ``kvmem merge`` of shard atlases both use it.
    """
    close_open_document(a)
    close_open_document(b)
    out = LayerState(
        top=_merge_sides(a.top, b.top), bottom=_merge_sides(a.bottom, b.bottom), count=a.count + b.count,
        total=_add_double_double(a.total, b.total), total_sq=_add_double_double(a.total_sq, b.total_sq),
        positive=a.positive + b.positive, histogram=a.histogram + b.histogram,
    )
    if a.doc_top is not None:
        out.doc_top, out.doc_bottom = _merge_sides(a.doc_top, b.doc_top), _merge_sides(a.doc_bottom, b.doc_bottom)
    if a.random is not None:
        out.random = a.random.merge(b.random)
    if a.bins is not None:
        out.bins = a.bins.merge(b.bins)
    return out
