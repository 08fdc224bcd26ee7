"""The per-document bests: each document's most extreme coefficient per neuron (at the first position
holding it), and the k best of those (the ``top_doc`` and ``bottom_doc`` triggers; Geva et al. kept
one trigger per sentence). The still-open document of a batch keeps its best so far (k = 1) until the
next batch shows whether it continues."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.scanning.ordering import EMPTY
from kvmem.scanning.reads import Pending, run_rounds, sizes
from kvmem.scanning.statistics.batch import ContextFn, Documents, LayerBatch
from kvmem.scanning.statistics.sides import (
    Side,
    fold,
    fold_entries,
    fold_sizes,
    merge_sides,
    nonzero,
    nonzero_static,
    side_from_tensors,
    side_tensors,
)
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic

__all__ = ["DocumentBests", "DocumentBestsState"]


@dataclass
class DocumentBestsState:
    """``top``, ``bottom``: the k best documents' bests [k, F]; ``open_doc``: the batch's last document
    (EMPTY when none is open), with its best so far in ``open_top`` / ``open_bottom`` (k = 1)."""

    top: Side
    bottom: Side
    open_doc: int = EMPTY
    open_top: Side | None = None
    open_bottom: Side | None = None


class DocumentBests(Statistic):
    name = "document_bests"
    needs_documents = True

    @classmethod
    def wanted(cls, config, *, gated: bool) -> bool:
        return config.per_document

    def new(self, spec: LayerSpec) -> DocumentBestsState:
        k = self.config.top_k
        return DocumentBestsState(Side.empty(k, spec.d_ff, spec.width, largest=True, device=spec.device),
                                  Side.empty(k, spec.d_ff, spec.width, largest=False, device=spec.device))

    @torch.inference_mode()
    def update(self, state: DocumentBestsState, batch: LayerBatch) -> None:
        """Fold each document's best position into the sides; the batch's last document stays open (its
        best so far in open_top / open_bottom) in case the next batch continues it."""
        layout = batch.layout
        continues = state.open_doc == layout.first_doc
        if not continues and state.open_doc != EMPTY:  # the open document ended with the previous batch
            self._close(state, batch.reads.defer)
        state.open_doc = layout.last_doc
        block = _Documents(batch.acts, layout.documents)
        opened = []
        for side, open_side in ((state.top, state.open_top if continues else None),
                                (state.bottom, state.open_bottom if continues else None)):
            last, pending = _fold_documents(side, open_side, block, batch.codes, batch.context, batch.ordered)
            batch.reads.defer(pending)
            opened.append(last)
        state.open_top, state.open_bottom = opened

    @torch.inference_mode()
    def close(self, state: DocumentBestsState) -> None:
        """Move the open document's best into the per-document top-k (at the end of a stream)."""
        self._close(state, lambda step: run_rounds([step]))

    @staticmethod
    def _close(state: DocumentBestsState, defer) -> None:
        if state.open_doc == EMPTY:
            return
        # the open document's code need not exceed the kept ones' (length-sorted batches): sort fully
        for side, open_side in ((state.top, state.open_top), (state.bottom, state.open_bottom)):
            context = open_side.context  # [1, F, C]
            defer(fold_entries(side, open_side.values, open_side.codes, lambda r, n, x=context: x[r, n], ordered=False))
        state.open_doc = EMPTY
        state.open_top = state.open_bottom = None

    @torch.inference_mode()
    def merge(self, a: DocumentBestsState, b: DocumentBestsState) -> DocumentBestsState:
        if a.open_doc != EMPTY or b.open_doc != EMPTY:
            raise ValueError("a merge needs closed states: close the per-document bests first")
        return DocumentBestsState(merge_sides(a.top, b.top), merge_sides(a.bottom, b.bottom))

    def to_tensors(self, state: DocumentBestsState, prefix: str) -> tuple[dict[str, Tensor], dict]:
        tensors = {**side_tensors(state.top, f"{prefix}.doc_top"), **side_tensors(state.bottom, f"{prefix}.doc_bottom")}
        if state.open_top is not None:
            tensors.update(side_tensors(state.open_top, f"{prefix}.open_top"))
            tensors.update(side_tensors(state.open_bottom, f"{prefix}.open_bottom"))
        return tensors, {"open_doc": state.open_doc}

    def from_tensors(self, prefix: str, tensors: dict[str, Tensor], meta: dict) -> DocumentBestsState:
        state = DocumentBestsState(side_from_tensors(f"{prefix}.doc_top", tensors, largest=True),
                                   side_from_tensors(f"{prefix}.doc_bottom", tensors, largest=False),
                                   int(meta["open_doc"]))
        if f"{prefix}.open_top.values" in tensors:
            state.open_top = side_from_tensors(f"{prefix}.open_top", tensors, largest=True)
            state.open_bottom = side_from_tensors(f"{prefix}.open_bottom", tensors, largest=False)
        return state

    def sides(self, state: DocumentBestsState) -> dict[str, Side]:
        return {"top_doc": state.top, "bottom_doc": state.bottom}

    def codes(self, state: DocumentBestsState, *, open_documents: bool = False) -> list[Tensor]:
        parts = [state.top.codes, state.bottom.codes]
        if open_documents and state.open_top is not None:
            parts += [state.open_top.codes, state.open_bottom.codes]
        return parts


class _Documents:
    """A batch's documents (:class:`~kvmem.scanning.statistics.batch.Documents`) read from acts [N, F]
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
        neuron, doc = nonzero_static(maybe.T, pairs).unbind(1)  # neuron-major
        rows, entry_codes, from_earlier = rows_and_codes(doc, neuron, documents.documents.longest_complete)
        enter = beats[doc, neuron] | (entry_codes < side.tie_codes().index_select(0, neuron))  # tie: lower code
        per_neuron = torch.zeros(d_ff, dtype=torch.int64, device=values.device).index_add_(0, neuron, enter.long())
        count, width, depth = yield fold_sizes(per_neuron)
        if count == 0:
            return
        if count < pairs:
            keep = nonzero(enter, count)
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

