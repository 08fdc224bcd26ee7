"""Streaming, mergeable per-neuron state: top-k / bottom-k triggers with their context
coefficients, exact moments and histograms.

Memory is O(layers · d_ff · top_k · context); no tensor of shape (all tokens × d_ff) is ever held.
Positions are int64 codes (``kvmem.plan.pack``: doc << 32 | pos); -1 marks an empty entry.

The top and bottom triggers (and, per document, each document's best) are
:class:`kvmem.scanning.sides.Side` objects, under one tie rule: most extreme first, then the
lowest code; :func:`merge_states` merges them under the same rule.

Sums are kept as double-double (``hi + lo``) so that merging the states of several processes gives
the same float64 totals, to the last bit, as one process adding the same batches in order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from kvmem.scanning.histogram import HIST_BINS
from kvmem.scanning.kernels import batch_statistics
from kvmem.scanning.kernels import fold_documents as compiled_fold_documents
from kvmem.scanning.kernels import stream_side as compiled_stream_side
from kvmem.scanning.sampling import BinSample, RandomSample
from kvmem.scanning.sides import (
    EMPTY,
    ContextFn,
    Side,
    fold,
    fold_entries,
    merge_sides,
    stream_side,
    window_context,
)

__all__ = ["Side", "LayerState", "new_layer_state", "update", "merge_states", "close_open_document", "EMPTY",
           "ContextFn", "window_context"]

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
    statistics = batch_statistics(acts, state.histogram, state.positive)  # one read of the batch
    for side, extremes in ((state.top, statistics.high), (state.bottom, statistics.low)):
        if not compiled_stream_side(side, acts, codes, context_fn, ordered, extremes):  # not on a CPU: torch
            stream_side(side, acts, codes, context_fn, ordered, extremes)

    state.count += acts.shape[0]
    _two_sum_into(state.total, statistics.total)
    _two_sum_into(state.total_sq, statistics.total_sq)
    _renormalise(state.total)
    _renormalise(state.total_sq)

    if state.doc_top is not None:
        _update_per_document(state, acts, codes, docs, context_fn, ordered)
    if state.random is not None:
        state.random.update(acts, codes, keys, context_fn)
    if state.bins is not None:
        state.bins.update(acts, codes, keys)


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
    starts = lengths.cumsum(0) - lengths
    continues = state.open_doc == int(unique_docs[0])
    if not continues and state.open_doc != EMPTY:  # the open document ended with the previous batch
        close_open_document(state)
    state.open_doc = int(unique_docs[-1])
    open_top = compiled_fold_documents(state.doc_top, state.open_top if continues else None, acts, codes, starts,
                                       lengths, context_fn, ordered)
    if open_top is not None:  # the compiled kernels (a CPU)
        state.open_top = open_top
        state.open_bottom = compiled_fold_documents(state.doc_bottom, state.open_bottom if continues else None, acts,
                                                    codes, starts, lengths, context_fn, ordered)
        return
    documents = _Documents(acts, starts, lengths)
    state.open_top = _fold_documents(state.doc_top, state.open_top if continues else None, documents, codes,
                                     context_fn, ordered)
    state.open_bottom = _fold_documents(state.doc_bottom, state.open_bottom if continues else None, documents,
                                        codes, context_fn, ordered)


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
            fold(side, doc, neuron, values[doc, neuron], entry_codes, lambda r, x: context, ordered)
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
        fold_entries(side, open_side.values, open_side.codes, lambda r, n, x=context: x[r, n], ordered=False)
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
        top=merge_sides(a.top, b.top), bottom=merge_sides(a.bottom, b.bottom), count=a.count + b.count,
        total=_add_double_double(a.total, b.total), total_sq=_add_double_double(a.total_sq, b.total_sq),
        positive=a.positive + b.positive, histogram=a.histogram + b.histogram,
    )
    if a.doc_top is not None:
        out.doc_top, out.doc_bottom = merge_sides(a.doc_top, b.doc_top), merge_sides(a.doc_bottom, b.doc_bottom)
    if a.random is not None:
        out.random = a.random.merge(b.random)
    if a.bins is not None:
        out.bins = a.bins.merge(b.bins)
    return out
