"""The coefficients m of chosen layers, by layer number: :func:`kvmem.capture.capture` on ``hook_post``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvmem.capture import capture

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.models import Model

__all__ = ["capture_coefficients"]


def capture_coefficients(model: Model, input_ids: Tensor, layers: Sequence[int],
                         on_coefficients: Callable[[int, Tensor], None]) -> None:
    """Run the model on input_ids [batch, pos]; call ``on_coefficients(layer, m)`` with the
    coefficients m [batch, pos, d_ff] (hook ``blocks.L.mlp.hook_post``) of each layer in ``layers``.

    The forward stops right after the last requested layer's coefficients.
    """
    layer_of = {model.hook_name(layer, "post"): layer for layer in layers}
    capture(model, input_ids, list(layer_of), on_capture=lambda name, m: on_coefficients(layer_of[name], m))
