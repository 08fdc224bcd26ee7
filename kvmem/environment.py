"""The environment variables kvmem reads: one table, one reader.

Each variable that is set while an atlas is scanned is recorded in its manifest
(``manifest.environment["variables"]``), so that an atlas says which switches made it. Adding a
variable means one line in :data:`VARIABLES`; ``tests/test_environment.py`` finds every ``KVMEM_`` name
in the package and checks it is here, and that each one here is read through :func:`read`.
"""

from __future__ import annotations

import os

__all__ = ["VARIABLES", "read", "recorded"]

# name -> what it changes (and its default)
VARIABLES: dict[str, str] = {
    "KVMEM_CACHE": "where converted models and projection tables are kept (default ~/.cache/kvmem)",
    "KVMEM_PREFETCH": "1: the corpus is read ahead in a thread, 0: not (default: on a GPU only); the tables "
                      "are the same",
    "KVMEM_DIST_TIMEOUT": "seconds the processes of a torchrun scan wait for each other (default 7200)",
}


def read(name: str) -> str | None:
    """The variable's value, stripped, or None where it is unset or empty."""
    if name not in VARIABLES:
        raise ValueError(f"{name} is not one of kvmem's environment variables ({', '.join(VARIABLES)})")
    value = os.environ.get(name, "").strip()
    return value or None


def recorded() -> dict[str, str]:
    """The variables of :data:`VARIABLES` that are set now, with their values (for a manifest)."""
    return {name: value for name in VARIABLES if (value := read(name)) is not None}
