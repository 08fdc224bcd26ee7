"""Run the model on many short sequences and read a few positions at chosen hooks, batch by batch.

Sequences are sorted by length and right-padded (causal attention: padding after a position never
changes it) into batches of at most ``batch_tokens`` padded tokens. Hooks gather only the requested
positions, so per batch at most reads × d_ff numbers are kept, and the forward stops as soon as
every requested hook has fired (no logits are computed): each batch is one :func:`kvmem.capture.capture`.

Also here: the windows a tokenization plan (:mod:`kvmem.plan`, the scan's own) reads, and uniform
sampling of corpus positions from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kvmem.capture import capture
from kvmem.errors import KvmemError

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.atlas import Atlas
    from kvmem.corpus import Corpus
    from kvmem.models import Model
    from kvmem.plan import TokenPlan, WindowText

__all__ = ["Sampled", "corpus_windows", "read_positions", "sample_positions", "scan_plan"]


def read_positions(model: Model, sequences: Sequence[Sequence[int]], reads: Sequence[Sequence[int]],
                   hook_names: Sequence[str], on_batch: Callable[[np.ndarray, dict[str, Tensor]], None], *,
                   batch_tokens: int = 4096) -> None:
    """Read ``hook_names`` at positions ``reads[s]`` of each sequence ``sequences[s]``.

    ``on_batch(read_index [n], {hook: [n, d]})`` is called once per batch; read_index numbers the
    reads in the flattened order of ``reads`` (sequence by sequence). Tensors are float32 on the CPU.
    Each batch is one :func:`kvmem.capture.capture` (position gather, early stop).
    """
    import torch

    counts = np.array([len(r) for r in reads], np.int64)
    first_read = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    for s, (sequence, positions) in enumerate(zip(sequences, reads)):
        if positions and (min(positions) < 0 or max(positions) >= len(sequence)):
            raise KvmemError(f"sequence {s} has {len(sequence)} tokens; cannot read position(s) {list(positions)}")
    order = sorted((s for s in range(len(sequences)) if counts[s]), key=lambda s: (len(sequences[s]), s))
    batches: list[list[int]] = []
    for s in order:
        if batches and (len(batches[-1]) + 1) * len(sequences[s]) <= batch_tokens:
            batches[-1].append(s)
        else:
            batches.append([s])
    for batch in batches:
        width = max(len(sequences[s]) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.int64)  # [batch, pos]; padding is never read
        rows, cols, index = [], [], []
        for row, s in enumerate(batch):
            ids[row, :len(sequences[s])] = torch.tensor(list(sequences[s]), dtype=torch.int64)
            rows += [row] * int(counts[s])
            cols += list(reads[s])
            index += range(first_read[s], first_read[s] + counts[s])
        captured = capture(model, ids, hook_names, positions=(torch.tensor(rows), torch.tensor(cols)))
        on_batch(np.asarray(index, np.int64), captured)


def scan_plan(model: Model, *, atlas: Atlas | None = None, window: int | None = None,
              prepend_bos: bool | None = None, max_tokens: int | None = None) -> TokenPlan:
    """The tokenization plan to read: an atlas's own (a shard atlas's shard included, so only positions
    it scanned are read), or the one :func:`kvmem.scan` uses with these settings. Settings given
    here override the atlas's."""
    from kvmem.scanning.config import ScanConfig
    from kvmem.scanning.runner import token_plan

    if atlas is None:
        config = ScanConfig(window=window, prepend_bos=True if prepend_bos is None else prepend_bos,
                            max_tokens=max_tokens)
        return token_plan(model, config)
    plan = atlas.manifest.plan  # format 1 manifests are upgraded when read (kvmem.manifest)
    changes: dict = {"shard": atlas.manifest.shard}
    if window is not None:
        changes["window"] = window
    if max_tokens is not None:
        changes["max_tokens"] = max_tokens
    if prepend_bos is not None:
        if prepend_bos and model.bos_token_id is None:
            raise KvmemError(f"the tokenizer of {model.name} has no BOS token; pass prepend_bos=False")
        changes["bos_token_id"] = model.bos_token_id if prepend_bos else None
    return replace(plan, **changes)


def corpus_windows(model: Model, corpus: Corpus, plan: TokenPlan) -> list[WindowText]:
    """The windows a scan under ``plan`` reads (its shard's only), in corpus order (not batch order)."""
    from kvmem.plan import StreamPosition, iterate_batches

    out = [w for batch in iterate_batches(corpus, model.tokenizer, plan, StreamPosition()) for w in batch.windows]
    out.sort(key=lambda w: w.key)
    if not out:
        raise KvmemError(f"corpus {corpus.spec!r} gave no tokens under this plan; check the corpus")
    return out


@dataclass(frozen=True)
class Sampled:
    """Sampled corpus positions as sequences to run: sequence s is read at ``reads[s]``.

    ``sequences[s]`` = [bos] + a window's tokens up to its last sampled position; ``doc``/``pos``
    [reads] give each read's document index and token position (flattened order of ``reads``).
    """

    sequences: list[list[int]]
    reads: list[list[int]]
    doc: np.ndarray
    pos: np.ndarray
    corpus_tokens: int


def sample_positions(model: Model, corpus: Corpus, *, positions: int, seed: int, plan: TokenPlan) -> Sampled:
    """``positions`` distinct token positions drawn uniformly (seeded) from the tokens ``plan`` scores
    (:func:`scan_plan`: a window's first ``skip_first`` tokens are read, not scored); each is read with the
    prefix of its window the model sees."""
    items = corpus_windows(model, corpus, plan)
    leads = np.array([len(w.tokens) - len(plan.scored(len(w.tokens))) for w in items], np.int64)
    lengths = np.array([len(w.tokens) for w in items], np.int64) - leads  # scored tokens of each window
    total = int(lengths.sum())
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=min(positions, total), replace=False))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    which = np.searchsorted(starts, chosen, side="right") - 1  # window of each sampled position
    offset = chosen - starts[which] + leads[which]  # index into the window
    extra = plan.offset  # index of a window's first token in the model's input
    sequences, reads, doc, pos = [], [], [], []
    for w in np.unique(which):
        item = items[int(w)]
        at = offset[which == w]
        sequences.append(plan.model_input(item.tokens[:int(at.max()) + 1]))
        reads.append((at + extra).tolist())
        doc += [item.doc] * len(at)
        pos += (item.start + at).tolist()
    return Sampled(sequences, reads, np.asarray(doc, np.int64), np.asarray(pos, np.int64), total)
