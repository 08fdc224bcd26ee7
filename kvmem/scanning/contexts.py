"""After the pass: give every kept trigger its text, once per distinct position.

The corpus is streamed a second time; only documents that hold a trigger are tokenized again.
Context is clipped to the window the model read (the model saw nothing outside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvmem.corpus import Corpus
from kvmem.models import Model
from kvmem.scanning.capture import capture_coefficients

__all__ = ["TriggerText", "trigger_texts", "context_activations"]


@dataclass
class TriggerText:
    """Text of one distinct (doc, pos)."""

    doc_id: str
    token_id: int
    next_token_id: int  # -1 at the end of the document
    context: str
    span: tuple[int, int]
    pieces: list[str]  # context split into tokens
    trigger_index: int  # index of the trigger token in pieces
    context_start: int  # document position of pieces[0]
    window_start: int
    window_end: int


def _pieces(text: str, offsets: list[tuple[int, int]], start: int, stop: int) -> list[str]:
    """Context pieces for tokens start..stop-1 whose concatenation is the original text slice;
    the whitespace before a token belongs to it."""
    pieces, cursor = [], offsets[start][0]
    for j in range(start, stop):
        end = max(offsets[j][1], cursor)
        pieces.append(text[cursor:end])
        cursor = end
    return pieces


def trigger_texts(model: Model, corpus: Corpus, positions: set[tuple[int, int]], *, window: int,
                  before: int, after: int, shard: tuple[int, int]) -> dict[tuple[int, int], TriggerText]:
    """(doc, pos) -> TriggerText for every requested position."""
    by_doc: dict[int, list[int]] = {}
    for doc, pos in positions:
        by_doc.setdefault(doc, []).append(pos)
    fast = getattr(model.tokenizer, "is_fast", False)
    out: dict[tuple[int, int], TriggerText] = {}
    index, count = shard
    for document in corpus:
        if document.index % count != index or document.index not in by_doc:
            continue
        if fast:
            encoded = model.tokenizer(document.text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = encoded["input_ids"], [tuple(o) for o in encoded["offset_mapping"]]
        else:
            ids, offsets = model.encode(document.text), None
        for pos in by_doc.pop(document.index):
            w0 = (pos // window) * window
            w1 = min(w0 + window, len(ids))
            c0, c1 = max(w0, pos - before), min(w1, pos + after + 1)
            if offsets is not None:
                pieces = _pieces(document.text, offsets, c0, c1)
            else:
                pieces = [model.token_str(t) for t in ids[c0:c1]]
            trigger = pos - c0
            span_start = sum(len(p) for p in pieces[:trigger])
            out[(document.index, pos)] = TriggerText(
                doc_id=document.id, token_id=ids[pos], next_token_id=ids[pos + 1] if pos + 1 < len(ids) else -1,
                context="".join(pieces), span=(span_start, span_start + len(pieces[trigger])), pieces=pieces,
                trigger_index=trigger, context_start=c0, window_start=w0, window_end=w1)
        if not by_doc:
            break
    return out


def _capture_all(model: Model, ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """Coefficients [batch, pos, d_ff] of each layer, on the CPU in float32."""
    captured: dict[int, torch.Tensor] = {}
    capture_coefficients(model, ids, layers, lambda layer, m: captured.__setitem__(layer, m.float().cpu()))
    return captured


def context_activations(model: Model, corpus: Corpus, texts: dict[tuple[int, int], TriggerText], unique: np.ndarray,
                        inverse: np.ndarray, layer: np.ndarray, neuron: np.ndarray, *, prepend_bos: bool,
                        batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """m_i of each trigger's own neuron at each of its context tokens, recomputed window by window.

    unique [U, 2] distinct (doc, pos); inverse [T] maps each trigger to its row of unique;
    layer, neuron [T]. Returns (values [T, max_len] float32 padded with NaN, lengths [T]).
    """
    infos = [texts[(int(d), int(p))] for d, p in unique]
    w_start = np.array([t.window_start for t in infos], np.int64)
    bos = model.bos_token_id if prepend_bos else None
    offset = 1 if bos is not None else 0
    first_u = np.array([t.context_start for t in infos], np.int64) - w_start + offset
    length_u = np.array([len(t.pieces) for t in infos], np.int64)
    window_key_u = unique[:, 0].astype(np.int64) * (1 << 32) + w_start
    window_end = {int(k): t.window_end for k, t in zip(window_key_u, infos)}

    key, first, length = window_key_u[inverse], first_u[inverse], length_u[inverse]
    width = int(length.max()) if len(length) else 0
    values = np.full((len(key), width), np.nan, np.float32)
    windows = np.unique(key)
    needed = {int(k >> 32) for k in windows}
    tokens: dict[int, list[int]] = {}
    for document in corpus:
        if document.index in needed:
            tokens[document.index] = model.encode(document.text)
            if len(tokens) == len(needed):
                break
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    steps = np.arange(width)
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size]
        rows = [([bos] if bos is not None else []) + tokens[int(k >> 32)][int(k & 0xFFFFFFFF):window_end[int(k)]]
                for k in chunk]
        ids = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.int64)  # [batch, pos]
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        members = order[np.searchsorted(sorted_key, chunk[0]):np.searchsorted(sorted_key, chunk[-1], side="right")]
        wanted = sorted(set(layer[members].tolist()))
        captured = _capture_all(model, ids, wanted)
        for lay in wanted:
            sel = members[layer[members] == lay]
            row = torch.from_numpy(np.searchsorted(chunk, key[sel]))
            at = torch.from_numpy(np.minimum(first[sel][:, None] + steps[None], ids.shape[1] - 1))
            got = captured[lay][row[:, None], at, torch.from_numpy(neuron[sel].astype(np.int64))[:, None]]
            values[sel] = got.numpy()
    values[steps[None] >= length[:, None]] = np.nan
    return values, length
