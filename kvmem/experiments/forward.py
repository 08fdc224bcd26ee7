"""Run the model on many short sequences and read a few positions at chosen hooks, batch by batch.

Sequences are sorted by length and right-padded (causal attention: padding after a position never
changes it) into batches of at most ``batch_tokens`` padded tokens. Hooks gather only the requested
positions, so per batch at most reads × d_ff numbers are kept, and the forward stops as soon as
every requested hook has fired (no logits are computed). Hooks live only inside
``model.bridge.hooks`` and are removed when it exits, also after an exception.

Also here: the tokenization rule of :mod:`kvmem.corpus` as a list of windows, and uniform sampling
of corpus positions from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvmem.errors import KvmemError

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.corpus import Corpus, Window
    from kvmem.models import Model

__all__ = ["Sampled", "corpus_windows", "read_positions", "sample_positions", "tokenization_settings"]


class _Stop(Exception):
    """Raised once every requested hook has fired: the rest of the forward is skipped."""


def read_positions(model: Model, sequences: Sequence[Sequence[int]], reads: Sequence[Sequence[int]],
                   hook_names: Sequence[str], on_batch: Callable[[np.ndarray, dict[str, Tensor]], None], *,
                   batch_tokens: int = 4096) -> None:
    """Read ``hook_names`` at positions ``reads[s]`` of each sequence ``sequences[s]``.

    ``on_batch(read_index [n], {hook: [n, d]})`` is called once per batch; read_index numbers the
    reads in the flattened order of ``reads`` (sequence by sequence). Tensors are float32 on the CPU.
    """
    import torch

    hook_dict = model.bridge.hook_dict
    missing = [name for name in hook_names if name not in hook_dict]
    if missing:
        raise KvmemError(f"this model's bridge has no hook {missing[0]}; available sites are {model.hook_name(0, 'post')}, "
                         f"... (see model.bridge.hook_dict)")
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
        row_t, col_t = torch.tensor(rows), torch.tensor(cols)
        captured: dict[str, Tensor] = {}

        def make_hook(name: str, captured: dict[str, Tensor], row_t: Tensor, col_t: Tensor):
            def hook(tensor: Tensor, hook) -> Tensor:  # tensor [batch, pos, d]; TransformerLens passes the hook too
                captured[name] = tensor[row_t.to(tensor.device), col_t.to(tensor.device)].detach().float().cpu()  # [n, d]
                if len(captured) == len(hook_names):
                    raise _Stop
                return tensor

            return hook

        hooks = [(name, make_hook(name, captured, row_t, col_t)) for name in hook_names]
        with torch.inference_mode(), model.bridge.hooks(fwd_hooks=hooks):
            try:
                model.bridge(ids.to(model.device), return_type=None)
            except _Stop:
                pass
        if len(captured) != len(hook_names):
            lost = sorted(set(hook_names) - set(captured))
            raise KvmemError(f"hook(s) {lost} never fired in the forward pass; this bridge does not run them")
        on_batch(np.asarray(index, np.int64), captured)


def tokenization_settings(model: Model, *, window: int | None, prepend_bos: bool) -> tuple[int, int | None]:
    """(window, bos id or None) as :func:`kvmem.scan` resolves them (window None: min(context, 256))."""
    if prepend_bos and model.bos_token_id is None:
        raise KvmemError(f"the tokenizer of {model.name} has no BOS token; pass prepend_bos=False")
    limit = (model.n_ctx or 256) - (1 if prepend_bos else 0)
    window = window or min(256, limit)
    if window < 1 or window > limit:
        raise KvmemError(f"window must lie in 1..{limit} for this model, got {window}")
    return window, (model.bos_token_id if prepend_bos else None)


def corpus_windows(model: Model, corpus: Corpus, *, window: int, max_tokens: int | None) -> list[Window]:
    """The windows :func:`kvmem.scan` reads, in order, cut after ``max_tokens`` tokens (None: whole corpus)."""
    from kvmem.corpus import Window, windows

    out, total = [], 0
    for item in windows(corpus, model.encode, window):
        if max_tokens is not None and total + len(item.tokens) > max_tokens:
            if max_tokens - total > 0:
                out.append(Window(item.doc, item.start, item.tokens[:max_tokens - total]))
            break
        out.append(item)
        total += len(item.tokens)
    if not out:
        raise KvmemError(f"corpus {corpus.spec!r} gave no tokens; check the corpus")
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


def sample_positions(model: Model, corpus: Corpus, *, positions: int, seed: int, window: int | None = None,
                     prepend_bos: bool = True, max_tokens: int | None = None) -> Sampled:
    """``positions`` distinct token positions drawn uniformly (seeded) from the corpus's first ``max_tokens``
    tokens, tokenized by the scan's rule; each is read with the prefix of its window the model sees."""
    window, bos = tokenization_settings(model, window=window, prepend_bos=prepend_bos)
    items = corpus_windows(model, corpus, window=window, max_tokens=max_tokens)
    lengths = np.array([len(w.tokens) for w in items], np.int64)
    total = int(lengths.sum())
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=min(positions, total), replace=False))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    which = np.searchsorted(starts, chosen, side="right") - 1  # window of each sampled position
    offset = chosen - starts[which]
    extra = 0 if bos is None else 1
    sequences, reads, doc, pos = [], [], [], []
    for w in np.unique(which):
        item = items[int(w)]
        at = offset[which == w]
        sequences.append(([bos] if bos is not None else []) + list(item.tokens[:int(at.max()) + 1]))
        reads.append((at + extra).tolist())
        doc += [item.doc] * len(at)
        pos += (item.start + at).tolist()
    return Sampled(sequences, reads, np.asarray(doc, np.int64), np.asarray(pos, np.int64), total)
