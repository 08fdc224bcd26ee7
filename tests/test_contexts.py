"""Format 3 stores each position's text once (the contexts table); the frames atlas queries return
still carry every text column, equal to strings built here from the tokenizer and (doc, pos)."""

from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import SHORT_DOCS

import kvmem
from kvmem.schema import COLUMNS, SAMPLE_VIEW, TRIGGER_VIEW

WINDOW, BEFORE, AFTER = 8, 3, 2


@pytest.fixture(scope="module")
def atlas(gpt2_model, tmp_path_factory):
    return kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path_factory.mktemp("ctx") / "a", top_k=3, window=WINDOW,
                      batch_size=3, per_document=True, top_n=3, context_before=BEFORE, context_after=AFTER,
                      random_samples=4, bin_samples=2, progress=False)


def expected_text(model, doc: int, pos: int) -> dict:
    """The text columns of (doc, pos), from the HF tokenizer's offsets over the document."""
    text = SHORT_DOCS[doc]
    encoded = model.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    start = pos - pos % WINDOW  # the window the model read
    # the window's first token is read but not scored (the default), so a context starts after it
    c0, c1 = max(start + 1, pos - BEFORE), min(start + WINDOW, len(ids), pos + AFTER + 1)
    pieces, cursor = [], offsets[c0][0]  # whitespace before a token belongs to it
    for j in range(c0, c1):
        end = max(offsets[j][1], cursor)
        pieces.append(text[cursor:end])
        cursor = end
    trigger = pos - c0
    span_start = len("".join(pieces[:trigger]))
    nxt = ids[pos + 1] if pos + 1 < len(ids) else -1
    return {"doc_id": f"list:{doc}", "token_id": ids[pos], "token": model.tokenizer.decode([ids[pos]]),
            "next_token_id": nxt, "next_token": model.tokenizer.decode([nxt]) if nxt >= 0 else "",
            "context": text[offsets[c0][0]:cursor], "span_start": span_start,
            "span_end": span_start + len(pieces[trigger]), "context_tokens": pieces, "context_trigger": trigger}


def check_rows(model, frame) -> None:
    assert len(frame)
    for row in frame.itertuples(index=False):
        want = expected_text(model, int(row.doc), int(row.pos))
        got = {name: getattr(row, name) for name in want}
        got["context_tokens"] = list(got["context_tokens"])
        assert got == want, (row.doc, row.pos)


def test_trigger_frames_carry_the_text_of_their_position(gpt2_model, atlas):
    for layer, neuron in ((0, 0), (1, 7), (1, 255)):
        frame = atlas.triggers(layer, neuron)
        assert list(frame.columns) == list(TRIGGER_VIEW)
        assert sorted(set(frame.kind)) == ["bottom", "bottom_doc", "top", "top_doc"]
        check_rows(gpt2_model, frame)
        assert frame.equals(atlas.table("triggers").query(f"layer == {layer} and neuron == {neuron}")
                            .reset_index(drop=True))
        # the context's coefficient at the trigger token is the trigger's own
        for row in frame.itertuples():
            assert row.context_activations[row.context_trigger] == pytest.approx(row.activation, rel=1e-5, abs=1e-6)


def test_sample_frames_carry_the_text_of_their_position(gpt2_model, atlas):
    frame = atlas.samples(1, 3)
    assert list(frame.columns) == list(SAMPLE_VIEW) and set(frame.kind) == {"random", "bin"}
    check_rows(gpt2_model, frame)


def test_texts_are_stored_once_per_position(atlas):
    triggers = pq.read_table(atlas.path / "triggers.parquet")
    contexts = pq.read_table(atlas.path / "contexts.parquet")
    assert triggers.column_names == list(COLUMNS["triggers"]) and "context" not in triggers.column_names
    codes = contexts.column("doc").to_numpy() * 2**32 + contexts.column("pos").to_numpy()
    assert np.all(np.diff(codes) > 0)  # sorted, distinct
    samples = pq.read_table(atlas.path / "samples.parquet")
    used = {(d, p) for t in (triggers, samples) for d, p in zip(t.column("doc").to_pylist(), t.column("pos").to_pylist())}
    assert used == set(zip(contexts.column("doc").to_pylist(), contexts.column("pos").to_pylist()))


def test_search_and_token_queries_read_the_joined_text(gpt2_model, atlas):
    table = atlas.table("triggers")
    pattern = r"\bthe\b"
    top = table[table.kind == "top"]
    want = top[top.context.map(lambda t: re.search(pattern, t) is not None)].head(7)
    got = atlas.search(pattern, limit=7)
    assert list(got.columns) == ["layer", "neuron", "kind", "rank", "activation", "doc_id", "pos", "token", "context"]
    assert got.equals(want[list(got.columns)].reset_index(drop=True))
    layer_hits = atlas.search(pattern, layer=1, limit=1000)
    assert len(layer_hits) == int(((top.layer == 1) & top.context.str.contains(pattern)).sum())
    token = int(top.next_token_id[top.next_token_id >= 0].iloc[0])
    fired = atlas.top_neurons(token=token, by="trigger", k=10_000)
    counts = top[top.next_token_id == token].groupby(["layer", "neuron"]).size()
    assert dict(zip(zip(fired.layer, fired.neuron), fired.triggers)) == counts.to_dict()
    word = top.token.iloc[0]
    assert atlas.token_id(word) == gpt2_model.encode(word)[0] or len(gpt2_model.encode(word)) != 1


def test_an_atlas_of_an_unreleased_format_is_refused_in_one_line(atlas, tmp_path):
    """Formats 1-3 were never released: kvmem reads format 4 only and says how to get one."""
    import json
    import shutil

    for version in (1, 2, 3):
        old = tmp_path / f"format-{version}"
        shutil.copytree(atlas.path, old)
        manifest = json.loads((old / "manifest.json").read_text())
        (old / "manifest.json").write_text(json.dumps({**manifest, "format_version": version}))
        with pytest.raises(kvmem.KvmemError, match=rf"has atlas format {version}, this kvmem reads format 4; rescan") as error:
            kvmem.open(old)
        assert "\n" not in str(error.value)


def test_contexts_cut_from_shared_window_pieces_equal_pieces_cut_alone():
    """context_columns cuts each window's pieces once and shares them between neighbouring contexts; every
    context must equal the one cut from its own first token (the whitespace before that token dropped),
    also where offsets run backwards (overlapping byte-fallback tokens), where the shared chain differs."""
    from kvmem.plan import WindowText
    from kvmem.scanning.texts import TextStore, context_columns

    text = "ab  cd\n\tef gh  ij"
    monotone = ((0, 2), (4, 6), (8, 10), (11, 13), (15, 17))
    backwards = ((0, 2), (4, 6), (1, 3), (5, 7), (8, 10), (8, 10), (11, 13), (15, 17))  # out of order
    decoded = {i: f"<{i}>" for i in range(20)}
    for offsets in (monotone, backwards, None):
        tokens = tuple(range(len(offsets or monotone)))
        window = WindowText(0, "d0", 0, tokens, -1, text, offsets)
        store = TextStore()
        store.add([window])
        positions = np.arange(len(tokens))
        got = context_columns(store, np.zeros_like(positions), positions, window=16, before=2, after=1,
                              token_str=decoded.__getitem__)
        ends = np.cumsum(got.piece_counts)
        for i, pos in enumerate(positions.tolist()):
            c0, c1 = max(0, pos - 2), min(len(tokens), pos + 2)
            if offsets is None:
                pieces = [decoded[t] for t in tokens[c0:c1]]
            else:  # the rule, written out: from c0's start, whitespace before a token belongs to it
                pieces, cursor = [], offsets[c0][0]
                for j in range(c0, c1):
                    end = max(offsets[j][1], cursor)
                    pieces.append(text[cursor:end])
                    cursor = end
            assert got.pieces[ends[i] - len(pieces):ends[i]] == pieces and got.context[i] == "".join(pieces), (offsets, pos)
            assert (got.span_start[i], got.span_end[i]) == (len("".join(pieces[:pos - c0])),
                                                            len("".join(pieces[:pos - c0 + 1])))
            assert got.trigger_index[i] == pos - c0 and got.token_id[i] == tokens[pos]
            assert got.next_token_id[i] == (tokens[pos + 1] if pos + 1 < len(tokens) else -1)
