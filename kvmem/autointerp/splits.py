"""The explain / held-out split: a seeded hash of each position code decides, once for every neuron.

A position (``code = doc << 32 | pos``, :func:`kvmem.plan.pack`) lands in the held-out set when the
top 53 bits of ``splitmix64(code ^ splitmix64(seed))``, read as a fraction in [0, 1), fall below
``held_out``. The same position is in the same set for every neuron, layer and side, so an
explainer never sees a context that a scorer judges, and the split is reproducible from the seed.
"""

from __future__ import annotations

import numpy as np

from kvmem.errors import KvmemError

__all__ = ["DEFAULT_SEED", "DEFAULT_HELD_OUT", "splitmix64", "held_out_mask"]

DEFAULT_SEED = 0
DEFAULT_HELD_OUT = 0.5
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x) -> np.ndarray:
    """The splitmix64 finaliser on uint64 values (wrapping arithmetic), elementwise."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) & _MASK


def held_out_mask(codes, *, seed: int = DEFAULT_SEED, held_out: float = DEFAULT_HELD_OUT) -> np.ndarray:
    """[n] bool: True where the position code belongs to the held-out set."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise KvmemError(f"split seed must be an integer >= 0, got {seed!r}")
    if not 0 < held_out < 1:
        raise KvmemError(f"held-out fraction must be in (0, 1), got {held_out!r}")
    codes = np.asarray(codes, dtype=np.int64).astype(np.uint64)
    mixed = splitmix64(codes ^ splitmix64(np.uint64(seed)))
    fraction = (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return fraction < held_out
