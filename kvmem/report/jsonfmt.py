"""JSON output: the ``kvmem.neuron/1`` dict (schema in :mod:`kvmem.report.record`) and the ``kvmem.index/1`` index.

Files are UTF-8 with non-ASCII characters kept; strings were cleaned of lone surrogates, and NaN or
infinity never appear (they are ``null``), so any JSON parser reads them.
"""

from __future__ import annotations

import json

__all__ = ["dumps"]


def dumps(data: dict) -> str:
    """Strict JSON text (``allow_nan=False``), indented, ending in a newline."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False, indent=1) + "\n"
