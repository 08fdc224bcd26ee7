"""The scan's state as data: what a scan holds per layer and per process, its serialisation to
tensors and JSON, and the one exact merge. Nothing here reads a batch; folding one in is
:mod:`kvmem.scanning.step`'s job, with a backend of :mod:`kvmem.scanning.backends`.

Memory is O(layers · d_ff · top_k · context); no tensor of shape (all tokens × d_ff) is ever held.
Positions are int64 codes (``kvmem.plan.pack``: doc << 32 | pos); EMPTY (-1) marks an empty entry.

- :class:`Side`: the k most extreme coefficients of each neuron on one side (top or bottom, or
  per document), sorted under the tie rule of :mod:`kvmem.scanning.rules`;
- :class:`RandomSample`, :class:`BinSample`: bottom-k-by-key samples (a uniform one, and one per
  histogram bin), mergeable exactly because the union's smallest keys are the stream's;
- :class:`LayerState`: one layer's sides, samples, counts, histogram and sums. Sums are kept as
  double-double (``hi + lo``) so that merging the states of several processes gives the same
  float64 totals, to the last bit, as one process adding the same batches in order. The taxonomy's
  sums (``docs/taxonomy.md``) follow the same rules: Σ m·p (p = the position in the window) as
  double-double, Σp and Σp² as Python integers, the gate/up sign-quadrant counts as int64;
- :class:`ScanState`: every layer's state plus the text store and the stream position (what a
  checkpoint stores).

:func:`merge_states` is the one merge of kvmem: ranks under torchrun and ``kvmem merge`` of shard
atlases both use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch
from torch import Tensor

from kvmem.plan import StreamPosition, distinct_codes, pack, unpack
from kvmem.scanning.histogram import HIST_BINS
from kvmem.scanning.rules import EMPTY, KEY_BITS, keys_or_none, order_by_key, order_by_value
from kvmem.scanning.texts import TextStore

__all__ = ["EMPTY", "Side", "merge_sides", "RandomSample", "BinSample", "LayerState", "new_layer_state",
           "add_into", "add_double_double", "merge_states", "ScanState", "QUADRANTS", "GATE_UP_EXTRAS"]


class Side:
    """The k most extreme coefficients of each neuron on one side, sorted (rank 0 = most extreme).

    values [k, F] float32 (∓inf where empty); codes [k, F] int64 (-1 where empty);
    context [k, F, C] float32: the neuron's coefficients at the C context tokens around the
    trigger (NaN outside the window the model read, and for empty entries).

    The context rows live in an append-only pool; kept entries hold their row's index, ``slots``
    [k, F] int64 (row 0 is all NaN), so reordering entries moves one integer each, not C floats.
    A backend that inserts entries moves values, codes and slots together, and appends the new
    entries' context with :meth:`add_context`. The pool is compacted to the live rows when it fills.
    ``full`` is a host-side note that every neuron holds k entries (once true it stays true), set by
    the caller from what it folded in (k finite coefficients per neuron fill a side); a backend may
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
    """The k first of both sides' entries under the tie rule (:func:`kvmem.scanning.rules.order_by_value`)."""
    k = a.values.shape[0]
    values, codes = torch.cat([a.values, b.values]), torch.cat([a.codes, b.codes])
    context = torch.cat([a.context, b.context])
    order = order_by_value(values, codes, k, a.largest)
    return Side(values.gather(0, order), codes.gather(0, order),
                context.gather(0, order[:, :, None].expand(-1, -1, context.shape[2])), a.largest)


@dataclass
class RandomSample:
    """codes [S] int64 (-1 empty), sorted by key; values [S, F]; context [S, F, C] (NaN outside the window).

    The context rows stay where they were written (``store``, one slot per kept position) and
    ``slots`` [S] names each sorted entry's slot, so a batch that lets a few positions in writes
    their rows only, not all S × F × C again; ``context`` gives them in sorted order.
    """

    codes: Tensor
    values: Tensor
    store: Tensor
    seed: int = 0
    slots: Tensor | None = None  # None: store is in sorted order

    @classmethod
    def empty(cls, size: int, d_ff: int, width: int, device, *, seed: int) -> RandomSample:
        return cls(torch.full((size,), -1, dtype=torch.int64, device=device),
                   torch.full((size, d_ff), float("nan"), dtype=torch.float32, device=device),
                   torch.full((size, d_ff, width), float("nan"), dtype=torch.float32, device=device), seed)

    @property
    def context(self) -> Tensor:
        """[S, F, C] in the order of ``codes``."""
        return self.store if self.slots is None else self.store.index_select(0, self.slots)

    def merge(self, other: RandomSample) -> RandomSample:
        size = self.codes.shape[0]
        codes = torch.cat([self.codes, other.codes])
        order = order_by_key(keys_or_none(codes, self.seed), codes, 0)[:size]
        return RandomSample(codes[order], torch.cat([self.values, other.values])[order],
                            torch.cat([self.context, other.context])[order], self.seed)


@dataclass
class BinSample:
    """For each neuron and histogram bin, the positions with the smallest keys (under the thinning rate).

    codes [F, B, Q] int64 (-1 empty), values [F, B, Q] float32, both sorted by (key, code) along Q.
    """

    codes: Tensor
    values: Tensor
    seed: int = 0
    rate: float = 0.125
    # caches a backend keeps between batches (None: recompute from codes): [B, F] the key of the
    # last kept entry of each (bin, neuron), and the same keys' high bits (the torch path's first cut)
    last_keys: Tensor | None = field(default=None, repr=False)
    last_high: Tensor | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, per_bin: int, d_ff: int, device, *, seed: int, rate: float) -> BinSample:
        return cls(torch.full((d_ff, HIST_BINS, per_bin), -1, dtype=torch.int64, device=device),
                   torch.full((d_ff, HIST_BINS, per_bin), float("nan"), dtype=torch.float32, device=device), seed, rate)

    def limit(self) -> int:
        return int(self.rate * (1 << KEY_BITS))

    def merge(self, other: BinSample) -> BinSample:
        q = self.codes.shape[2]
        codes = torch.cat([self.codes, other.codes], dim=2)
        values = torch.cat([self.values, other.values], dim=2)
        keep = order_by_key(keys_or_none(codes, self.seed), codes, 2)[:, :, :q]
        return BinSample(codes.gather(2, keep), values.gather(2, keep), self.seed, self.rate)


@dataclass
class LayerState:
    """Running state of one layer. F = d_ff, B = HIST_BINS.

    ``count`` positions seen (the same for every neuron); ``total``/``total_sq`` [2, F] float64
    double-double sums of m and m² (row 0 high part, row 1 low part); ``positive`` [F] int64
    #{m > 0}; ``histogram`` [F, B] int64. ``doc_top``/``doc_bottom``: the best position of each
    document (only with per_document), with the still-open document's running best in ``open_*``.
    ``random``/``bins``: the samples of :mod:`kvmem.scanning.state` (None when switched off).

    Taxonomy sums (None / 0 when switched off): ``position_product`` [2, F] float64 double-double
    Σ m·p, p the position in the window (0 = the window's first token, scored or not); ``position_total`` /
    ``position_sq_total`` Σp, Σp² (exact integers, the same for every neuron); ``quadrants`` [4, F]
    int64 (gated FFNs): positions with (gate > 0, up > 0), (gate > 0, up <= 0), (gate <= 0, up > 0),
    (gate <= 0, up <= 0), gate and up the pre-activations W_gate x and W_up x. ``extras``: values
    after the C context coefficients in every kept entry's context row (2 with quadrants: the
    entry's gate and up pre-activations), so they travel with the entry through every insertion.
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
    position_product: Tensor | None = None
    position_total: int = 0
    position_sq_total: int = 0
    quadrants: Tensor | None = None
    extras: int = 0

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
        for name in _TAXONOMY_TENSORS:
            if getattr(self, name) is not None:
                tensors[f"{prefix}.{name}"] = getattr(self, name).contiguous()
        meta = {"count": self.count, "open_doc": self.open_doc, "extras": self.extras,
                "position_total": self.position_total, "position_sq_total": self.position_sq_total,
                "taxonomy": [name for name in _TAXONOMY_TENSORS if getattr(self, name) is not None],
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
                   **{name: tensors[f"{prefix}.{name}"] for name in ("total", "total_sq", "positive", "histogram")},
                   **{name: tensors[f"{prefix}.{name}"] for name in meta["taxonomy"]},
                   position_total=int(meta["position_total"]), position_sq_total=int(meta["position_sq_total"]),
                   extras=int(meta["extras"]))


_TAXONOMY_TENSORS = ("position_product", "quadrants")
QUADRANTS = ("pp", "pn", "np", "nn")  # rows of LayerState.quadrants: (sign of gate, sign of up), p: > 0, n: <= 0
GATE_UP_EXTRAS = 2  # context-row values after the context coefficients: the entry's gate, then up pre-activation


def new_layer_state(d_ff: int, top_k: int, *, per_document: bool, context_width: int,
                    device: str | torch.device = "cpu", random_samples: int = 0, bin_samples: int = 0,
                    sample_rate: float = 0.125, seed: int = 0, position_sums: bool = False,
                    quadrants: bool = False) -> LayerState:
    """An empty layer state. ``context_width``: context coefficients kept per entry; ``position_sums``:
    keep Σ m·p, Σp, Σp²; ``quadrants``: keep the gate/up sign-quadrant counts and each entry's gate and
    up pre-activations (gated FFNs; the capture must then pass them to :func:`kvmem.scanning.step.fold_batch`)."""
    extras = GATE_UP_EXTRAS if quadrants else 0
    context_width += extras

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
    if position_sums:
        state.position_product = torch.zeros(2, d_ff, dtype=torch.float64, device=device)
    if quadrants:
        state.quadrants = torch.zeros(len(QUADRANTS), d_ff, dtype=torch.int64, device=device)
    state.extras = extras
    return state


def add_into(acc: Tensor, value: Tensor) -> None:
    """acc [2, F] (hi, lo) += value [F] float64, error-free, then renormalised."""
    _two_sum(acc, value)
    _renormalise(acc)


def _two_sum(acc: Tensor, value: Tensor) -> None:
    """acc [2, F] (hi, lo) += value [F] float64, error-free (Knuth's TwoSum)."""
    hi = acc[0] + value
    bp = hi - acc[0]
    err = (acc[0] - (hi - bp)) + (value - bp)
    acc[0] = hi
    acc[1] += err


def add_double_double(a: Tensor, b: Tensor) -> Tensor:
    """a + b, both [2, F] double-double (the exact merge of two sums)."""
    out = a.clone()
    _two_sum(out, b[0])
    out[1] += b[1]
    # renormalise so equal sums have equal representations whatever the order
    _renormalise(out)
    return out


def _renormalise(acc: Tensor) -> None:
    """acc [2, F]: hi + lo with |lo| minimal, so that equal sums have equal representations."""
    hi = acc[0] + acc[1]
    acc[1] = acc[1] - (hi - acc[0])
    acc[0] = hi


@torch.inference_mode()
def merge_states(a: LayerState, b: LayerState) -> LayerState:
    """The state one stream over both inputs gives (a and b saw disjoint documents, any order).

    The one merge of kvmem: ranks under torchrun and ``kvmem merge`` of shard atlases both use it.
    """
    if a.open_doc != EMPTY or b.open_doc != EMPTY:
        raise ValueError("merge_states needs closed states: call kvmem.scanning.step.close_open_document first")
    out = LayerState(
        top=merge_sides(a.top, b.top), bottom=merge_sides(a.bottom, b.bottom), count=a.count + b.count,
        total=add_double_double(a.total, b.total), total_sq=add_double_double(a.total_sq, b.total_sq),
        positive=a.positive + b.positive, histogram=a.histogram + b.histogram,
    )
    if a.doc_top is not None:
        out.doc_top, out.doc_bottom = merge_sides(a.doc_top, b.doc_top), merge_sides(a.doc_bottom, b.doc_bottom)
    if a.random is not None:
        out.random = a.random.merge(b.random)
    if a.bins is not None:
        out.bins = a.bins.merge(b.bins)
    if (a.position_product is None) != (b.position_product is None) or (a.quadrants is None) != (b.quadrants is None):
        raise ValueError("merge_states needs states that keep the same taxonomy sums")
    if a.position_product is not None:
        out.position_product = add_double_double(a.position_product, b.position_product)
    if a.quadrants is not None:
        out.quadrants = a.quadrants + b.quadrants
    out.position_total, out.position_sq_total = a.position_total + b.position_total, a.position_sq_total + b.position_sq_total
    out.extras = a.extras
    return out


@dataclass
class ScanState:
    """Everything a process holds during a scan; what a checkpoint stores (as tensors and JSON)."""

    layers: list[int]
    layer_states: dict[int, LayerState]
    texts: TextStore = field(default_factory=TextStore)
    position: StreamPosition = field(default_factory=StreamPosition)
    tokens: int = 0  # scored by this process
    windows: int = 0
    batches: int = 0  # forwards run by this process (resumed runs included)
    seconds: float = 0.0  # streaming seconds so far
    unigrams: Tensor | None = None  # [vocab] int64: scored positions holding each token id (None: not kept)

    def merge(self, other: ScanState) -> ScanState:
        """The state of one process that had read both (disjoint shares of one stream)."""
        if (self.unigrams is None) != (other.unigrams is None):
            raise ValueError("ScanState.merge needs states that both keep unigram counts, or neither")
        return ScanState(self.layers, {layer: merge_states(self.layer_states[layer], other.layer_states[layer])
                                       for layer in self.layers},
                         TextStore({**self.texts.windows, **other.texts.windows}), self.position,
                         self.tokens + other.tokens, self.windows + other.windows, self.batches + other.batches,
                         max(self.seconds, other.seconds),
                         None if self.unigrams is None else self.unigrams + other.unigrams.to(self.unigrams.device))

    def kept_positions(self, *, open_documents: bool = False) -> np.ndarray:
        """Sorted distinct codes of every kept trigger and sample (and, with ``open_documents``, of the
        per-document bests still open): the positions whose text the atlas needs."""
        parts = [part for s in self.layer_states.values()
                 for part in (*s.sides().values(), *((s.open_top, s.open_bottom) if open_documents else ()),
                              s.random, s.bins) if part is not None]
        return distinct_codes([part.codes.cpu().numpy() for part in parts])

    def referenced_windows(self, window: int) -> set[int]:
        docs, pos = unpack(self.kept_positions(open_documents=True))
        return set(pack(docs, pos - pos % window).tolist())
