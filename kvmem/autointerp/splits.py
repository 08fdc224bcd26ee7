"""The explain / held-out split: a seeded hash of each read window decides, once for every neuron.

A position (``code = doc << 32 | pos``, :func:`kvmem.plan.pack`) belongs to the window the scan read
it in, ``pos // window`` of its document (:mod:`kvmem.plan`: window k holds tokens [k·W, (k+1)·W)).
The window lands in the held-out set when the top 53 bits of ``splitmix64(unit ^ splitmix64(seed))``
(``unit = doc << 32 | pos // window``), read as a fraction in [0, 1), fall below ``held_out``. Every
position of a window is in the same set, for every neuron, layer and side; a context is cut from
inside the window read, so no held-out context shares a token with a context an explainer saw, and
the split is reproducible from the seed and the window size.

What a memory writes is split the same way, by token: a token of the vocabulary is held out when
``splitmix64(token_id ^ splitmix64(seed ^ TOKEN_SALT))`` falls below ``held_out``
(:func:`held_out_tokens`). Explainers see the held-out half of none of a value's promoted and
suppressed tokens; the output scorer judges only those.
"""

from __future__ import annotations

import numpy as np

from kvmem.errors import KvmemError

__all__ = ["DEFAULT_SEED", "DEFAULT_HELD_OUT", "splitmix64", "held_out_mask", "held_out_tokens", "split_window"]

DEFAULT_SEED = 0
DEFAULT_HELD_OUT = 0.5
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
TOKEN_SALT = 0x746F6B656E  # "token": the vocabulary's split differs from the positions' for the same seed


def splitmix64(x) -> np.ndarray:
    """The splitmix64 finaliser on uint64 values (wrapping arithmetic), elementwise."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) & _MASK


def split_window(atlas) -> int:
    """Tokens per split unit: the window the atlas was scanned with (its manifest's tokenization)."""
    return int(atlas.manifest.tokenization["window"])


def held_out_mask(codes, *, seed: int = DEFAULT_SEED, held_out: float = DEFAULT_HELD_OUT, window: int) -> np.ndarray:
    """[n] bool: True where the position code's read window (``window`` tokens) belongs to the held-out set."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise KvmemError(f"split seed must be an integer >= 0, got {seed!r}")
    if not 0 < held_out < 1:
        raise KvmemError(f"held-out fraction must be in (0, 1), got {held_out!r}")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise KvmemError(f"split window must be an integer >= 1 (tokens per scanned window), got {window!r}")
    codes = np.asarray(codes, dtype=np.int64)
    units = ((codes >> 32) << 32) | ((codes & 0xFFFFFFFF) // int(window))
    mixed = splitmix64(units.astype(np.uint64) ^ splitmix64(np.uint64(seed)))
    fraction = (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return fraction < held_out


def held_out_tokens(token_ids, *, seed: int = DEFAULT_SEED, held_out: float = DEFAULT_HELD_OUT) -> np.ndarray:
    """[n] bool: True where the vocabulary token id belongs to the held-out set (the output side's split)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise KvmemError(f"split seed must be an integer >= 0, got {seed!r}")
    ids = np.asarray(token_ids, dtype=np.int64).astype(np.uint64)
    mixed = splitmix64(ids ^ splitmix64(np.uint64(seed) ^ np.uint64(TOKEN_SALT)))
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53) < held_out
