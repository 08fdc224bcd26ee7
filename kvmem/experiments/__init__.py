"""Geva et al. (2021) measurements as functions: each returns a DataFrame with its provenance in ``frame.attrs``.

========================  =============================================  ===========================
experiment                function (plot)                                 needs
========================  =============================================  ===========================
agreement                 :func:`agreement` (:func:`plot_agreement`)      atlas
next-token-rank           :func:`next_token_rank` (``plot_...``)          atlas + model
token-removal             :func:`token_removal` (``plot_...``)            atlas + model (+ corpus)
active-memories           :func:`active_memories` (``plot_...``)          model + corpus (or atlas)
layer-vs-memories         :func:`layer_vs_memories` (``plot_...``)        model + corpus (or atlas)
========================  =============================================  ===========================

The metrics' cores are pure functions of frames and tensors (:func:`agreement_from_frames`,
:func:`pair_ranks`, :func:`summarize_ranks`, :func:`summarize_token_removal`, :func:`active_fractions`,
:func:`memory_agreement`). Submodules load on first use.
"""

from importlib import import_module
from typing import Any

# public name -> submodule of kvmem.experiments
_LAZY = {
    "agreement": "value_agreement", "agreement_from_frames": "value_agreement", "plot_agreement": "value_agreement",
    "next_token_rank": "ranks", "next_token_ranks": "ranks", "pair_ranks": "ranks", "summarize_ranks": "ranks",
    "plot_next_token_rank": "ranks",
    "token_removal": "removal", "token_removal_samples": "removal", "summarize_token_removal": "removal",
    "relative_change": "removal", "plot_token_removal": "removal",
    "active_memories": "active", "active_fractions": "active", "plot_active_memories": "active",
    "layer_vs_memories": "composition", "memory_agreement": "composition",
    "plot_layer_vs_memories": "composition",
    "model_for_atlas": "common", "check_fingerprint": "common", "FingerprintWarning": "common",
}

# CLI name -> (function, plot function)
EXPERIMENTS = {
    "agreement": ("agreement", "plot_agreement"),
    "next-token-rank": ("next_token_rank", "plot_next_token_rank"),
    "token-removal": ("token_removal", "plot_token_removal"),
    "active-memories": ("active_memories", "plot_active_memories"),
    "layer-vs-memories": ("layer_vs_memories", "plot_layer_vs_memories"),
}

__all__ = ["EXPERIMENTS", *_LAZY]  # noqa: PLE0604 - the keys of _LAZY are strings


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvmem.experiments' has no attribute {name!r}")
    # no submodule is named like a public function: importing it would shadow the function
    value = getattr(import_module(f"kvmem.experiments.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
