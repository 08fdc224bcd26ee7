"""Project value and key vectors through the vocabulary, in blocks (the full score matrix never exists).

For GPT-2 small the values' score matrix would be 36,864 × 50,257 floats (7.4 GB); here at
most ``block`` rows × vocab are alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.models import Model

__all__ = ["Projection", "project_rows", "value_vectors", "key_vectors"]


@dataclass(frozen=True)
class Projection:
    """Top and bottom ``n`` tokens per row. All [rows, n]: ids int64, scores float32."""

    top_ids: Tensor
    top_scores: Tensor
    bottom_ids: Tensor
    bottom_scores: Tensor


def project_rows(vectors: Tensor, basis: Tensor, n: int, *, block: int = 512) -> Projection:
    """scores = vectors [rows, d_model] @ basis [d_model, vocab]; keep the n highest and lowest per row."""
    n = min(n, basis.shape[1])
    parts: list[tuple[Tensor, ...]] = []
    basis = basis.float()
    with torch.inference_mode():
        for start in range(0, vectors.shape[0], block):
            scores = vectors[start:start + block].float() @ basis  # [block, vocab]
            top = torch.topk(scores, n, dim=1)
            bottom = torch.topk(scores, n, dim=1, largest=False)
            parts.append((top.indices, top.values, bottom.indices, bottom.values))
    return Projection(*(torch.cat([p[i] for p in parts]).cpu() for i in range(4)))


def value_vectors(model: Model, layer: int, convention: str) -> Tensor:
    """Value vectors of a layer as the convention reads them [d_ff, d_model]."""
    values = model.values(layer).float()
    if convention == "raw":
        return values
    if convention == "final_norm":
        return model.final_norm().linear_part(values).float()
    raise ValueError(f"unknown convention {convention!r}")


def key_vectors(model: Model, layer: int) -> dict[str, Tensor]:
    """{'key': W1 / W_up rows, 'gate': W_gate rows (gated only)}, each [d_ff, d_model]."""
    vectors = {"key": model.keys(layer)}
    gate = model.gate_keys(layer)
    if gate is not None:
        vectors["gate"] = gate
    return vectors
