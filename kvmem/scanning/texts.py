"""The text behind kept triggers, carried out of the single pass.

While the pass runs, every window it reads is remembered (:class:`TextStore`); windows that no
kept trigger points into any more are dropped from time to time, so memory follows the kept
triggers, not the corpus. After the pass each distinct kept position gets its context, cut
from its window: the corpus is never read or tokenized again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmem.plan import WindowText, window_key

__all__ = ["TextStore", "TriggerText", "trigger_texts"]


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


class _WindowPieces:
    """The pieces of every token of one window, cut once and shared by the contexts inside it
    (neighbouring positions share all but one of their pieces)."""

    def __init__(self, window: WindowText, token_str):
        self.window, self.token_str = window, token_str
        if window.offsets is not None:
            # the chain from the window's first token: piece j runs from cursor[j - 1] to cursor[j]
            self.pieces, self.cursors, cursor = [], [], window.offsets[0][0] if window.offsets else 0
            for _, end in window.offsets:
                end = max(end, cursor)
                self.pieces.append(window.text[cursor:end])
                self.cursors.append(end)
                cursor = end
        else:
            self.pieces = [None] * len(window.tokens)  # decoded on demand

    def context(self, c0: int, c1: int) -> list[str]:
        """Pieces of tokens c0..c1-1, as :func:`_pieces` cuts them from c0 (its first piece without the
        whitespace before it)."""
        w = self.window
        if w.offsets is None:
            for j in range(c0, c1):
                if self.pieces[j] is None:
                    self.pieces[j] = self.token_str(w.tokens[j])
            return self.pieces[c0:c1]
        start, end = w.offsets[c0]
        first_end = max(end, start)
        if first_end != self.cursors[c0]:  # offsets out of order here: the chains differ, cut this one alone
            return _pieces(w.text, w.offsets, c0, c1)
        return [w.text[start:first_end], *self.pieces[c0 + 1:c1]]


def trigger_texts(store: TextStore, docs: np.ndarray, positions: np.ndarray, *, window: int, before: int,
                  after: int, token_str) -> list[TriggerText]:
    """TriggerText of each (docs[i], positions[i]); context clipped to the window the model read."""
    out = []
    cut: dict[int, _WindowPieces] = {}
    for doc, pos in zip(docs.tolist(), positions.tolist()):
        key = window_key(doc, pos - pos % window)
        w = store.windows[key]
        at = pos - w.start
        c0, c1 = max(0, at - before), min(len(w.tokens), at + after + 1)
        pieces_of = cut.get(key)
        if pieces_of is None:
            pieces_of = cut[key] = _WindowPieces(w, token_str)
        pieces = pieces_of.context(c0, c1)
        trigger = at - c0
        span_start = sum(len(p) for p in pieces[:trigger])
        following = w.tokens[at + 1] if at + 1 < len(w.tokens) else w.following
        out.append(TriggerText(doc_id=w.doc_id, token_id=w.tokens[at], next_token_id=following,
                               context="".join(pieces), span=(span_start, span_start + len(pieces[trigger])),
                               pieces=pieces, trigger_index=trigger, context_start=w.start + c0))
    return out
