"""The checks the experiments' arguments pass: counts, seeds and projection conventions, each with a one-line error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmem.conventions import CONVENTIONS, get_convention
from kvmem.errors import KvmemError

if TYPE_CHECKING:
    from kvmem.atlas import Atlas

__all__ = ["check_convention", "check_positive", "check_seed", "conventions_for"]


def check_positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise KvmemError(f"{name} must be an integer >= 1, got {value!r}")


def check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise KvmemError(f"seed must be an integer >= 0, got {seed!r}")


def check_convention(convention: str, atlas: Atlas | None = None) -> None:
    if convention not in CONVENTIONS:
        get_convention(convention)  # the registry's one-line error naming the allowed conventions
    if atlas is not None and convention not in atlas.conventions:
        raise KvmemError(f"convention {convention!r} is not in atlas {atlas.path}; it has "
                         f"{', '.join(atlas.conventions)}: pick one of those or rescan with --conventions {convention}")


def conventions_for(convention: str | Sequence[str] | None, atlas: Atlas | None = None) -> list[str]:
    """The projection conventions to report: one name, several, or None for every known one (``raw`` first,
    Geva et al.'s reading). Each is checked (:func:`check_convention`); the one place that resolves them."""
    names = list(CONVENTIONS) if convention is None else [convention] if isinstance(convention, str) else list(convention)
    if not names:
        raise KvmemError(f"no projection convention given; choose from {', '.join(CONVENTIONS)}")
    for name in names:
        check_convention(name, atlas)
    return list(dict.fromkeys(names))
