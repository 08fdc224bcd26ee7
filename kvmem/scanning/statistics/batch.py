"""One batch as every statistic reads it: the batch's layout, read from the device once before the
forward (:class:`BatchLayout`), each position's place in its window (:class:`Positions`), and one layer's
coefficients with everything a statistic's update needs (:class:`LayerBatch`).

A statistic whose update needs a size from the device (how many candidates enter a side) hands that
work to ``batch.reads`` as a pending step (:mod:`kvmem.scanning.reads`); the step runs a layer's
updates inside ``reads.collecting()``, so their reads share one synchronisation per round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvmem.scanning.ordering import EMPTY
from kvmem.scanning.reads import Reads

__all__ = ["ContextFn", "RowContextFn", "Documents", "Positions", "BatchLayout", "LayerBatch", "ScanBatch", "to_device"]

# (flat row indices [c], neuron indices [c]) -> coefficients of that neuron around each row [c, width]
ContextFn = Callable[[Tensor, Tensor], Tensor]
# flat row indices [m] -> every neuron's coefficients around each row [m, width, F]
RowContextFn = Callable[[Tensor], Tensor]


def to_device(array: np.ndarray, device) -> Tensor:
    """A host array on ``device`` without waiting: on CUDA through pinned memory, a copy queued on
    the current stream (a copy from pageable memory makes the host wait for the device)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class Documents(NamedTuple):
    """A batch's documents, laid out once per batch for every layer: document s is rows starts[s] ..
    starts[s] + lengths[s] - 1 of acts [N, F] (in order; on the device). ``longest_complete``: the
    most rows of a document but the last; ``last_length``: the last one's rows (host integers)."""

    starts: Tensor
    lengths: Tensor
    longest_complete: int
    last_length: int

    @property
    def count(self) -> int:
        return self.starts.shape[0]

    @classmethod
    def of(cls, lengths, device) -> Documents:
        """From the documents' lengths in rows (host integers, in order), one copy to ``device``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        parts = to_device(np.concatenate([np.cumsum(lengths) - lengths, lengths]), device)
        s = len(lengths)
        return cls(parts[:s], parts[s:], int(lengths[:-1].max()) if s > 1 else 0, int(lengths[-1]))


class Positions(NamedTuple):
    """Each scored position's place in its window, ``index`` [N] float32 (0 = the window's first token,
    read or not; exact integers), and Σ index, Σ index² over the batch (Python integers)."""

    index: Tensor
    total: int
    total_sq: int

    @classmethod
    def of(cls, lengths: list[int], device, leads: list[int] | None = None) -> Positions:
        """The scored positions of windows of ``lengths`` tokens whose first ``leads`` are not scored, laid
        out one after the other."""
        leads = leads or [0] * len(lengths)
        index = (torch.cat([torch.arange(s, n, dtype=torch.float32) for n, s in zip(lengths, leads)]) if lengths
                 else torch.empty(0))

        def sums(n: int) -> tuple[int, int]:  # Σ p and Σ p² over p = 0..n-1
            return n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6

        total = sum(sums(n)[0] - sums(s)[0] for n, s in zip(lengths, leads))
        total_sq = sum(sums(n)[1] - sums(s)[1] for n, s in zip(lengths, leads))
        return cls(index.to(device), total, total_sq)


class BatchLayout(NamedTuple):
    """What every layer of one batch shares, read from the device once (before the forward):

    ``first_doc``, ``last_doc``: the documents of its first and last rows; ``documents``: each
    document's rows (None unless a statistic asked for them); ``ranked`` [p]: the rows with the p
    smallest sampling keys, by (key, code), with their ``ranked_keys`` and ``ranked_codes`` [p], where
    the first ``thinned`` are the positions the bin samples draw from (key < limit) and the first
    ``random`` the only ones that can enter a random sample of that size."""

    first_doc: int
    last_doc: int
    documents: Documents | None
    ranked: Tensor | None
    ranked_keys: Tensor | None
    ranked_codes: Tensor | None
    thinned: int
    random: int

    @classmethod
    def read(cls, codes: Tensor, docs: Tensor | None, keys: Tensor | None, *, documents: bool, random_size: int,
             bin_limit: int | None) -> BatchLayout:
        """The layout of a batch (one device-to-host read). ``documents``: lay out its documents;
        ``random_size``: the random sample's size (0: none); ``bin_limit``: the key below which a position
        enters the bin samples' draw (None: no bin samples)."""
        samples = random_size > 0 or bin_limit is not None
        if documents and docs is None:
            raise ValueError("per-document statistics need the batch's documents (docs)")
        if samples and keys is None:
            raise ValueError("samples need the positions' sampling keys (keys)")
        wanted = ([docs] if documents else []) + ([keys, codes] if samples else [])
        host = torch.stack(wanted).cpu().numpy() if wanted else None  # the batch's one read
        laid_out, first_doc, last_doc = None, EMPTY, EMPTY
        if documents:
            doc = host[0]
            ends = np.flatnonzero(doc[1:] != doc[:-1]) + 1
            laid_out = Documents.of(np.diff(np.concatenate([[0], ends, [doc.size]])), codes.device)
            first_doc, last_doc = int(doc[0]), int(doc[-1])
        ranked = ranked_keys = ranked_codes = None
        thinned = random = 0
        if samples:
            host_keys, host_codes = host[-2], host[-1]
            order = np.lexsort((host_codes, host_keys))  # by key, then code (every code here is a position's)
            if bin_limit is not None:
                thinned = int(np.searchsorted(host_keys[order], bin_limit, side="left"))
            random = min(random_size, order.size)
            ranked = to_device(order[:max(thinned, random)], codes.device)
            ranked_keys, ranked_codes = keys.index_select(0, ranked), codes.index_select(0, ranked)
        return cls(first_doc, last_doc, laid_out, ranked, ranked_keys, ranked_codes, thinned, random)


@dataclass
class LayerBatch:
    """One batch of one layer, as every statistic's update reads it.

    ``acts`` [N, F] float32: the scored positions in reading order; ``codes`` [N] int64; ``ordered``: the
    codes increase along the batch and exceed every code folded in before (ties can then never enter);
    ``context``: each candidate's context coefficients (then its gate and up pre-activations when the
    scan keeps them, :attr:`LayerSpec.extras`); ``row_context``: the same for every neuron of whole rows;
    ``layout``: the batch's :class:`BatchLayout`;
    ``positions``: each row's place in its window; ``gate_up``: the gate and up pre-activations [N, F]
    (when a statistic asked for them); ``reads``: where updates defer their device reads. A statistic
    may leave ``finite``, a 0-dim bool tensor that is True exactly when every coefficient is finite.
    """

    acts: Tensor
    codes: Tensor
    ordered: bool
    context: ContextFn
    row_context: RowContextFn
    layout: BatchLayout
    reads: Reads
    positions: Positions | None = None
    gate_up: tuple[Tensor, Tensor] | None = None
    finite: Tensor | None = field(default=None, repr=False)


@dataclass
class ScanBatch:
    """What a scan-wide statistic reads of one batch: ``tokens`` [N] int64 (CPU), the token at each scored
    position."""

    tokens: Tensor
