"""Trigger and sample contexts: 12 tokens before and 4 after the kept token, cut at the edges of the
window the model read, never across a window boundary. Windows here are longer than a context
(24 and 40 tokens against 17), so the limits themselves are reached, not only the window's edges.

Oracle: plain HF forwards of [BOS] + window with a pre-hook on the down projection (tests/hf_oracle.py),
windows cut by hand from the tokenizer's ids, and the context text decoded by the tokenizer. A window's
first token is read but not scored (the scan's default), so a context starts at its second token at the
earliest.
"""

from __future__ import annotations

from pydoc_data.topics import topics

import numpy as np
import pytest
from hf_oracle import windows

import kvmem

BEFORE, AFTER = 12, 4  # the documented context (README: 12 tokens before, 4 after)
SKIP = 1  # tokens of each window read, not scored
DOCS = [topics["assert"][:500], topics["pass"][:300], topics["del"][:420], "A short document."]


@pytest.fixture(scope="module", params=[24, 40], ids=["window24", "window40"])
def scanned(request, gpt2_model, tmp_path_factory):
    window = request.param
    read = windows(gpt2_model, DOCS, window=window)
    tokens = sum(len(w.ids) - SKIP for w in read)
    # every position is a top and a bottom trigger of every neuron, and in the random sample
    atlas = kvmem.scan(gpt2_model, DOCS, out=tmp_path_factory.mktemp("ctx") / "a", window=window, top_k=tokens,
                       layers=[1], random_samples=tokens, bin_samples=0, top_n=2, key_projections=False,
                       conventions=("raw",), batch_size=4, progress=False)
    return window, read, tokens, atlas


def expected_context(read, window: int, doc: int, pos: int, neuron: int, layer: int = 1):
    """(first context position, token ids, coefficients) of (doc, pos), from the oracle's windows."""
    w = next(w for w in read if w.doc == doc and w.start == pos - pos % window)
    at = pos - w.start
    c0, c1 = max(SKIP, at - BEFORE), min(len(w.ids), at + AFTER + 1)
    return w.start + c0, w.ids[c0:c1], w.coefficients[layer][c0:c1, neuron], at - c0


def check_rows(gpt2_model, read, window, frame, neuron_of) -> dict[str, int]:
    """Compare every row's context with the oracle; count the kinds of edge the rows reached."""
    seen = {"full": 0, "cut_before_at_window_start": 0, "cut_after_at_window_end": 0, "later_window": 0,
            "first_of_window": 0, "last_of_window": 0}
    for row in frame.itertuples():
        start, ids, coefficients, trigger = expected_context(read, window, row.doc, row.pos, neuron_of(row))
        tokens = list(row.context_tokens)
        assert len(tokens) == len(ids), (row.doc, row.pos, len(tokens), len(ids))
        assert row.context_trigger == trigger
        assert "".join(tokens) == gpt2_model.tokenizer.decode(ids) == row.context
        np.testing.assert_allclose(np.asarray(row.context_activations), coefficients, rtol=1e-5, atol=1e-6)
        at = row.pos % window
        length = next(len(w.ids) for w in read if w.doc == row.doc and w.start == row.pos - at)
        seen["full"] += len(ids) == BEFORE + 1 + AFTER
        seen["cut_before_at_window_start"] += at - SKIP < BEFORE
        seen["cut_after_at_window_end"] += at > length - 1 - AFTER
        seen["later_window"] += row.pos >= window
        seen["first_of_window"] += at == SKIP  # the first scored token
        seen["last_of_window"] += at == length - 1
    return seen


def test_trigger_contexts_keep_12_before_and_4_after_inside_the_window(gpt2_model, scanned):
    window, read, tokens, atlas = scanned
    for neuron in (0, 131):
        for kind in ("top", "bottom"):
            frame = atlas.triggers(1, neuron, kind=kind)
            assert len(frame) == tokens  # every position, so every edge case below is reached
            seen = check_rows(gpt2_model, read, window, frame, lambda row, n=neuron: n)
            assert all(count > 0 for count in seen.values()), seen


def test_sample_contexts_follow_the_same_limits(gpt2_model, scanned):
    window, read, tokens, atlas = scanned
    frame = atlas.samples(1, 77, kind="random")
    assert len(frame) == tokens
    seen = check_rows(gpt2_model, read, window, frame, lambda row: 77)
    assert all(count > 0 for count in seen.values()), seen
