"""The coefficients m of chosen layers, by layer number: :func:`kvmem.capture.capture` on ``hook_post``;
for gated FFNs, optionally the gate and up pre-activations too (``hook_pre``, ``hook_pre_linear``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvmem.capture import capture

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.models import Model

__all__ = ["GATE_UP_SITES", "capture_coefficients", "has_gate_up"]

# the pre-activations of a gated FFN, as hook sites: W_gate x, then W_up x   [batch, pos, d_ff] each
GATE_UP_SITES = ("pre", "pre_linear")


def has_gate_up(model: Model) -> bool:
    """Whether ``model`` is gated and its bridge has both pre-activation hooks on every layer.

    On every gated row of :data:`kvmem.architectures.ARCHITECTURES` (Llama ... Granite, Phi-3's fused
    gate_up_proj included) ``hook_pre`` equals the HF gate projection's output and ``hook_pre_linear``
    the up projection's (tests/test_taxonomy_scan.py checks Llama against the HF modules).
    """
    if not model.gated:
        return False
    hooks = model.bridge.hook_dict
    return all(model.hook_name(layer, site) in hooks for layer in range(model.n_layers) for site in GATE_UP_SITES)


def capture_coefficients(model: Model, input_ids: Tensor, layers: Sequence[int],
                         on_coefficients: Callable[[int, Tensor], None], *,
                         on_gate_up: Callable[[int, str, Tensor], None] | None = None) -> None:
    """Run the model on input_ids [batch, pos]; call ``on_coefficients(layer, m)`` with the
    coefficients m [batch, pos, d_ff] (hook ``blocks.L.mlp.hook_post``) of each layer in ``layers``.

    ``on_gate_up(layer, site, tensor)``: also called with each layer's gate (site ``pre``) and up
    (``pre_linear``) pre-activations [batch, pos, d_ff], both before that layer's coefficients
    (gated models only, see :func:`has_gate_up`). The forward stops right after the last requested
    layer's coefficients.
    """
    sites = {model.hook_name(layer, "post"): (layer, "post") for layer in layers}
    if on_gate_up is not None:
        sites.update({model.hook_name(layer, site): (layer, site) for layer in layers for site in GATE_UP_SITES})

    def on_capture(name: str, tensor: Tensor) -> None:
        layer, site = sites[name]
        if site == "post":
            on_coefficients(layer, tensor)
        else:
            on_gate_up(layer, site, tensor)

    capture(model, input_ids, list(sites), on_capture=on_capture)
