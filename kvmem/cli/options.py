"""Options that several subcommands share, parsed in one place so they behave the same everywhere.

``--layers`` (scan, export, experiment): comma-separated layers and inclusive ranges, ``0,5,10-12``.
The result is sorted and each layer appears once (``3,1-2,2`` -> [1, 2, 3]). Text that is not of this
form, a range written backwards and a value that names no layer are one-line errors
(:class:`~kvmem.errors.KvmemError`), raised when the command runs so the CLI prints them without a
traceback. Whether a layer exists is checked by each command against its model or atlas; only layers
above :data:`MAX_LAYER` are refused here, so that a typo such as ``0-99999999`` is not expanded.
"""

from __future__ import annotations

import argparse
import re

from kvmem.errors import KvmemError

__all__ = ["LAYERS_FORM", "MAX_LAYER", "add_layers_option", "parse_layers"]

LAYERS_FORM = "comma-separated layers or ranges like 0,5,10-12"
MAX_LAYER = 9_999  # far above any model's depth (a few hundred layers)
_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def parse_layers(text: str | None, *, option: str = "--layers") -> list[int] | None:
    """'0,5,10-12' -> [0, 5, 10, 11, 12] (sorted, each layer once); None -> None (every layer)."""
    if text is None:
        return None
    if not text.strip():
        raise KvmemError(f"{option} names no layer ({text!r}); give {LAYERS_FORM}, or leave {option} out for all")
    layers: set[int] = set()
    for item in text.split(","):
        found = _ITEM.fullmatch(item.strip())
        if found is None:
            raise KvmemError(f"{option} expects {LAYERS_FORM}, got {text!r} (bad part {item.strip()!r})")
        low = int(found.group(1))
        high = int(found.group(2)) if found.group(2) is not None else low
        if high < low:
            raise KvmemError(f"{option}: the range {low}-{high} runs backwards; write {high}-{low}")
        if high > MAX_LAYER:
            raise KvmemError(f"{option}: layer {high} is out of range (no model has more than {MAX_LAYER + 1:,} "
                             f"layers); layers are numbered from 0")
        layers.update(range(low, high + 1))
    return sorted(layers)


def add_layers_option(parser: argparse.ArgumentParser, help: str) -> None:
    """Add ``--layers`` (its text is kept; :func:`parse_layers` reads it when the command runs)."""
    parser.add_argument("--layers", default=None, metavar="L,L-L", help=f"{help}: {LAYERS_FORM}")
