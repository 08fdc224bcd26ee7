"""The one registry of experiments: adding one is a new module plus one line in :data:`EXPERIMENTS`.

The ``kvmem experiment`` command reads its choices, help and the model requirement from here, and
passes each command-line option to the function parameter of the same name (see
:mod:`kvmem.cli.experiment_cmd`); ``kvmem.experiments`` finds public names in the registered modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

__all__ = ["EXPERIMENTS", "Experiment", "SUPPORT_MODULES"]


@dataclass(frozen=True)
class Experiment:
    """One measurement: its command name, where its function and plot live, whether it needs the model."""

    name: str  # command-line name, e.g. "next-token-rank"
    module: str  # submodule of kvmem.experiments
    function: str  # returns a DataFrame with provenance in .attrs
    plot: str | None  # plot function of that frame (frame, *, ax=None) -> Axes, or None
    needs_model: bool  # False: answered from the atlas alone
    help: str  # one line for the command's help

    def load(self) -> Callable:
        return getattr(import_module(f"kvmem.experiments.{self.module}"), self.function)

    def load_plot(self) -> Callable | None:
        return None if self.plot is None else getattr(import_module(f"kvmem.experiments.{self.module}"), self.plot)


EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    Experiment("agreement", "value_agreement", "agreement", "plot_agreement", False,
               "value's top token = the triggers' next token (sec. 4), with its exact permutation null"),
    Experiment("next-token-rank", "ranks", "next_token_rank", "plot_next_token_rank", True,
               "rank of the triggers' next token in the memory's distribution (fig. 5), pooled and top-1"),
    Experiment("token-removal", "removal", "token_removal", "plot_token_removal", True,
               "coefficient change when the first, last or a random prefix token is removed (sec. 3.2)"),
    Experiment("active-memories", "active", "active_memories", "plot_active_memories", True,
               "fraction of memories active at random positions (sec. 5.1)"),
    Experiment("layer-vs-memories", "layer_prediction", "layer_vs_memories", "plot_layer_vs_memories", True,
               "the layer's prediction against every memory's (sec. 5), as released, and variants"),
    Experiment("lm-quality", "quality", "lm_quality", None, True,
               "perplexity and next-token accuracy of the model on the scanned text, per BOS choice"),
    Experiment("geva2021", "reproduce", "reproduce_geva2021", None, True,
               "every measurement with the released code's settings, saved to a results directory (--out DIR)"),
)}

# modules with public helpers but no experiment of their own
SUPPORT_MODULES = ("argument_checks", "signed_memories", "atlas_inputs", "result_provenance", "percent_axes", "stats", "forward",
                   "results", "registry")
