"""kvmem: read a transformer's feed-forward layers as key-value memories.

Importing kvmem is cheap: torch, transformers and pandas load on first use, with the garbage
collector paused while they do (:func:`kvmem.collector.collections_paused`).
"""

from importlib import import_module
from typing import Any

from kvmem.collector import collections_paused

__version__ = "0.1.0"

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

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvmem' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    with collections_paused():  # an import's objects live as long as the process: walking them frees nothing
        module = import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
