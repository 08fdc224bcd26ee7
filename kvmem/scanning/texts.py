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


def trigger_texts(store: TextStore, docs: np.ndarray, positions: np.ndarray, *, window: int, before: int,
                  after: int, token_str) -> list[TriggerText]:
    """TriggerText of each (docs[i], positions[i]); context clipped to the window the model read."""
    out = []
    for doc, pos in zip(docs.tolist(), positions.tolist()):
        w = store.windows[window_key(doc, pos - pos % window)]
        at = pos - w.start
        c0, c1 = max(0, at - before), min(len(w.tokens), at + after + 1)
        if w.offsets is not None:
            pieces = _pieces(w.text, w.offsets, c0, c1)
        else:
            pieces = [token_str(t) for t in w.tokens[c0:c1]]
        trigger = at - c0
        span_start = sum(len(p) for p in pieces[:trigger])
        following = w.tokens[at + 1] if at + 1 < len(w.tokens) else w.following
        out.append(TriggerText(doc_id=w.doc_id, token_id=w.tokens[at], next_token_id=following,
                               context="".join(pieces), span=(span_start, span_start + len(pieces[trigger])),
                               pieces=pieces, trigger_index=trigger, context_start=w.start + c0))
    return out
