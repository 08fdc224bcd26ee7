"""kvmem: read a transformer's feed-forward layers as key-value memories.

Importing kvmem is cheap: each public name below loads its module (and torch, transformers or
pandas with it) on first use. Type checkers and IDEs read the same names from the imports under
``TYPE_CHECKING``, with their real signatures.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # the names below, as type checkers and IDEs see them; _LAZY loads the same at run time
    from kvmem import anatomy, corpus, experiments, export, plots, records, report
    from kvmem.atlas import Atlas
    from kvmem.atlas import open_atlas as open
    from kvmem.autointerp import explain, score
    from kvmem.errors import KvmemError
    from kvmem.intervention import intervene
    from kvmem.loading import load_model
    from kvmem.models import Model
    from kvmem.scanning import merge, scan
    from kvmem.tracing import trace

# public name -> (module, attribute); attribute None exports the module itself
_LAZY: dict[str, tuple[str, str | None]] = {
    "KvmemError": ("kvmem.errors", "KvmemError"),
    "load_model": ("kvmem.loading", "load_model"),
    "Model": ("kvmem.models", "Model"),
    "corpus": ("kvmem.corpus", None),
    "anatomy": ("kvmem.anatomy", None),
    "scan": ("kvmem.scanning", "scan"),
    "merge": ("kvmem.scanning", "merge"),
    "open": ("kvmem.atlas", "open_atlas"),
    "Atlas": ("kvmem.atlas", "Atlas"),
    "trace": ("kvmem.tracing", "trace"),
    "intervene": ("kvmem.intervention", "intervene"),
    "plots": ("kvmem.plots", None),
    "experiments": ("kvmem.experiments", None),
    "report": ("kvmem.report", None),
    "export": ("kvmem.export", None),
    "records": ("kvmem.records", None),
    "explain": ("kvmem.autointerp", "explain"),
    "score": ("kvmem.autointerp", "score"),
    "explore": ("kvmem.explorer", "explore"),
}

__all__ = ["__version__", "KvmemError", "load_model", "Model", "corpus", "anatomy", "scan", "merge", "open", "Atlas",
           "trace", "intervene", "plots", "experiments", "report", "export", "records", "explain", "score"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvmem' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
