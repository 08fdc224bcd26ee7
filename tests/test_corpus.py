"""Corpora: every source kind, units, stable ids, the window rule, and bad input."""

from __future__ import annotations

import gzip
import json
import random

import pandas as pd
import pytest

import kvmem
from kvmem.corpus import open_corpus
from kvmem.errors import KvmemError
from kvmem.plan import Batch, StreamPosition, TokenPlan, iterate_batches
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.runner import token_plan


def ids_and_texts(corpus):
    return [(d.index, d.id, d.text) for d in corpus]


def test_text_files_and_units(tmp_path):
    (tmp_path / "a.txt").write_text("First paragraph. Second sentence!\n\nAnother paragraph\nwith two lines.")
    with gzip.open(tmp_path / "b.txt.gz", "wt") as handle:
        handle.write("Zipped text.")
    whole = ids_and_texts(open_corpus(tmp_path))
    assert whole == [(0, "a.txt", "First paragraph. Second sentence!\n\nAnother paragraph\nwith two lines."),
                     (1, "b.txt.gz", "Zipped text.")]
    paragraphs = [d.id for d in open_corpus(tmp_path / "a.txt", unit="paragraph")]
    assert paragraphs == ["a.txt#p0", "a.txt#p1"]
    lines = [d.text for d in open_corpus(tmp_path / "a.txt", unit="line")]
    assert lines == ["First paragraph. Second sentence!", "Another paragraph", "with two lines."]
    sentences = [d.text for d in open_corpus(tmp_path / "a.txt", unit="sentence")]
    assert sentences == ["First paragraph.", "Second sentence!", "Another paragraph with two lines."]
    # re-iterable and stable
    assert ids_and_texts(open_corpus(tmp_path)) == whole


def test_jsonl_parquet_list_and_dataset(tmp_path):
    lines = [json.dumps({"body": "one"}), "", json.dumps({"body": "two", "x": 1})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    assert ids_and_texts(open_corpus(tmp_path / "d.jsonl", text_field="body")) == [(0, "d.jsonl:1", "one"),
                                                                                   (1, "d.jsonl:3", "two")]
    with gzip.open(tmp_path / "e.jsonl.gz", "wt") as handle:
        handle.write(json.dumps({"text": "gz"}) + "\n")
    assert [d.text for d in open_corpus(tmp_path / "e.jsonl.gz")] == ["gz"]
    pd.DataFrame({"text": ["p0", None, "p2"]}).to_parquet(tmp_path / "f.parquet")
    assert ids_and_texts(open_corpus(tmp_path / "f.parquet")) == [(0, "f.parquet:0", "p0"), (1, "f.parquet:2", "p2")]
    assert [d.id for d in open_corpus(["a", "", "b"])] == ["list:0", "list:2"]  # empty documents are skipped
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"text": ["x y", "z"]})
    assert [d.text for d in open_corpus(dataset)] == ["x y", "z"]


def test_builtin_corpora():
    pydoc = open_corpus("pydoc")
    first = next(iter(pydoc))
    assert first.index == 0 and first.id.startswith("pydoc:") and len(first.text) > 100
    total = sum(len(d.text) for d in pydoc)
    assert total > 300_000
    stdlib = iter(open_corpus("stdlib-docs"))
    docs = [next(stdlib) for _ in range(50)]
    assert all(d.id.startswith("stdlib-docs:") and d.text for d in docs)
    assert pydoc.describe()["spec"] == "pydoc" and "python" in pydoc.describe()


def test_window_rule(gpt2_model):
    docs = list(open_corpus(["one two three four five six seven", "eight"]))
    ids = gpt2_model.encode(docs[0].text)
    windows = [(0, 0, ids[0:3]), (0, 3, ids[3:6]), (0, 6, ids[6:7]), (1, 0, gpt2_model.encode("eight"))]
    for sort_by_length, expected in ((False, windows), (True, windows[3:] + windows[:3])):  # shortest document first
        plan = TokenPlan(window=3, bos_token_id=None, batch_size=2, sort_by_length=sort_by_length)
        got = [w for item in iterate_batches(docs, gpt2_model.tokenizer, plan, StreamPosition())
               if not isinstance(item, int) for w in item.windows]
        assert [(w.doc, w.start, list(w.tokens)) for w in got] == expected


def test_length_sorted_batches(gpt2_model):
    """Sorting by length reads the same windows with less padding; a document's windows stay together
    and in order; ``ordered`` is true exactly when the batch's codes rise above all read before."""
    rng = random.Random(0)
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.choice([2, 3, 5, 40, 90])))
             for _ in range(120)]
    docs = list(open_corpus(texts))
    runs = {}
    for sort_by_length in (False, True):
        plan = TokenPlan(window=32, bos_token_id=None, batch_size=4, block_documents=40, sort_by_length=sort_by_length)
        batches = [b for b in iterate_batches(docs, gpt2_model.tokenizer, plan, StreamPosition()) if isinstance(b, Batch)]
        last = -1
        for batch in batches:
            assert len(batch.windows) * max(len(w.tokens) for w in batch.windows) <= 4 * 32
            codes = [(w.doc << 32) | (w.start + i) for w in batch.windows for i in range(len(w.tokens))]
            assert batch.ordered == (codes[0] > last and codes == sorted(set(codes)))
            last = max([last, *codes])
        order = [(w.doc, w.start) for b in batches for w in b.windows]
        by_doc: dict[int, list[int]] = {}
        for i, (doc, start) in enumerate(order):
            by_doc.setdefault(doc, []).append((i, start))
        assert all([i for i, _ in v] == list(range(v[0][0], v[0][0] + len(v))) and [s for _, s in v] == sorted(s for _, s in v)
                   for v in by_doc.values())  # contiguous, in position order
        runs[sort_by_length] = (sorted(order), sum(len(b.windows) * max(len(w.tokens) for w in b.windows) for b in batches),
                                [b.ordered for b in batches])
    assert runs[True][0] == runs[False][0]  # the same windows
    assert runs[True][1] < 0.8 * runs[False][1]  # less padding
    assert all(runs[False][2]) and not all(runs[True][2])


@pytest.mark.parametrize("max_tokens", [None, 1000])
def test_longest_windows_first(gpt2_model, max_tokens):
    """Each block's windows, longest first and stable (a stable sort of its windows in corpus order): the
    full windows in corpus order, then each document's shorter last window; the same windows, tokens and
    following tokens as in corpus order, the budget kept, and less padding than documents shortest first."""
    rng = random.Random(1)
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.choice([2, 7, 40, 75, 90])))
             for _ in range(120)]
    docs = list(open_corpus(texts))

    def read(**order):
        plan = TokenPlan(window=32, bos_token_id=None, batch_size=4, block_documents=40, max_tokens=max_tokens, **order)
        return list(iterate_batches(docs, gpt2_model.tokenizer, plan, StreamPosition()))

    corpus_order = read(sort_by_length=False)
    longest = read(sort_by_length=True, longest_windows_first=True)
    documents = read(sort_by_length=True)
    for block in sorted({b.block for b in corpus_order}):
        windows = [w for b in corpus_order if b.block == block for w in b.windows]
        expected = sorted(windows, key=lambda w: -len(w.tokens))  # stable: ties keep corpus order
        got = [w for b in longest if b.block == block for w in b.windows]
        assert [(w.doc, w.start, w.tokens, w.following) for w in got] == \
            [(w.doc, w.start, w.tokens, w.following) for w in expected]
    assert all(len(b.windows) * max(len(w.tokens) for w in b.windows) <= 4 * 32 for b in longest)

    def padded(batches):
        return sum(len(b.windows) * max(len(w.tokens) for w in b.windows) for b in batches)

    assert padded(longest) < padded(documents)
    assert sum(b.tokens for b in longest) == sum(b.tokens for b in corpus_order)


def test_longest_windows_first_is_recorded_and_needs_a_length_sort(gpt2_model):
    plan = TokenPlan(window=8, bos_token_id=None, longest_windows_first=True)
    assert TokenPlan.from_dict(plan.to_dict()) == plan
    legacy = {k: v for k, v in plan.to_dict().items() if k != "longest_windows_first"}  # an atlas from before
    assert TokenPlan.from_dict(legacy).longest_windows_first is False
    with pytest.raises(KvmemError, match="needs sort_by_length"):
        TokenPlan(window=8, bos_token_id=None, sort_by_length=False, longest_windows_first=True)
    assert token_plan(gpt2_model, ScanConfig()).longest_windows_first is True
    assert token_plan(gpt2_model, ScanConfig(per_document=True)).longest_windows_first is False  # documents together
    assert token_plan(gpt2_model, ScanConfig(sort_by_length=False)).longest_windows_first is False


def test_plan_batches_blocks_shards_and_cut(gpt2_model):
    """Batches fill batch_size x window padded positions, never span a block; shards take whole blocks;
    max_tokens cuts the stream at a token count every process agrees on."""
    docs = list(open_corpus([f"doc {i} " + "word " * (3 + 2 * i) for i in range(6)]))
    plan = TokenPlan(window=4, bos_token_id=None, batch_size=2, block_documents=2)
    position = StreamPosition()
    ends: list[int] = []
    batches = list(iterate_batches(docs, gpt2_model.tokenizer, plan, position, on_block_end=ends.append))
    assert all(isinstance(b, Batch) for b in batches) and ends == [1, 2]  # block boundaries
    for batch in batches:
        assert len({w.doc // 2 for w in batch.windows}) == 1  # one block
        assert len(batch.windows) * max(len(w.tokens) for w in batch.windows) <= 2 * 4
    total = sum(b.tokens for b in batches)
    assert position.documents == 6 and position.tokens == total and len(position.corpus_digest) == 64
    shards = [TokenPlan(window=4, bos_token_id=None, batch_size=2, block_documents=2, shard=(i, 2)) for i in (0, 1)]
    parts = [[w for item in iterate_batches(docs, gpt2_model.tokenizer, p, StreamPosition())
              if not isinstance(item, int) for w in item.windows] for p in shards]
    assert {w.doc for w in parts[0]} == {0, 1, 4, 5} and {w.doc for w in parts[1]} == {2, 3}
    assert sorted((w.doc, w.start) for part in parts for w in part) == sorted(
        (w.doc, w.start) for b in batches for w in b.windows)
    cut = TokenPlan(window=4, bos_token_id=None, batch_size=2, block_documents=2, max_tokens=13, shard=(1, 2))
    got = [w for item in iterate_batches(docs, gpt2_model.tokenizer, cut, StreamPosition())
           if not isinstance(item, int) for w in item.windows]
    whole = sorted((w for b in batches for w in b.windows), key=lambda w: w.key)  # corpus order
    kept, seen = [], 0
    for w in whole:  # the first 13 tokens of the whole stream, of which shard 1 holds its blocks' share
        n = min(len(w.tokens), 13 - seen)
        if n <= 0:
            break
        seen += n
        kept.append((w.doc, w.start, n))
    assert sorted((w.doc, w.start, len(w.tokens)) for w in got) == [k for k in kept if (k[0] // 2) % 2 == 1]


def test_errors(tmp_path):
    with pytest.raises(kvmem.KvmemError, match="corpus 'nope.txt' not found"):
        open_corpus("nope.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good text \xff\xfe more")
    with pytest.raises(kvmem.KvmemError, match=r"bad.txt: bytes at byte offset 10 are not valid UTF-8"):
        list(open_corpus(bad))
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "no"}) + "\n")
    with pytest.raises(kvmem.KvmemError, match=r"x.jsonl: line 2 has no 'text' field"):
        list(open_corpus(jsonl))
    jsonl.write_text("{not json\n")
    with pytest.raises(kvmem.KvmemError, match="line 1 is not valid JSON"):
        list(open_corpus(jsonl))
    (tmp_path / "t.csv").write_text("a,b")
    with pytest.raises(kvmem.KvmemError, match="unsupported corpus file type"):
        open_corpus(tmp_path / "t.csv")
    with pytest.raises(kvmem.KvmemError, match="unknown corpus unit 'word'"):
        open_corpus(["x"], unit="word")
    with pytest.raises(kvmem.KvmemError, match="corpus list item 1 is a int"):
        open_corpus(["x", 3])
    with pytest.raises(kvmem.KvmemError, match="bad hub corpus"):
        open_corpus("hf:")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(kvmem.KvmemError, match="holds no"):
        open_corpus(empty)


def test_lone_surrogates_become_replacement_characters():
    docs = list(open_corpus(["ok \ud800 text", "\udfff"]))
    assert [d.text for d in docs] == ["ok \ufffd text", "\ufffd"]
    assert all(d.text.encode("utf-8") for d in docs)
