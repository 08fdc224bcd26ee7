"""Run the model with FFN coefficient hooks that are always removed, and stop early.

The hooks live only inside :func:`capture_coefficients`; TransformerLens removes them in
``finally`` when the context exits, also after an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from kvmem.models import Model

__all__ = ["capture_coefficients"]


class _StopForward(Exception):
    """Raised by the hook of the last needed layer: nothing after it is computed."""


def capture_coefficients(model: Model, input_ids: Tensor, layers: Sequence[int],
                         on_coefficients: Callable[[int, Tensor], None]) -> None:
    """Run the model on input_ids [batch, pos]; call ``on_coefficients(layer, m)`` with the
    coefficients m [batch, pos, d_ff] (hook ``blocks.L.mlp.hook_post``) of each layer in ``layers``.

    The forward stops right after the last requested layer's coefficients: the rest of the network
    (that W2, later blocks, final norm, unembedding) is never computed.
    """
    last = max(layers)

    def make_hook(layer: int):
        def hook(tensor: Tensor, hook) -> Tensor:  # noqa: ARG001 - TransformerLens signature
            on_coefficients(layer, tensor.detach())
            if layer == last:
                raise _StopForward
            return tensor

        return hook

    hooks = [(model.hook_name(layer, "post"), make_hook(layer)) for layer in layers]
    with torch.inference_mode(), model.bridge.hooks(fwd_hooks=hooks):
        try:
            model.bridge(input_ids.to(model.device), return_type=None)
        except _StopForward:
            pass
