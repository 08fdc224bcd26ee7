"""One layer's statistics driven batch by batch, as the scan's step drives them (kvmem.scanning.step.fold_batch),
for tests that feed chosen coefficients, codes and documents instead of a model's."""

from __future__ import annotations

import torch

from kvmem.scanning.config import ScanConfig
from kvmem.scanning.reads import Reads
from kvmem.scanning.statistics import compose
from kvmem.scanning.statistics.batch import BatchLayout, LayerBatch
from kvmem.scanning.step import fold_batch


def new_layer(d_ff: int, top_k: int, *, per_document: bool = False, context_width: int = 1, random_samples: int = 0,
              bin_samples: int = 0, sample_rate: float = 0.125, seed: int = 0, statistics: tuple[str, ...] = ()):
    """An empty layer state of the statistics a scan with these settings keeps (no taxonomy sums)."""
    config = ScanConfig(top_k=top_k, per_document=per_document, random_samples=random_samples,
                        bin_samples=bin_samples, sample_rate=sample_rate, seed=seed, taxonomy_sums=False,
                        statistics=statistics)
    composition = compose(config, gated=False)
    return composition.new_state([0], composition.spec(d_ff, 1, "cpu", context_width)).layer_states[0]


def fold(layer_state, acts, codes, context_fn, *, docs=None, keys=None, ordered: bool = True) -> bool | None:
    """Fold one batch (acts [N, F], codes [N]) -> whether every coefficient was finite (None: an empty batch)."""
    composition = layer_state.composition
    layout = (BatchLayout.read(codes, docs, keys, documents=composition.needs_documents,
                               random_size=composition.random_size, bin_limit=composition.bin_limit)
              if acts.shape[0] else None)
    d_ff = acts.shape[1]

    def row_context(rows):  # [m] -> [m, C, F]: the context of every neuron at those rows
        m = rows.numel()
        return context_fn(rows.repeat_interleave(d_ff), torch.arange(d_ff).repeat(m)).view(m, d_ff, -1).transpose(1, 2)

    flags: list = []
    fold_batch(layer_state, LayerBatch(acts.float(), codes, ordered, context_fn, row_context, layout, Reads()), flags)
    return flags[0][1] if flags else None
