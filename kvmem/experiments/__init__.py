"""Geva et al. (2021) measurements as functions: each returns a DataFrame with its provenance in ``frame.attrs``.

The experiments, their plot functions and whether they need the model are listed once, in
:data:`kvmem.experiments.registry.EXPERIMENTS` (``kvmem experiment NAME`` reads it too). The
faithful reproduction of all of them into a results directory is :func:`reproduce_geva2021`;
:func:`load_results` reads such a directory back for plotting. The metrics' cores are pure
functions (:func:`agreement_from_frames`, :func:`pair_ranks`, :func:`summarize_ranks`,
:func:`summarize_token_removal`, :func:`active_fractions`, :func:`memory_agreement`, and the
statistics in :mod:`kvmem.experiments.stats`). Submodules load on first use.
"""

from importlib import import_module
from typing import Any

from kvmem.experiments.registry import EXPERIMENTS, SUPPORT_MODULES


def _modules() -> list[str]:
    return list(dict.fromkeys([e.module for e in EXPERIMENTS.values()] + list(SUPPORT_MODULES)))


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return sorted({"EXPERIMENTS", *(n for m in _modules() for n in import_module(f"kvmem.experiments.{m}").__all__)})
    if name.startswith("_"):
        raise AttributeError(f"module 'kvmem.experiments' has no attribute {name!r}")
    for module_name in _modules():
        module = import_module(f"kvmem.experiments.{module_name}")
        if name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'kvmem.experiments' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __getattr__("__all__")
