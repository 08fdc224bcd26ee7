"""The coefficients m of chosen layers, by layer number (:func:`kvmem.capture.capture_ffn`: the input
of each down projection in the HF model's own forward); for gated FFNs, optionally the gate and up
pre-activations too (sites ``pre`` and ``pre_linear``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvmem.capture import capture_ffn

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.models import Model

__all__ = ["GATE_UP_SITES", "capture_coefficients", "has_gate_up"]

# the pre-activations of a gated FFN, as hook sites: W_gate x, then W_up x   [batch, pos, d_ff] each
GATE_UP_SITES = ("pre", "pre_linear")


def has_gate_up(model: Model) -> bool:
    """Whether ``model``'s FFN is gated, so that it has gate and up pre-activations to read: the
    outputs of its gate and up projections (halves of Phi-3's fused gate_up_proj), which equal the
    bridge's ``hook_pre`` and ``hook_pre_linear`` (tests/test_capture_ffn.py, every gated row)."""
    return model.gated


def capture_coefficients(model: Model, input_ids: Tensor, layers: Sequence[int],
                         on_coefficients: Callable[[int, Tensor], None], *,
                         on_gate_up: Callable[[int, str, Tensor], None] | None = None) -> None:
    """Run the model on input_ids [batch, pos]; call ``on_coefficients(layer, m)`` with the
    coefficients m [batch, pos, d_ff] (the input of the down projection) of each layer in ``layers``.

    ``on_gate_up(layer, site, tensor)``: also called with each layer's gate (site ``pre``) and up
    (``pre_linear``) pre-activations [batch, pos, d_ff], both before that layer's coefficients
    (gated models only, see :func:`has_gate_up`). The forward stops right after the last requested
    layer's coefficients.
    """
    sites = [(layer, "post") for layer in layers]
    if on_gate_up is not None:
        sites += [(layer, site) for layer in layers for site in GATE_UP_SITES]

    def on_capture(layer: int, site: str, tensor: Tensor) -> None:
        if site == "post":
            on_coefficients(layer, tensor)
        else:
            on_gate_up(layer, site, tensor)

    capture_ffn(model, input_ids, sites, on_capture)
