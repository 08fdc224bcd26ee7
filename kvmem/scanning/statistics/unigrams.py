"""The corpus's exact unigram counts over the scored positions (one per scan, with the taxonomy sums:
the token-frequency direction of the taxonomy reads it); the unigrams table. An atlas scanned without
them holds the table empty."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from kvmem.scanning.statistics.batch import ScanBatch
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic

__all__ = ["Unigrams"]


def _table(counts: np.ndarray) -> pa.Table:
    return pa.table({"token_id": np.arange(len(counts), dtype=np.int32), "count": counts.astype(np.int64)})


class Unigrams(Statistic):
    name = "unigrams"
    scope = "scan"

    @classmethod
    def wanted(cls, config, *, gated: bool) -> bool:
        return config.taxonomy_sums

    def new(self, spec: LayerSpec) -> Tensor:
        return torch.zeros(spec.vocab_size, dtype=torch.int64)  # [vocab], on the CPU

    def update(self, state: Tensor, batch: ScanBatch) -> None:
        tokens = batch.tokens.to(state.device)
        state.index_add_(0, tokens, torch.ones_like(tokens))

    def merge(self, a: Tensor, b: Tensor) -> Tensor:
        return a + b.to(a.device)

    def to_tensors(self, state: Tensor, prefix: str) -> tuple[dict[str, Tensor], dict]:
        return {"unigrams": state.cpu()}, {}

    def from_tensors(self, prefix: str, tensors: dict[str, Tensor], meta: dict) -> Tensor:
        return tensors["unigrams"].cpu()

    def scan_tables(self, state: Tensor) -> dict[str, pa.Table]:
        return {"unigrams": _table(state.cpu().numpy())}

    @classmethod
    def absent_tables(cls) -> dict[str, pa.Table]:
        return {"unigrams": _table(np.empty(0, np.int64))}
