"""Reusable scratch tensors for loops over blocks: a block-sized tensor made once and handed out again for
each block, since a fresh tensor of tens of megabytes costs its page faults every time it is touched.

    buffers = Buffers()
    for block in blocks:
        scores = torch.matmul(a, b, out=buffers.get("scores", (rows, vocab), torch.float32))

Importing this module does not import torch.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Buffers"]


class Buffers:
    """Named scratch tensors, one per (name, dtype), grown when a larger shape is asked for. A tensor handed
    out is overwritten by the next ``get`` of the same name and dtype."""

    def __init__(self):
        self._held: dict[tuple[str, object], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype, device=None) -> torch.Tensor:
        import torch

        size = prod(shape)
        held = self._held.get((name, dtype))
        if held is None or held.numel() < size or (device is not None and held.device != torch.device(device)):
            held = self._held[(name, dtype)] = torch.empty(size, dtype=dtype, device=device)
        return held[:size].view(shape)
