"""JSON output: the ``kvmem.neuron/1`` dict (schema in :mod:`kvmem.report.neuron_dict`) and the ``kvmem.index/1`` index.

Files are UTF-8 with non-ASCII characters kept; strings were cleaned of lone surrogates, and NaN or
infinity never appear (they are ``null``), so any JSON parser reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvmem.report.index import INDEX_SCHEMA
from kvmem.report.safe_text import write_text

__all__ = ["dumps", "render_index", "write_neuron"]


def dumps(data: dict) -> str:
    """Strict JSON text (``allow_nan=False``), indented, ending in a newline."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False, indent=1) + "\n"


def write_neuron(record, data: dict, out: Path, stem: str) -> Path:
    """Write ``out/stem.json``: the ``kvmem.neuron/1`` dict (``record`` is not needed)."""
    path = out / f"{stem}.json"
    write_text(path, dumps(data))
    return path


def render_index(rows: list[dict], provenance: dict) -> str:
    """The ``kvmem.index/1`` document: schema, provenance and the rows."""
    return dumps({"schema": INDEX_SCHEMA, "provenance": provenance, "neurons": rows})
