"""One batch into the scan's state: the per-batch logic every backend shares.

:class:`BatchRows` lays a batch of windows out as the model's input and the flat list of its
scored positions (codes, documents, window bounds, sampling keys); :class:`BatchStep` folds each
layer's coefficients into that layer's :class:`~kvmem.scanning.state.LayerState` with the scan's
backend (:func:`fold_batch`), and :meth:`BatchStep.finish` applies the non-finite rule.

**Non-finite coefficients are refused.** A coefficient that is NaN or ±inf (a float16 overflow)
stops the scan with one line that names the layer and the batch and suggests float32 or
bfloat16; nothing is written. Both backends apply the rule the same way: a batch's Σm [F], which
each backend computes anyway, is finite exactly when every coefficient is (finite float32
values cannot overflow a float64 sum; the torch backend's float32 blocks of 32 rows overflow only
past |m| ~ 1e37). The flags of all layers are read back once per batch, after the forward, so the
check costs one host synchronisation per batch, not one per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvmem.errors import KvmemError
from kvmem.plan import Batch, TokenPlan, pack
from kvmem.scanning.backends import Backend, ContextFn, Documents
from kvmem.scanning.backends.base import to_device
from kvmem.scanning.capture import GATE_UP_SITES
from kvmem.scanning.reads import Pending, sizes
from kvmem.scanning.rules import EMPTY, position_keys
from kvmem.scanning.state import LayerState, ScanState, add_into

__all__ = ["BatchRows", "BatchLayout", "BatchStep", "Positions", "fold_batch", "close_open_document"]


class Positions(NamedTuple):
    """Each scored position's place in its window, ``index`` [N] float32 (0 = the window's first token,
    read or not; exact integers), and Σ index, Σ index² over the batch (Python integers)."""

    index: Tensor
    total: int
    total_sq: int

    @classmethod
    def of(cls, lengths: list[int], device, leads: list[int] | None = None) -> Positions:
        """The scored positions of windows of ``lengths`` tokens whose first ``leads`` are not scored, laid
        out one after the other."""
        leads = leads or [0] * len(lengths)
        index = (torch.cat([torch.arange(s, n, dtype=torch.float32) for n, s in zip(lengths, leads)]) if lengths
                 else torch.empty(0))

        def sums(n: int) -> tuple[int, int]:  # Σ p and Σ p² over p = 0..n-1
            return n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6

        total = sum(sums(n)[0] - sums(s)[0] for n, s in zip(lengths, leads))
        total_sq = sum(sums(n)[1] - sums(s)[1] for n, s in zip(lengths, leads))
        return cls(index.to(device), total, total_sq)


class BatchLayout(NamedTuple):
    """What every layer of one batch shares, read from the device once (before the forward):

    ``first_doc``, ``last_doc``: the documents of its first and last rows; ``documents``: each
    document's rows (per-document sides; None without them); ``ranked`` [p]: the rows with the p
    smallest sampling keys, by (key, code), with their ``ranked_keys`` and ``ranked_codes`` [p], where
    the first ``thinned`` are the positions the bin samples draw from (key < limit) and the first
    ``random`` the only ones that can enter a random sample of that size."""

    first_doc: int
    last_doc: int
    documents: Documents | None
    ranked: Tensor | None
    ranked_keys: Tensor | None
    ranked_codes: Tensor | None
    thinned: int
    random: int

    @classmethod
    def read(cls, state: LayerState, codes: Tensor, docs: Tensor | None, keys: Tensor | None) -> BatchLayout:
        """The layout of a batch for layers whose states look like ``state`` (one device-to-host read)."""
        per_document = state.doc_top is not None
        samples = (state.random is not None and state.random.values.shape[0] > 0) or (
            state.bins is not None and state.bins.codes.shape[2] > 0)
        if per_document and docs is None:
            raise ValueError("this state keeps per-document sides: fold_batch needs the batch's documents (docs)")
        if samples and keys is None:
            raise ValueError("this state keeps samples: fold_batch needs the positions' sampling keys (keys)")
        wanted = ([docs] if per_document else []) + ([keys, codes] if samples else [])
        host = torch.stack(wanted).cpu().numpy() if wanted else None  # the batch's one read
        documents, first_doc, last_doc = None, EMPTY, EMPTY
        if per_document:
            doc = host[0]
            ends = np.flatnonzero(doc[1:] != doc[:-1]) + 1
            documents = Documents.of(np.diff(np.concatenate([[0], ends, [doc.size]])), codes.device)
            first_doc, last_doc = int(doc[0]), int(doc[-1])
        ranked = ranked_keys = ranked_codes = None
        thinned = random = 0
        if samples:
            host_keys, host_codes = host[-2], host[-1]
            order = np.lexsort((host_codes, host_keys))  # by key, then code (every code here is a position's)
            if state.bins is not None and state.bins.codes.shape[2] > 0:
                thinned = int(np.searchsorted(host_keys[order], state.bins.limit(), side="left"))
            if state.random is not None:
                random = min(state.random.values.shape[0], order.size)
            ranked = to_device(order[:max(thinned, random)], codes.device)
            ranked_keys, ranked_codes = keys.index_select(0, ranked), codes.index_select(0, ranked)
        return cls(first_doc, last_doc, documents, ranked, ranked_keys, ranked_codes, thinned, random)


@torch.inference_mode()  # no autograd; pools written in and out of the forward alike
def fold_batch(backend: Backend, state: LayerState, acts: Tensor, codes: Tensor, context_fn: ContextFn, *,
               docs: Tensor | None = None, keys: Tensor | None = None, ordered: bool = True,
               positions: Positions | None = None, gate_up: tuple[Tensor, Tensor] | None = None,
               layout: BatchLayout | None = None) -> bool | None:
    """Fold one batch of one layer's coefficients into its state -> whether every coefficient was
    finite (None for an empty batch), read with the layer's other reads; the caller applies the rule
    (:meth:`BatchStep.finish`).

    acts [N, F], the scored positions in reading order; codes [N] int64; ``ordered``: codes
    increase along the batch and exceed every code folded in before (the fast path); context_fn
    gives each candidate's context coefficients; docs [N] document indices (each document's rows
    contiguous and in position order; needed only with per_document); keys [N] the positions'
    sampling keys (:func:`kvmem.scanning.rules.position_keys`; needed only with samples).
    ``positions``: each row's place in its window (needed only with the state's position sums);
    ``gate_up``: the gate and up pre-activations [N, F] (needed only with its quadrant counts).
    With quadrants, ``context_fn`` must end each context row with the entry's gate and up.
    ``layout``: the batch's :class:`BatchLayout` (read here when not given).
    """
    if acts.shape[0] == 0:
        return None
    acts = acts.float()
    if layout is None:
        layout = BatchLayout.read(state, codes, docs, keys)
    finite: list[bool] = []
    with backend.reads.collecting():  # the layer's reads, two rounds with the torch backend
        if state.position_product is not None:
            if positions is None:
                raise ValueError("this state keeps position sums: fold_batch needs the batch's positions")
            add_into(state.position_product, backend.position_product(acts, positions.index))
            state.position_total += positions.total
            state.position_sq_total += positions.total_sq
        if state.quadrants is not None:
            if gate_up is None:
                raise ValueError("this state keeps gate/up quadrant counts: fold_batch needs the pre-activations")
            backend.quadrant_counts(state.quadrants, *gate_up)
        statistics = backend.statistics(acts, state.histogram, state.positive)  # one read of the batch
        for side, extremes in ((state.top, statistics.high), (state.bottom, statistics.low)):
            side.full = side.full or state.count >= side.values.shape[0]  # k finite values seen: all k held
            backend.stream_side(side, acts, codes, context_fn, ordered, extremes)
        state.count += acts.shape[0]
        add_into(state.total, statistics.total)
        add_into(state.total_sq, statistics.total_sq)
        if state.doc_top is not None:
            _fold_documents(backend, state, acts, codes, layout, context_fn, ordered)
        if layout.random:
            rows = layout.ranked[:layout.random]
            backend.random_sample(state.random, acts, rows, layout.ranked_keys[:layout.random],
                                  layout.ranked_codes[:layout.random], context_fn)
        if layout.thinned:
            backend.bin_sample(state.bins, acts, layout.ranked[:layout.thinned], layout.ranked_keys[:layout.thinned],
                               layout.ranked_codes[:layout.thinned])
        backend.reads.defer(_read_flag(torch.isfinite(statistics.total).all(), finite))
    return finite[0]


def _read_flag(flag: Tensor, into: list) -> Pending:
    (value,) = yield sizes(flag)
    into.append(bool(value))


def _fold_documents(backend: Backend, state: LayerState, acts: Tensor, codes: Tensor, layout: BatchLayout,
                    context_fn: ContextFn, ordered: bool) -> None:
    """Fold each document's best position into doc_top / doc_bottom; the batch's last document
    stays open (its best so far in open_top / open_bottom) in case the next batch continues it."""
    continues = state.open_doc == layout.first_doc
    if not continues and state.open_doc != EMPTY:  # the open document ended with the previous batch
        close_open_document(backend, state)
    state.open_doc = layout.last_doc
    pairs = [(state.doc_top, state.open_top if continues else None),
             (state.doc_bottom, state.open_bottom if continues else None)]
    state.open_top, state.open_bottom = backend.fold_documents(pairs, acts, codes, layout.documents, context_fn,
                                                               ordered)


@torch.inference_mode()
def close_open_document(backend: Backend, state: LayerState) -> None:
    """Move the open document's best into the per-document top-k (when it ends, and at the end of a stream)."""
    if state.doc_top is None or state.open_doc == EMPTY:
        return
    # the open document's code need not exceed the kept ones' (length-sorted batches): sort fully
    for side, open_side in ((state.doc_top, state.open_top), (state.doc_bottom, state.open_bottom)):
        context = open_side.context  # [1, F, C]
        backend.fold_entries(side, open_side.values, open_side.codes, lambda r, n, x=context: x[r, n], ordered=False)
    state.open_doc = EMPTY
    state.open_top = state.open_bottom = None


@dataclass
class BatchRows:
    """A batch laid out for one forward: ``ids`` [B, P] the model's input (windows right-padded,
    padding id 0 is never scored), and per scored position, in reading order (N of them):
    ``flat`` [N] its index in ids.view(-1), ``codes`` [N], ``docs`` [N] (each document's rows
    contiguous), ``low``/``high`` [N] the flat rows bounding its window, ``keys`` [N] sampling keys
    (None without samples); ``steps`` [C] the context offsets around a trigger; ``tokens`` [N] int64
    (CPU) the token at each position; ``positions`` each position's place in its window."""

    batch: Batch
    ids: Tensor
    flat: Tensor
    codes: Tensor
    docs: Tensor
    low: Tensor
    high: Tensor
    keys: Tensor | None
    steps: Tensor
    tokens: Tensor
    positions: Positions

    @classmethod
    def build(cls, batch: Batch, plan: TokenPlan, *, context_before: int, context_after: int, seed: int,
              samples: bool, device) -> BatchRows:
        offset = plan.offset
        lengths = [len(w.tokens) for w in batch.windows]
        leads = [min(plan.skip_first, n) for n in lengths]  # tokens of each window read, not scored
        width = max(lengths) + offset
        ids = torch.zeros((len(batch.windows), width), dtype=torch.int64)  # [batch, pos]
        for row, w in enumerate(batch.windows):
            ids[row, :offset + lengths[row]] = torch.tensor(plan.model_input(w.tokens))
        lengths_t, leads_t = torch.tensor(lengths), torch.tensor(leads)
        scored_t = lengths_t - leads_t  # [windows]
        column = torch.arange(width)[None, :] - offset  # [1, pos]: index into the window
        valid = (column >= leads_t[:, None]) & (column < lengths_t[:, None])  # BOS and the leads are not scored
        flat = valid.view(-1).nonzero().squeeze(1)  # [N] scored positions, in reading order
        tokens = ids.view(-1).index_select(0, flat)  # [N], on the CPU
        flat = flat.to(device)
        window_of = torch.repeat_interleave(torch.arange(len(lengths)), scored_t)  # [N]
        first_row = torch.cumsum(scored_t, 0) - scored_t  # flat index of each window's first scored token
        starts = torch.tensor([w.start for w in batch.windows]) + leads_t  # document position of that token
        docs_w = torch.tensor([w.doc for w in batch.windows])
        positions = starts[window_of] + torch.arange(len(window_of)) - first_row[window_of]
        docs = docs_w[window_of].to(device)
        codes = pack(docs, positions.to(device))  # [N], increasing when batch.ordered
        low = first_row[window_of].to(device)
        high = (first_row + scored_t)[window_of].to(device)
        steps = torch.arange(-context_before, context_after + 1, device=device)
        keys = position_keys(codes, seed) if samples else None
        return cls(batch, ids, flat, codes, docs, low, high, keys, steps, tokens, Positions.of(lengths, device, leads))

    @property
    def count(self) -> int:
        return self.flat.numel()


class BatchStep:
    """Fold one batch's coefficients, layer by layer as the forward produces them, into ``state``
    (its ``index``-th batch); then :meth:`finish`."""

    def __init__(self, backend: Backend, state: ScanState, rows: BatchRows, *, with_context: bool, index: int):
        self.backend, self.state, self.rows, self.with_context, self.index = backend, state, rows, with_context, index
        self.finite: list[tuple[int, bool]] = []
        self.pending: dict[int, Tensor] = {}  # layer -> [2, N, F] gate, up, until its coefficients come
        layer_states = list(state.layer_states.values())
        self.layout = (BatchLayout.read(layer_states[0], rows.codes, rows.docs, rows.keys)
                       if layer_states and rows.count else None)

    @property
    def wants_gate_up(self) -> bool:
        """Whether the states keep quadrant counts, so the capture must pass :meth:`gate_up` each layer's
        gate and up pre-activations."""
        return any(s.quadrants is not None for s in self.state.layer_states.values())

    def gate_up(self, layer: int, site: str, tensor: Tensor) -> None:
        """A gate (site ``pre``) or up (``pre_linear``) pre-activation [B, P, F] of ``layer``, kept at the
        scored positions (float32) for :meth:`layer`."""
        if tensor.shape[-1] != self.state.layer_states[layer].histogram.shape[0]:
            raise KvmemError(f"the {site} pre-activation of layer {layer} is {tensor.shape[-1]} wide, not d_ff: this "
                             f"model's gate/up projections are not laid out as its architecture row says; "
                             f"scan with --no-taxonomy-sums")
        if layer not in self.pending:
            self.pending[layer] = torch.empty((len(GATE_UP_SITES), self.rows.count, tensor.shape[-1]),
                                              dtype=torch.float32, device=tensor.device)
        kept = self.pending[layer][GATE_UP_SITES.index(site)]
        scored = tensor.reshape(-1, tensor.shape[-1])
        if scored.dtype == torch.float32:
            torch.index_select(scored, 0, self.rows.flat, out=kept)
        else:
            kept.copy_(scored.index_select(0, self.rows.flat))

    def layer(self, layer: int, coefficients: Tensor) -> None:
        """coefficients [B, P, F] of ``layer`` (any float dtype) -> folded into its state."""
        rows = self.rows
        acts = coefficients.reshape(-1, coefficients.shape[-1]).index_select(0, rows.flat).float()  # [N, F]
        extras = self.pending.pop(layer, None)  # [2, N, F] gate, up (quadrant counts) or None
        steps = rows.steps if self.with_context else rows.steps[:0]

        def context_fn(at: Tensor, neurons: Tensor) -> Tensor:  # [c, C (+ gate, up)]
            return self.backend.window_context(acts, at, neurons, steps, rows.low, rows.high, extras)

        finite = fold_batch(self.backend, self.state.layer_states[layer], acts, rows.codes, context_fn,
                            docs=rows.docs, keys=rows.keys, ordered=rows.batch.ordered, positions=rows.positions,
                            gate_up=None if extras is None else (extras[0], extras[1]), layout=self.layout)
        if finite is not None:
            self.finite.append((layer, finite))

    def finish(self) -> None:
        """Apply the non-finite rule (to the flags the layers read) and count the batch into the state."""
        bad = [layer for layer, ok in self.finite if not ok]
        if bad:
            windows = self.rows.batch.windows
            raise KvmemError(
                f"layer {bad[0]} gave non-finite coefficients (NaN or ±inf) in batch {self.index} "
                f"(documents {windows[0].doc_id!r} .. {windows[-1].doc_id!r}); kvmem refuses them rather "
                f"than count them wrongly: scan in float32 or bfloat16 (--dtype float32), whose range "
                f"does not overflow")
        batch = self.rows.batch
        if self.state.unigrams is not None:
            tokens = self.rows.tokens
            tokens = tokens.to(self.state.unigrams.device)
            self.state.unigrams.index_add_(0, tokens, torch.ones_like(tokens))
        self.state.texts.add(batch.windows)
        self.state.tokens += self.rows.count  # scored tokens
        self.state.windows += len(batch.windows)
        self.state.batches += 1
