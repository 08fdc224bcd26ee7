"""The text behind kept triggers, carried out of the single pass.

While the pass runs, every window it reads is remembered (:class:`TextStore`); windows that no
kept trigger points into any more are dropped from time to time, so memory follows the kept
triggers, not the corpus. After the pass each distinct kept position gets its context, cut
from its window: the corpus is never read or tokenized again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmem.plan import WindowText, pack

__all__ = ["TextStore", "ContextColumns", "context_columns"]


class TextStore:
    """Windows read by this process, by key (doc << 32 | start)."""

    def __init__(self, windows: dict[int, WindowText] | None = None):
        self.windows: dict[int, WindowText] = dict(windows or {})
        self._kept_after_gc = 0

    def __len__(self) -> int:
        return len(self.windows)

    def add(self, windows: list[WindowText]) -> None:
        for window in windows:
            self.windows[window.key] = window

    def needs_gc(self) -> bool:
        return len(self.windows) > max(4096, 2 * self._kept_after_gc)

    def keep_only(self, keys: set[int]) -> None:
        self.windows = {key: w for key, w in self.windows.items() if key in keys}
        self._kept_after_gc = len(self.windows)

    # ---- serialisation: plain JSON (documents' texts once each) ----
    def to_json(self) -> dict:
        texts: dict[int, list] = {}
        windows = []
        for w in sorted(self.windows.values(), key=lambda w: w.key):
            texts.setdefault(w.doc, [w.doc_id, w.text])
            windows.append([w.doc, w.start, list(w.tokens), w.following,
                            [list(o) for o in w.offsets] if w.offsets is not None else None])
        return {"documents": {str(doc): value for doc, value in texts.items()}, "windows": windows}

    @classmethod
    def from_json(cls, data: dict) -> TextStore:
        docs = {int(doc): value for doc, value in data["documents"].items()}
        windows = {}
        for doc, start, tokens, following, offsets in data["windows"]:
            doc_id, text = docs[doc]
            w = WindowText(doc, doc_id, start, tuple(tokens), following, text,
                           tuple(tuple(o) for o in offsets) if offsets is not None else None)
            windows[w.key] = w
        return cls(windows)


def _pieces(text: str, offsets, start: int, stop: int) -> list[str]:
    """Pieces for tokens start..stop-1 (window-relative) whose concatenation is the original text slice;
    the whitespace before a token belongs to it."""
    pieces, cursor = [], offsets[start][0]
    for j in range(start, stop):
        end = max(offsets[j][1], cursor)
        pieces.append(text[cursor:end])
        cursor = end
    return pieces


@dataclass
class ContextColumns:
    """The text columns of distinct positions, in the order asked (see :func:`context_columns`).
    ``pieces``: every context's tokens, flat; ``piece_counts`` [P]: how many belong to each."""

    doc_id: list[str]
    token_id: np.ndarray  # [P] int32
    next_token_id: np.ndarray  # [P] int32, -1 at the end of the document
    context: list[str]
    span_start: np.ndarray  # [P] int32, characters into the context
    span_end: np.ndarray  # [P] int32
    pieces: list[str]
    piece_counts: np.ndarray  # [P] int64
    trigger_index: np.ndarray  # [P] int16, index of the trigger token in its pieces


def context_columns(store: TextStore, docs: np.ndarray, positions: np.ndarray, *, window: int, before: int,
                    after: int, token_str, lead: int = 0) -> ContextColumns:
    """The text of each (docs[i], positions[i]): up to ``before`` tokens before it and ``after`` after,
    clipped to the scored tokens of the window the model read (its first ``lead`` tokens are read but not
    scored, so they have no coefficient to show beside them). Pieces split the context into its tokens, the whitespace
    before a token belonging to it (the first piece without it).

    Each window's pieces are cut once; a context is then a slice of the document text and a slice
    of its window's pieces (where the window's offsets run backwards, its contexts are cut alone)."""
    docs, positions = np.asarray(docs, np.int64), np.asarray(positions, np.int64)
    count = len(positions)
    starts = positions - positions % window
    keys = pack(docs, starts)  # the windows' keys (see kvmem.plan.window_key)
    token_id = np.empty(count, np.int32)
    next_id = np.empty(count, np.int32)
    span_start = np.empty(count, np.int32)
    span_end = np.empty(count, np.int32)
    trigger = np.empty(count, np.int16)
    piece_counts = np.empty(count, np.int64)
    doc_id: list[str] = []
    context: list[str] = []
    pieces: list[str] = []
    bounds = np.flatnonzero(np.diff(keys)) + 1 if count else np.empty(0, np.int64)
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), count]):
        if lo == hi:
            continue
        w = store.windows[int(keys[lo])]
        n = len(w.tokens)
        at = positions[lo:hi] - w.start
        c0, c1 = np.maximum(at - before, min(lead, n)), np.minimum(at + after + 1, n)
        tokens = np.asarray(w.tokens, np.int64)
        token_id[lo:hi] = tokens[at]
        following = np.append(tokens[1:], w.following)
        next_id[lo:hi] = following[at]
        trigger[lo:hi] = at - c0
        piece_counts[lo:hi] = c1 - c0
        doc_id.extend([w.doc_id] * (hi - lo))
        _cut_window(w, at.tolist(), c0.tolist(), c1.tolist(), token_str, context, pieces, span_start[lo:hi],
                    span_end[lo:hi])
    return ContextColumns(doc_id, token_id, next_id, context, span_start, span_end, pieces, piece_counts, trigger)


def _cut_window(w: WindowText, at: list[int], c0: list[int], c1: list[int], token_str, context: list[str],
                pieces: list[str], span_start: np.ndarray, span_end: np.ndarray) -> None:
    """Append the contexts and pieces of positions ``at`` of window ``w`` (window-relative, with their
    context bounds c0..c1-1); fill their spans."""

    def append(own: list[str], i: int, trigger: int) -> None:  # a context whose pieces were cut alone
        pieces.extend(own)
        context.append("".join(own))
        span_start[i] = sum(len(p) for p in own[:trigger])
        span_end[i] = span_start[i] + len(own[trigger])

    if w.offsets is None:  # no offsets: pieces are the decoded tokens, each decoded once when first needed
        decoded: dict[int, str] = {}
        for i, (a, lo, hi) in enumerate(zip(at, c0, c1)):
            for j in range(lo, hi):
                if j not in decoded:
                    decoded[j] = token_str(w.tokens[j])
            append([decoded[j] for j in range(lo, hi)], i, a - lo)
        return
    text, offsets = w.text, w.offsets
    # the chain from the window's first token: piece j runs from cursor[j - 1] to cursor[j]
    chain, cursors, cursor = [], [], offsets[0][0]
    for _, end in offsets:
        end = max(end, cursor)
        chain.append(text[cursor:end])
        cursors.append(end)
        cursor = end
    for i, (a, lo, hi) in enumerate(zip(at, c0, c1)):
        first, end = offsets[lo]
        if max(end, first) != cursors[lo]:  # offsets out of order here: the chains differ, cut this one alone
            append(_pieces(text, offsets, lo, hi), i, a - lo)
            continue
        pieces.append(text[first:cursors[lo]])
        pieces.extend(chain[lo + 1:hi])
        context.append(text[first:cursors[hi - 1]])
        span_start[i] = cursors[a - 1] - first if a > lo else 0
        span_end[i] = cursors[a] - first
