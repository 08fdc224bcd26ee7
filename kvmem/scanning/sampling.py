"""Samples of each neuron's coefficients, kept in the same pass: a uniform random sample and a
sample from every histogram bin (from which quantile bands are drawn).

Both are *bottom-k by key* samples: every position gets a pseudo-random key, a hash of its code
and the seed (``position_keys``), and a sample keeps the positions with the smallest keys. That
makes them uniform, reproducible, and mergeable exactly across shards and ranks: the union's
smallest keys are the whole stream's smallest keys.

- random sample: the ``size`` positions with the smallest keys; the same positions for every
  neuron of a layer (so samples are comparable across neurons), with each neuron's coefficient
  and its context coefficients;
- bin samples: for each neuron and histogram bin, the ``per_bin`` positions with the smallest keys
  among positions whose key falls under ``rate`` (a fixed thinning that bounds the per-token cost)
  and whose coefficient falls in that bin. A quantile band made of whole bins is then sampled
  uniformly by taking the smallest keys of its bins' samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvmem.scanning.histogram import HIST_BINS, bin_of
from kvmem.scanning.kernels import bin_sample as compiled_bin_sample

__all__ = ["position_keys", "RandomSample", "BinSample", "KEY_BITS"]

KEY_BITS = 53
_NO_KEY = 1 << 62  # sorts after every real key


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def position_keys(codes: Tensor, seed: int) -> Tensor:
    """[N] int64 codes -> [N] int64 keys, uniform on [0, 2^53): splitmix64 of (code, seed)."""
    x = codes ^ _signed((seed * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shift(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shift(x, 31)
    return _shift(x, 64 - KEY_BITS)


def _high_bits(keys: Tensor) -> Tensor:
    """int32 that orders like the keys, coarsely: key >> 22 (keys < 2^53), _NO_KEY as the int32 maximum.
    ``_high_bits(a) > _high_bits(b)`` implies ``a > b``."""
    return (keys >> 22).clamp_(max=torch.iinfo(torch.int32).max).int()


def _keys_or_none(codes: Tensor, seed: int) -> Tensor:
    keys = position_keys(codes.clamp(min=0), seed)
    return torch.where(codes < 0, torch.full_like(keys, _NO_KEY), keys)


def _order(keys: Tensor, codes: Tensor, dim: int) -> Tensor:
    """Indices sorting by (key, then code) along ``dim``; empties (code -1, key _NO_KEY) last.

    Keys are 53-bit hashes, so two positions share one almost never: one stable sort by key
    suffices unless two real keys tie, and then the exact two-pass sort runs.
    """
    by_key = torch.argsort(keys, dim=dim, stable=True)
    n = keys.shape[dim]
    if n > 1:
        ranked = keys.gather(dim, by_key)
        later = ranked.narrow(dim, 1, n - 1)
        if not bool(((later == ranked.narrow(dim, 0, n - 1)) & (later != _NO_KEY)).any()):
            return by_key
    sort_codes = torch.where(codes < 0, torch.iinfo(torch.int64).max, codes)
    by_code = torch.argsort(sort_codes, dim=dim, stable=True)
    by_key = torch.argsort(keys.gather(dim, by_code), dim=dim, stable=True)
    return by_code.gather(dim, by_key)


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

    def update(self, acts: Tensor, codes: Tensor, keys: Tensor, context_fn) -> None:
        """acts [N, F]; codes, keys [N]: this batch's positions (in any code order)."""
        size, d_ff = self.values.shape
        if size == 0:
            return
        own = _keys_or_none(self.codes, self.seed)
        rows = (keys <= own[-1]).nonzero().squeeze(1)  # may beat the size-th (key, code) so far
        if rows.numel() == 0:
            return
        rows = rows[_order(keys[rows], codes[rows], 0)[:size]]
        all_codes = torch.cat([self.codes, codes[rows]])
        order = _order(torch.cat([own, keys[rows]]), all_codes, 0)[:size]  # into [old S, new n]
        entering = order[order >= size] - size  # the new rows kept
        if entering.numel() == 0:
            return
        slots = self.slots if self.slots is not None else torch.arange(size, device=acts.device)
        kept_old = torch.zeros(size, dtype=torch.bool, device=acts.device)
        kept_old[order[order < size]] = True
        freed = slots[~kept_old]  # as many as enter
        new_rows = rows[entering]
        n = new_rows.numel()
        neurons = torch.arange(d_ff, device=acts.device)
        self.store[freed] = context_fn(new_rows.repeat_interleave(d_ff), neurons.repeat(n)).view(n, d_ff, -1)
        slot_of_new = torch.zeros(rows.numel(), dtype=torch.int64, device=acts.device)
        slot_of_new[entering] = freed
        self.slots = torch.cat([slots, slot_of_new])[order]
        self.codes = all_codes[order]
        self.values = torch.cat([self.values, acts.index_select(0, rows)])[order]

    def merge(self, other: RandomSample) -> RandomSample:
        size = self.codes.shape[0]
        codes = torch.cat([self.codes, other.codes])
        order = _order(_keys_or_none(codes, self.seed), codes, 0)[:size]
        return RandomSample(codes[order], torch.cat([self.values, other.values])[order],
                            torch.cat([self.context, other.context])[order], self.seed)


@dataclass
class BinSample:
    """For each neuron and histogram bin, the positions with the smallest keys (under the thinning rate).

    codes [F, B, Q] int64 (-1 empty), values [F, B, Q] float32, both sorted by key along Q.
    """

    codes: Tensor
    values: Tensor
    seed: int = 0
    rate: float = 0.125
    _last: Tensor | None = field(default=None, repr=False)  # cache [B, F]: key of the last kept entry per (bin, neuron)
    _last_high: Tensor | None = field(default=None, repr=False)  # the same, its high bits (see _high_bits)

    @classmethod
    def empty(cls, per_bin: int, d_ff: int, device, *, seed: int, rate: float) -> BinSample:
        return cls(torch.full((d_ff, HIST_BINS, per_bin), -1, dtype=torch.int64, device=device),
                   torch.full((d_ff, HIST_BINS, per_bin), float("nan"), dtype=torch.float32, device=device), seed, rate)

    def limit(self) -> int:
        return int(self.rate * (1 << KEY_BITS))

    def update(self, acts: Tensor, codes: Tensor, keys: Tensor) -> None:
        """acts [N, F]; codes, keys [N]: this batch's positions (in any code order)."""
        d_ff, bins, q = self.codes.shape
        if q == 0:
            return
        rows = (keys < self.limit()).nonzero().squeeze(1)  # the thinned positions
        if rows.numel() == 0 or compiled_bin_sample(self, acts, rows, keys[rows], codes[rows]):
            return
        rows = rows[_order(keys[rows], codes[rows], 0)]  # by (key, code): candidates come out in that order
        row_keys, row_codes = keys[rows], codes[rows]
        sub = acts.index_select(0, rows)  # [r, F]
        if self._last is None or self._last_high is None:  # the key each (bin, neuron) must beat, kept up to date below
            self._last = _keys_or_none(self.codes[:, :, -1], self.seed).T.contiguous()  # [B, F]
            self._last_high = _high_bits(self._last)
        # (bin, neuron) of each value, flat in [B, F]: bin * F + neuron, int32
        at = torch.add(torch.arange(d_ff, dtype=torch.int32, device=acts.device), bin_of(sub, wide=False), alpha=d_ff)
        # a first cut on the keys' high bits (int32, a table half the size), then the exact keys
        high = self._last_high.view(-1).index_select(0, at.view(-1)).view(at.shape)
        at_row, neuron = (_high_bits(row_keys)[:, None] <= high).nonzero(as_tuple=True)  # by (key, code), then neuron
        at = at.view(-1).index_select(0, at_row * d_ff + neuron)
        exact = (row_keys.index_select(0, at_row) <= self._last.view(-1).index_select(0, at)).nonzero().squeeze(1)
        if exact.numel() == 0:
            return
        at_row, neuron, at = at_row[exact], neuron[exact], at[exact]
        cell = neuron * bins + at.div(d_ff, rounding_mode="floor")  # flat (neuron, bin) of codes.view(-1, q)
        by_cell = torch.argsort(cell, stable=True)  # grouped by cell, (key, code) order kept within
        cell, at_row, neuron = cell[by_cell], at_row[by_cell], neuron[by_cell]
        cells, counts = torch.unique_consecutive(cell, return_counts=True)
        which = torch.repeat_interleave(torch.arange(cells.numel(), device=acts.device), counts)
        rank = torch.arange(cell.numel(), device=acts.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        first = rank < q  # only a cell's q smallest new keys can be kept
        place = (which * q + rank)[first]
        at_row, neuron = at_row[first], neuron[first]
        width = cells.numel()
        new_keys = torch.full((width * q,), _NO_KEY, dtype=torch.int64, device=acts.device)
        new_keys.index_copy_(0, place, row_keys.index_select(0, at_row))
        new_codes = torch.full((width * q,), -1, dtype=torch.int64, device=acts.device)
        new_codes.index_copy_(0, place, row_codes.index_select(0, at_row))
        new_values = torch.full((width * q,), float("nan"), dtype=torch.float32, device=acts.device)
        new_values.index_copy_(0, place, sub.view(-1).index_select(0, at_row * d_ff + neuron))
        flat_codes, flat_values = self.codes.view(-1, q), self.values.view(-1, q)
        old_codes = flat_codes.index_select(0, cells)  # [U, q], sorted by (key, code), empties last
        all_codes = torch.cat([old_codes, new_codes.view(width, q)], dim=1)  # [U, 2q]
        all_keys = torch.cat([_keys_or_none(old_codes, self.seed), new_keys.view(width, q)], dim=1)
        keep = _order(all_keys, all_codes, 1)[:, :q]
        kept_codes = all_codes.gather(1, keep)
        kept_values = torch.cat([flat_values.index_select(0, cells), new_values.view(width, q)], dim=1).gather(1, keep)
        kept_keys = all_keys.gather(1, keep)
        flat_codes.index_copy_(0, cells, kept_codes)
        flat_values.index_copy_(0, cells, kept_values)
        at = (cells % bins) * d_ff + cells.div(bins, rounding_mode="floor")
        self._last.view(-1).index_copy_(0, at, kept_keys[:, -1])
        self._last_high.view(-1).index_copy_(0, at, _high_bits(kept_keys[:, -1]))

    def merge(self, other: BinSample) -> BinSample:
        q = self.codes.shape[2]
        codes = torch.cat([self.codes, other.codes], dim=2)
        values = torch.cat([self.values, other.values], dim=2)
        keep = _order(_keys_or_none(codes, self.seed), codes, 2)[:, :, :q]
        return BinSample(codes.gather(2, keep), values.gather(2, keep), self.seed, self.rate)
