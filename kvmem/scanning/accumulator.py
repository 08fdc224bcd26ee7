"""Streaming, mergeable per-neuron state: top-k / bottom-k triggers, moments, histograms.

Memory is O(layers · d_ff · top_k); no tensor of shape (all tokens × d_ff) is ever held.
Positions are packed into one int64 "code" = doc << 32 | pos (doc = index of the document
in the corpus stream, pos = token position in the document); -1 marks an empty slot.

Ties: among equal coefficients the kept set is whichever torch.topk returns; the final
order is (coefficient, then code ascending), see :func:`ordered`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.scanning.histogram import HIST_BINS, histogram_update

__all__ = ["LayerState", "new_layer_state", "update", "merge_states", "ordered", "pack", "unpack"]

EMPTY = -1


def pack(doc: Tensor, pos: Tensor) -> Tensor:
    return (doc.to(torch.int64) << 32) | pos.to(torch.int64)


def unpack(code: Tensor) -> tuple[Tensor, Tensor]:
    return code >> 32, code & 0xFFFFFFFF


@dataclass
class LayerState:
    """Running state of one layer. Shapes: k = top_k, F = d_ff, B = HIST_BINS."""

    top_values: Tensor  # [k, F] float32, -inf where empty
    top_codes: Tensor  # [k, F] int64
    bottom_values: Tensor  # [k, F] float32, +inf where empty
    bottom_codes: Tensor  # [k, F] int64
    count: int  # positions seen (the same for every neuron)
    total: Tensor  # [F] float64, Σ m
    total_sq: Tensor  # [F] float64, Σ m²
    positive: Tensor  # [F] int64, #{m > 0}
    histogram: Tensor  # [F, B] int64
    # one trigger per document (None unless per_document)
    doc_top_values: Tensor | None = None  # [k, F]
    doc_top_codes: Tensor | None = None
    doc_bottom_values: Tensor | None = None
    doc_bottom_codes: Tensor | None = None
    # the running best of the document still being read (it may continue in the next batch)
    open_doc: int = EMPTY
    open_top_values: Tensor | None = None  # [F]
    open_top_codes: Tensor | None = None
    open_bottom_values: Tensor | None = None
    open_bottom_codes: Tensor | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> LayerState:
        return cls(**data)


def new_layer_state(d_ff: int, top_k: int, *, per_document: bool, device: str | torch.device = "cpu") -> LayerState:
    def filled(value: float) -> Tensor:
        return torch.full((top_k, d_ff), value, dtype=torch.float32, device=device)

    def codes(rows: int = top_k) -> Tensor:
        return torch.full((rows, d_ff), EMPTY, dtype=torch.int64, device=device)

    state = LayerState(
        top_values=filled(float("-inf")), top_codes=codes(),
        bottom_values=filled(float("inf")), bottom_codes=codes(),
        count=0,
        total=torch.zeros(d_ff, dtype=torch.float64, device=device),
        total_sq=torch.zeros(d_ff, dtype=torch.float64, device=device),
        positive=torch.zeros(d_ff, dtype=torch.int64, device=device),
        histogram=torch.zeros(d_ff, HIST_BINS, dtype=torch.int64, device=device),
    )
    if per_document:
        state.doc_top_values, state.doc_top_codes = filled(float("-inf")), codes()
        state.doc_bottom_values, state.doc_bottom_codes = filled(float("inf")), codes()
    return state


def _merge_topk(values: Tensor, codes: Tensor, new_values: Tensor, new_codes: Tensor, *, largest: bool):
    """Keep the k most extreme of [values; new_values] per column. values [k, F], new [m, F]."""
    k = values.shape[0]
    all_values = torch.cat([values, new_values])
    all_codes = torch.cat([codes, new_codes])
    kept_values, where = torch.topk(all_values, k, dim=0, largest=largest, sorted=False)
    return kept_values, torch.gather(all_codes, 0, where)


def _batch_topk(acts_t: Tensor, codes: Tensor, k: int, *, largest: bool) -> tuple[Tensor, Tensor]:
    """acts_t [F, N] (neuron-major), codes [N] -> values, codes [min(k, N), F]."""
    k = min(k, acts_t.shape[1])
    values, where = torch.topk(acts_t, k, dim=1, largest=largest, sorted=False)
    return values.T, codes[where].T


def update(state: LayerState, acts: Tensor, codes: Tensor, docs: Tensor | None = None,
           neuron_offsets: Tensor | None = None) -> None:
    """Fold one batch of coefficients into the state.

    acts [N, F] float32 (only real, scored positions); codes [N] int64 packed (doc, pos);
    docs [N] int64 document indices, non-decreasing (needed only with per_document);
    neuron_offsets [F] int32 = arange(F) * HIST_BINS (cached by the caller).
    """
    if acts.shape[0] == 0:
        return
    acts = acts.float()
    acts_t = acts.T.contiguous()  # [F, N]: top-k along the contiguous dimension is faster
    k = state.top_values.shape[0]
    top_values, top_codes = _batch_topk(acts_t, codes, k, largest=True)
    state.top_values, state.top_codes = _merge_topk(state.top_values, state.top_codes, top_values, top_codes, largest=True)
    bottom_values, bottom_codes = _batch_topk(acts_t, codes, k, largest=False)
    state.bottom_values, state.bottom_codes = _merge_topk(
        state.bottom_values, state.bottom_codes, bottom_values, bottom_codes, largest=False)

    state.count += acts.shape[0]
    state.total += acts_t.sum(dim=1, dtype=torch.float64)
    state.total_sq += (acts_t * acts_t).sum(dim=1, dtype=torch.float64)
    state.positive += (acts_t > 0).sum(dim=1, dtype=torch.int64)
    if neuron_offsets is None:
        neuron_offsets = torch.arange(acts.shape[1], dtype=torch.int32, device=acts.device) * HIST_BINS
    histogram_update(state.histogram, acts_t, neuron_offsets)

    if state.doc_top_values is not None:
        _update_per_document(state, acts, codes, docs)


def _segment_best(acts: Tensor, codes: Tensor, segment: Tensor, n_segments: int, *, largest: bool):
    """Per segment (document) and neuron: the most extreme value and its earliest code. -> [S, F] each."""
    F = acts.shape[1]
    fill = float("-inf") if largest else float("inf")
    index = segment.view(-1, 1).expand(-1, F)
    best = torch.full((n_segments, F), fill, dtype=acts.dtype, device=acts.device)
    best.scatter_reduce_(0, index, acts, reduce="amax" if largest else "amin", include_self=True)
    is_best = acts == best.gather(0, index)
    big = torch.iinfo(torch.int64).max
    candidate = torch.where(is_best, codes.view(-1, 1).expand(-1, F), torch.full_like(index, big))
    best_codes = torch.full((n_segments, F), big, dtype=torch.int64, device=acts.device)
    best_codes.scatter_reduce_(0, index, candidate, reduce="amin", include_self=True)
    return best, best_codes


def _update_per_document(state: LayerState, acts: Tensor, codes: Tensor, docs: Tensor) -> None:
    unique_docs, segment = torch.unique_consecutive(docs, return_inverse=True)
    n = unique_docs.shape[0]
    tops, top_codes = _segment_best(acts, codes, segment, n, largest=True)
    bottoms, bottom_codes = _segment_best(acts, codes, segment, n, largest=False)
    first_doc = int(unique_docs[0])
    if state.open_doc == first_doc:  # the open document continues: fold its running best into segment 0
        take = state.open_top_values > tops[0]
        tops[0] = torch.where(take, state.open_top_values, tops[0])
        top_codes[0] = torch.where(take, state.open_top_codes, top_codes[0])
        take = state.open_bottom_values < bottoms[0]
        bottoms[0] = torch.where(take, state.open_bottom_values, bottoms[0])
        bottom_codes[0] = torch.where(take, state.open_bottom_codes, bottom_codes[0])
    elif state.open_doc != EMPTY:  # the open document ended with the previous batch
        close_open_document(state)
    # every document but the last is complete
    if n > 1:
        state.doc_top_values, state.doc_top_codes = _merge_topk(
            state.doc_top_values, state.doc_top_codes, tops[:-1], top_codes[:-1], largest=True)
        state.doc_bottom_values, state.doc_bottom_codes = _merge_topk(
            state.doc_bottom_values, state.doc_bottom_codes, bottoms[:-1], bottom_codes[:-1], largest=False)
    state.open_doc = int(unique_docs[-1])
    state.open_top_values, state.open_top_codes = tops[-1], top_codes[-1]
    state.open_bottom_values, state.open_bottom_codes = bottoms[-1], bottom_codes[-1]


def close_open_document(state: LayerState) -> None:
    """Move the open document's best into the per-document top-k (at the end of a scan)."""
    if state.doc_top_values is None or state.open_doc == EMPTY:
        return
    state.doc_top_values, state.doc_top_codes = _merge_topk(
        state.doc_top_values, state.doc_top_codes, state.open_top_values[None], state.open_top_codes[None], largest=True)
    state.doc_bottom_values, state.doc_bottom_codes = _merge_topk(
        state.doc_bottom_values, state.doc_bottom_codes, state.open_bottom_values[None],
        state.open_bottom_codes[None], largest=False)
    state.open_doc = EMPTY
    state.open_top_values = state.open_top_codes = state.open_bottom_values = state.open_bottom_codes = None


def merge_states(a: LayerState, b: LayerState) -> LayerState:
    """The state one scan over both inputs would have (a and b see disjoint documents)."""
    close_open_document(a)
    close_open_document(b)
    out = LayerState(
        *_merge_topk(a.top_values, a.top_codes, b.top_values, b.top_codes, largest=True),
        *_merge_topk(a.bottom_values, a.bottom_codes, b.bottom_values, b.bottom_codes, largest=False),
        count=a.count + b.count,
        total=a.total + b.total,
        total_sq=a.total_sq + b.total_sq,
        positive=a.positive + b.positive,
        histogram=a.histogram + b.histogram,
    )
    if a.doc_top_values is not None:
        out.doc_top_values, out.doc_top_codes = _merge_topk(
            a.doc_top_values, a.doc_top_codes, b.doc_top_values, b.doc_top_codes, largest=True)
        out.doc_bottom_values, out.doc_bottom_codes = _merge_topk(
            a.doc_bottom_values, a.doc_bottom_codes, b.doc_bottom_values, b.doc_bottom_codes, largest=False)
    return out


def ordered(values: Tensor, codes: Tensor, *, largest: bool) -> tuple[Tensor, Tensor]:
    """Sort kept triggers per neuron: most extreme first, ties by code ascending. [k, F] -> [k, F]."""
    by_code = torch.argsort(codes, dim=0, stable=True)
    values, codes = values.gather(0, by_code), codes.gather(0, by_code)
    by_value = torch.argsort(values, dim=0, descending=largest, stable=True)
    return values.gather(0, by_value), codes.gather(0, by_value)
