"""The samples: per layer a uniform random sample of positions (every neuron's coefficient there, with
its context), and per neuron and histogram bin a sample of the positions that fell in it (quantile
samples); the samples table.

Both are bottom-k-by-key samples: a position's key is a hash of its code (:func:`kvmem.scanning.ordering.
position_keys`), and a sample keeps the smallest keys, so the union's smallest keys are the stream's
(an exact merge, whatever the order the positions came in). The bin samples draw only from the positions
whose key is below ``sample_rate`` of the key range (bounding their per-token cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

from kvmem.scanning.bins import HIST_BINS, bin_of
from kvmem.scanning.ordering import KEY_BITS, NO_KEY, keys_or_none, order_by_key
from kvmem.scanning.reads import Pending, sizes
from kvmem.scanning.statistics.batch import LayerBatch, RowContextFn
from kvmem.scanning.statistics.sides import doc_pos, list_column, nonzero, nonzero_static
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic

__all__ = ["Samples", "SamplesState", "RandomSample", "BinSample"]


@dataclass
class RandomSample:
    """codes [S] int64 (-1 empty), sorted by key; values [S, F]; ``store`` [S, C, F]: each kept position's
    context rows, every neuron's coefficient at the C context tokens around it (NaN outside the window),
    laid out as the batch's own rows so that a position entering copies whole rows.

    The context rows stay where they were written (one slot per kept position) and ``slots`` [S] names
    each sorted entry's slot, so a batch that lets a few positions in writes their rows only, not all
    S × C × F again; :attr:`rows` gives them in sorted order, :attr:`context` per neuron ([S, F, C]).
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
                   torch.full((size, width, d_ff), float("nan"), dtype=torch.float32, device=device), seed)

    @classmethod
    def of_context(cls, codes: Tensor, values: Tensor, context: Tensor, *, seed: int) -> RandomSample:
        """From the per-neuron context [S, F, C] (the checkpoint's layout)."""
        return cls(codes, values, context.transpose(1, 2).contiguous(), seed)

    @property
    def rows(self) -> Tensor:
        """[S, C, F] in the order of ``codes``."""
        return self.store if self.slots is None else self.store.index_select(0, self.slots)

    @property
    def context(self) -> Tensor:
        """[S, F, C] in the order of ``codes`` (a view of :attr:`rows`)."""
        return self.rows.transpose(1, 2)

    def merge(self, other: RandomSample) -> RandomSample:
        size = self.codes.shape[0]
        codes = torch.cat([self.codes, other.codes])
        order = order_by_key(keys_or_none(codes, self.seed), codes, 0)[:size]
        return RandomSample(codes[order], torch.cat([self.values, other.values])[order],
                            torch.cat([self.rows, other.rows])[order], self.seed)


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
class SamplesState:
    """The layer's random sample and bin samples (None where switched off)."""

    random: RandomSample | None
    bins: BinSample | None


class Samples(Statistic):
    name = "samples"
    needs_keys = True
    layer_tables = ("samples",)

    @classmethod
    def wanted(cls, config, *, gated: bool) -> bool:
        return bool(config.random_samples or config.bin_samples)

    @property
    def random_size(self) -> int:
        return self.config.random_samples

    @property
    def bin_limit(self) -> int | None:
        """The key below which a position enters the bin samples' draw (None: no bin samples)."""
        return int(self.config.sample_rate * (1 << KEY_BITS)) if self.config.bin_samples else None

    def new(self, spec: LayerSpec) -> SamplesState:
        c = self.config
        return SamplesState(
            RandomSample.empty(c.random_samples, spec.d_ff, spec.width, spec.device, seed=c.seed)
            if c.random_samples else None,
            BinSample.empty(c.bin_samples, spec.d_ff, spec.device, seed=c.seed, rate=c.sample_rate)
            if c.bin_samples else None)

    @torch.inference_mode()
    def update(self, state: SamplesState, batch: LayerBatch) -> None:
        layout = batch.layout
        if layout.random:
            batch.reads.defer(random_sample(state.random, batch.acts, layout.ranked[:layout.random],
                                            layout.ranked_keys[:layout.random], layout.ranked_codes[:layout.random],
                                            batch.row_context))
        if layout.thinned:
            batch.reads.defer(bin_sample(state.bins, batch.acts, layout.ranked[:layout.thinned],
                                         layout.ranked_keys[:layout.thinned], layout.ranked_codes[:layout.thinned]))

    @torch.inference_mode()
    def merge(self, a: SamplesState, b: SamplesState) -> SamplesState:
        return SamplesState(a.random.merge(b.random) if a.random is not None else None,
                            a.bins.merge(b.bins) if a.bins is not None else None)

    def to_tensors(self, state: SamplesState, prefix: str) -> tuple[dict[str, Tensor], dict]:
        tensors = {}
        if state.random is not None:
            for part in ("codes", "values", "context"):
                tensors[f"{prefix}.random.{part}"] = getattr(state.random, part).contiguous()
        if state.bins is not None:
            tensors[f"{prefix}.bins.codes"], tensors[f"{prefix}.bins.values"] = state.bins.codes, state.bins.values
        return tensors, {"random_seed": state.random.seed if state.random is not None else None,
                         "bins": [state.bins.seed, state.bins.rate] if state.bins is not None else None}

    def from_tensors(self, prefix: str, tensors: dict[str, Tensor], meta: dict) -> SamplesState:
        random = bins = None
        if meta.get("random_seed") is not None:
            random = RandomSample.of_context(*(tensors[f"{prefix}.random.{part}"]
                                               for part in ("codes", "values", "context")), seed=int(meta["random_seed"]))
        if meta.get("bins") is not None:
            seed, rate = meta["bins"]
            bins = BinSample(tensors[f"{prefix}.bins.codes"], tensors[f"{prefix}.bins.values"], int(seed), float(rate))
        return SamplesState(random, bins)

    def codes(self, state: SamplesState, *, open_documents: bool = False) -> list[Tensor]:
        return [part.codes for part in (state.random, state.bins) if part is not None]

    def layer_part(self, table: str, layer: int, state: SamplesState, layer_state) -> pa.Table | None:
        """One row per sampled coefficient, sorted by (neuron, kind (random, then bin), bin, rank); text as for
        triggers."""
        part = _sample_layer(layer, state, layer_state.extras)
        if part is None:
            return None
        return pa.table({
            "layer": part["layer"], "neuron": part["neuron"],
            "kind": pc.take(pa.array(["random", "bin"], pa.string()), pa.array(part["kind"])),
            "bin": part["bin"], "rank": part["rank"], "activation": pa.array(part["activation"], pa.float32()),
            **doc_pos(part["code"]),
            "context_activations": list_column(part["context"], at=part["context_at"], rows=len(part["code"])),
        })


def random_sample(sample: RandomSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor,
                  context_fn: RowContextFn) -> Pending | None:
    """A pending step (one read): fold a batch into the random sample: acts [N, F]; ``rows`` [m] the
    batch's positions with the m smallest (key, code), their keys and codes [m]; ``context_fn(rows)``
    their context rows [m, C, F]."""
    size = sample.values.shape[0]
    if size == 0 or rows.numel() == 0:
        return None
    return _random_entries(sample, acts, rows, row_keys, row_codes, context_fn)


def _random_entries(sample: RandomSample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor,
                    context_fn: RowContextFn) -> Pending:
    size = sample.values.shape[0]
    own = keys_or_none(sample.codes, sample.seed)
    all_codes = torch.cat([sample.codes, row_codes])
    order = order_by_key(torch.cat([own, row_keys]), all_codes, 0, check_ties=False)[:size]  # into [old S, new m]
    is_new = order >= size
    (n,) = yield sizes(is_new.sum())  # the new rows kept
    if n == 0:
        return
    entering = order.index_select(0, nonzero(is_new, n)) - size
    slots = sample.slots if sample.slots is not None else torch.arange(size, device=acts.device)
    kept_old = torch.zeros(size, dtype=torch.bool, device=acts.device)
    kept_old[order.index_select(0, nonzero(~is_new, size - n))] = True
    freed = slots.index_select(0, nonzero(~kept_old, n))  # as many as enter
    sample.store.index_copy_(0, freed, context_fn(rows.index_select(0, entering)))
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
    at_row, neuron = nonzero_static(first_cut, cut).unbind(1)  # by (key, code), then neuron
    at = at.view(-1).index_select(0, at_row * d_ff + neuron)
    exact = row_keys.index_select(0, at_row) <= sample.last_keys.view(-1).index_select(0, at)
    cell = neuron * bins + at.div(d_ff, rounding_mode="floor")  # flat (neuron, bin) of codes.view(-1, q)
    per_cell = torch.zeros(d_ff * bins, dtype=torch.int64, device=acts.device).index_add_(0, cell, exact.long())
    # the sizes in one read: candidates, cells with candidates, and candidates among a cell's q first
    total, width, kept = yield sizes(exact.sum(), (per_cell > 0).sum(), per_cell.clamp(max=q).sum())
    if total == 0:
        return
    exact = nonzero(exact, total)
    at_row, neuron, cell = at_row.index_select(0, exact), neuron.index_select(0, exact), cell.index_select(0, exact)
    by_cell = torch.argsort(cell, stable=True)  # grouped by cell, (key, code) order kept within
    cell, at_row, neuron = cell[by_cell], at_row[by_cell], neuron[by_cell]
    cells = nonzero(per_cell, width)  # ascending, as the groups come
    counts = per_cell.index_select(0, cells)
    which = torch.repeat_interleave(torch.arange(width, device=acts.device), counts, output_size=total)
    rank = torch.arange(total, device=acts.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts,
                                                                             output_size=total)
    first = nonzero(rank < q, kept)  # only a cell's q smallest new keys can be kept
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


def _sample_layer(layer: int, s: SamplesState, extras: int) -> dict[str, np.ndarray] | None:
    """One layer's samples in table order: neuron, then the random sample (rank order), then the bin
    samples (bin, rank); empty entries dropped. Rows are placed by counting, without a sort."""
    if s.random is None and s.bins is None:
        return None
    d_ff = (s.random.values.shape[1] if s.random is not None else s.bins.codes.shape[0])
    if s.random is not None:
        random_codes = s.random.codes.cpu().numpy()
        ranks = np.flatnonzero(random_codes >= 0)  # the kept entries of the shared random positions
        context = s.random.rows.cpu().numpy()  # [S, C (+ gate, up), F]
        width = context.shape[1] - extras
    else:
        random_codes, ranks, width = np.empty(0, np.int64), np.empty(0, np.int64), 0
    r = len(ranks)
    if s.bins is not None:
        bin_codes = s.bins.codes.cpu().numpy()  # [F, B, Q]
        kept = bin_codes >= 0
        flat = np.flatnonzero(kept)  # the kept entries in (neuron, bin, rank) order, as flat indices
        bins, q = bin_codes.shape[1:]
        b_neuron, cell = np.divmod(flat, bins * q)
        b_bin, b_rank = np.divmod(cell, q)
        per_neuron = np.count_nonzero(kept.reshape(d_ff, -1), axis=1)
    else:
        flat = b_neuron = b_bin = b_rank = np.empty(0, np.int64)
        per_neuron = np.zeros(d_ff, np.int64)
    rows = r + per_neuron  # [F] rows of each neuron: its random rows, then its bin rows
    start = np.zeros(d_ff + 1, np.int64)
    np.cumsum(rows, out=start[1:])
    total = int(start[-1])
    random_at = (start[:-1, None] + np.arange(r)[None, :]).reshape(-1)  # [F * r], (neuron, rank) order
    # the i-th kept bin entry follows the random rows of its neuron and of every neuron before it
    bin_at = np.arange(len(flat)) + r * (b_neuron + 1)

    out = {"layer": np.full(total, layer, np.int16), "neuron": np.repeat(np.arange(d_ff, dtype=np.int32), rows),
           "kind": np.ones(total, np.int64), "bin": np.empty(total, np.int16), "rank": np.empty(total, np.int16),
           "activation": np.empty(total, np.float32), "code": np.empty(total, np.int64),
           "context": np.empty((0, width), np.float32), "context_at": random_at}
    if r:
        out["kind"][random_at] = 0
        out["bin"][random_at] = -1
        out["rank"][random_at] = np.tile(ranks, d_ff)
        out["activation"][random_at] = s.random.values.cpu().numpy()[ranks].T.reshape(-1)
        out["code"][random_at] = np.tile(random_codes[ranks], d_ff)
        out["context"] = context[ranks, :width, :].transpose(2, 0, 1).reshape(d_ff * r, width)  # rows random_at
    if len(b_neuron):
        out["bin"][bin_at] = b_bin
        out["rank"][bin_at] = b_rank
        out["activation"][bin_at] = s.bins.values.cpu().numpy().reshape(-1)[flat]
        out["code"][bin_at] = bin_codes.reshape(-1)[flat]
    return out
