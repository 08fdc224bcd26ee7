"""The rules every part of the scan engine shares, each written once: empty entries, the block
size of the candidate search, the tie rule, and the sampling key of a position.

- **Codes.** A position is the int64 code ``doc << 32 | pos`` (:func:`kvmem.plan.pack`);
  ``EMPTY`` (-1) marks an entry that holds none.
- **Blocks.** The candidate search reads the extremes of blocks of ``BLOCK_ROWS`` rows of a
  batch.
- **The tie rule.** Kept triggers are ordered most extreme coefficient first, and among equal
  coefficients lowest code first (the earliest (doc, pos)); empty entries last
  (:func:`order_by_value`). Samples are ordered by key, then code (:func:`order_by_key`).
- **Sampling keys.** A position's key is splitmix64 of its code and the seed, cut to
  ``KEY_BITS`` bits: :func:`position_keys`. ``NO_KEY`` is the key of an empty entry and sorts after
  every real one.

The histogram bin is the remaining rule; it lives in :mod:`kvmem.scanning.bins`.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["EMPTY", "BLOCK_ROWS", "KEY_BITS", "NO_KEY", "position_keys", "keys_or_none", "key_salt",
           "order_by_value", "order_by_key"]

EMPTY = -1
BLOCK_ROWS = 32  # rows per block of the candidate search's block extremes
KEY_BITS = 53
NO_KEY = 1 << 62  # sorts after every real key

_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def key_salt(seed: int) -> int:
    """The seed's part of every key: seed · golden ratio mod 2^64 (unsigned)."""
    return (seed * _GOLDEN) & ((1 << 64) - 1)


def position_keys(codes: Tensor, seed: int) -> Tensor:
    """[N] int64 codes -> [N] int64 keys, uniform on [0, 2^53): splitmix64 of (code, seed)."""
    x = codes ^ _signed(key_salt(seed))
    x = x + _signed(_GOLDEN)
    x = (x ^ _shift(x, 30)) * _signed(_MIX1)
    x = (x ^ _shift(x, 27)) * _signed(_MIX2)
    x = x ^ _shift(x, 31)
    return _shift(x, 64 - KEY_BITS)


def keys_or_none(codes: Tensor, seed: int) -> Tensor:
    """Keys of codes (any shape), NO_KEY where a code is EMPTY."""
    keys = position_keys(codes.clamp(min=0), seed)
    return torch.where(codes < 0, torch.full_like(keys, NO_KEY), keys)


def _code_order(codes: Tensor, dim: int) -> Tensor:
    """Indices sorting by code ascending along ``dim``, EMPTY last (stable)."""
    sort_codes = torch.where(codes < 0, torch.iinfo(torch.int64).max, codes)
    return torch.argsort(sort_codes, dim=dim, stable=True)


def order_by_value(values: Tensor, codes: Tensor, k: int, largest: bool) -> Tensor:
    """The tie rule: indices [k, F] of the k first entries of each column of values, codes [m, F]
    under (most extreme value, then lowest code); empty entries last."""
    by_code = _code_order(codes, 0)
    by_value = torch.argsort(values.gather(0, by_code), dim=0, descending=largest, stable=True)[:k]
    return by_code.gather(0, by_value)


def order_by_key(keys: Tensor, codes: Tensor, dim: int, *, check_ties: bool = True) -> Tensor:
    """Indices sorting by (key, then code) along ``dim``; empties (code EMPTY, key NO_KEY) last.

    Keys are 53-bit hashes, so two positions share one almost never: one stable sort by key
    suffices unless two real keys tie, and then the exact two-pass sort runs. Asking whether two
    tie is a read of the device; ``check_ties=False`` runs the two-pass sort without asking (the
    same order, for short rows where a second sort costs less than a synchronisation).
    """
    if not check_ties:
        by_code = _code_order(codes, dim)
        return by_code.gather(dim, torch.argsort(keys.gather(dim, by_code), dim=dim, stable=True))
    by_key = torch.argsort(keys, dim=dim, stable=True)
    n = keys.shape[dim]
    if n > 1:
        ranked = keys.gather(dim, by_key)
        later = ranked.narrow(dim, 1, n - 1)
        if not bool(((later == ranked.narrow(dim, 0, n - 1)) & (later != NO_KEY)).any()):
            return by_key
    by_code = _code_order(codes, dim)
    by_key = torch.argsort(keys.gather(dim, by_code), dim=dim, stable=True)
    return by_code.gather(dim, by_key)
