"""Inputs a user may bring that the other tests do not: a slow (Python) tokenizer, gzip JSONL and parquet
that are not valid UTF-8, a single document of a million tokens, and (doc, pos) codes at the limits of
their packing. Each either works as a user would expect or fails in one line naming the fix.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hf_oracle import windows

import kvmem
from kvmem.cli import main
from kvmem.corpus import open_corpus
from kvmem.errors import KvmemError
from kvmem.plan import pack, unpack

ROOT = Path(__file__).resolve().parent.parent


# ---- (doc, pos) codes ----
def test_pack_round_trips_up_to_its_limits():
    """doc << 32 | pos holds documents 0 .. 2^31 - 1 and positions 0 .. 2^32 - 1 exactly (ints, numpy, torch)."""
    docs, positions = [0, 1, 2**31 - 1, 2**31 - 1], [0, 2**32 - 1, 0, 2**32 - 1]
    for doc, pos in zip(docs, positions):
        code = pack(doc, pos)
        assert code == doc * 2**32 + pos <= np.iinfo(np.int64).max and unpack(code) == (doc, pos)
    as_numpy = pack(np.array(docs, np.int64), np.array(positions, np.int64))
    as_torch = pack(torch.tensor(docs), torch.tensor(positions))
    assert as_numpy.tolist() == as_torch.tolist() == [d * 2**32 + p for d, p in zip(docs, positions)]
    assert [tuple(map(int, x)) for x in zip(*unpack(as_torch))] == list(zip(docs, positions))


@pytest.mark.parametrize(("doc", "pos", "message"), [
    (2**31, 0, r"document index 2,147,483,648 is outside \[0, 2,147,483,648\)"),
    (0, 2**32, r"token position 4,294,967,296 is outside \[0, 4,294,967,296\)"),
    (-1, 0, r"document index -1 is outside"),
    (3, -2, r"token position -2 is outside"),
])
def test_pack_refuses_what_would_wrap_around(doc, pos, message):
    for kind in (int, lambda x: np.array([0, x], np.int64), lambda x: torch.tensor([0, x])):
        with pytest.raises(KvmemError, match=message) as error:
            pack(kind(doc), kind(pos))
        assert "\n" not in str(error.value) and "doc << 32 | pos" in str(error.value)


# ---- text that is not UTF-8 ----
BAD = "good text, then a Latin-1 é".encode("latin-1")  # 0xE9 alone is not UTF-8
BAD_AT = BAD.index(b"\xe9")


def test_gzip_jsonl_that_is_not_utf8_names_file_line_and_byte(tmp_path):
    path = tmp_path / "corpus.jsonl.gz"
    with gzip.open(path, "wb") as handle:
        handle.write(json.dumps({"text": "fine"}).encode() + b"\n")
        handle.write(b'{"text": "' + BAD + b'"}\n')
    at = len(b'{"text": "') + BAD_AT
    with pytest.raises(KvmemError, match=rf"corpus.jsonl.gz: bytes at line 2, byte {at} of it are not valid UTF-8 "
                                         rf"\(b'\\xe9'\); re-encode the file as UTF-8"):
        list(open_corpus(path))


def test_parquet_that_is_not_utf8_names_file_row_and_byte(tmp_path):
    """A string column written without validation, and a binary column: invalid bytes give the same line
    as the text formats (file, row, byte); valid bytes in a binary column are read as text."""
    data = b"fine" + BAD
    offsets = pa.py_buffer(np.array([0, 4, len(data)], np.int32).tobytes())
    unchecked = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(data)])  # no UTF-8 check
    pq.write_table(pa.table({"text": unchecked}), tmp_path / "strings.parquet")
    pq.write_table(pa.table({"text": pa.array([b"fine", None, BAD], pa.binary())}), tmp_path / "bytes.parquet")
    for name, row in (("strings.parquet", 1), ("bytes.parquet", 2)):
        with pytest.raises(KvmemError, match=rf"{name}: bytes at row {row}, byte {BAD_AT} of it are not valid UTF-8"):
            list(open_corpus(tmp_path / name))
    pq.write_table(pa.table({"text": pa.array(["naïve".encode(), None], pa.binary())}), tmp_path / "ok.parquet")
    assert [(d.id, d.text) for d in open_corpus(tmp_path / "ok.parquet")] == [("ok.parquet:0", "naïve")]
    pq.write_table(pa.table({"text": pa.array([1, 2])}), tmp_path / "numbers.parquet")
    with pytest.raises(KvmemError, match=r"column 'text' holds int64, not text; choose a text column"):
        list(open_corpus(tmp_path / "numbers.parquet"))


def test_cli_reports_bad_bytes_in_one_line(gpt2_dir, tmp_path, capsys):
    path = tmp_path / "corpus.jsonl.gz"
    with gzip.open(path, "wb") as handle:
        handle.write(b'{"text": "' + BAD + b'"}\n')
    assert main(["scan", "--model", str(gpt2_dir), "--corpus", str(path), "--out", str(tmp_path / "a"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 1, byte" in err[0] and "not valid UTF-8" in err[0]
    assert not (tmp_path / "a").exists()


# ---- a slow tokenizer ----
@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A tiny random GPT-2 over ByT5's byte vocabulary: ByT5Tokenizer is a Python (slow) tokenizer
    that needs no files, so it has no offsets and kvmem must cut contexts from decoded tokens."""
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = ByT5Tokenizer()
    assert not tokenizer.is_fast
    torch.manual_seed(3)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                    bos_token_id=None, eos_token_id=tokenizer.eos_token_id))
    path = tmp_path_factory.mktemp("byt5-gpt2")
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model = kvmem.load_model(path, device="cpu")
    assert not model.tokenizer.is_fast and (model.d_ff, model.vocab_size) == (128, len(tokenizer))
    return model


def test_slow_tokenizer_scans_like_a_fast_one(byte_model, tmp_path):
    docs = ["Assert statements are a convenient way to insert debugging assertions.", "A short one.",
            "Feed-forward layers hold two thirds of the parameters."]
    window = 24
    atlas = kvmem.scan(byte_model, docs, out=tmp_path / "a", window=window, top_k=5, prepend_bos=False, top_n=2,
                       progress=False)
    read = windows(byte_model, docs, window=window, bos=False)
    skip = 1  # each window's first token is read, not scored
    codes = [(w.doc, w.start + j) for w in read for j in range(skip, len(w.ids))]
    for layer in (0, 1):
        m = np.concatenate([w.coefficients[layer][skip:] for w in read])
        for neuron in (0, 127):
            got = atlas.triggers(layer, neuron, kind="top")
            best = np.argsort(-m[:, neuron], kind="stable")[:5]
            assert list(zip(got.doc, got.pos)) == [codes[i] for i in best]
            for row in got.itertuples():
                w = next(w for w in read if w.doc == row.doc and w.start == row.pos - row.pos % window)
                at = row.pos - w.start
                c0, c1 = max(skip, at - 12), min(len(w.ids), at + 5)
                assert "".join(row.context_tokens) == row.context == byte_model.tokenizer.decode(w.ids[c0:c1])
                assert row.context_tokens[row.context_trigger] == docs[row.doc][row.pos]  # one byte, one character
                np.testing.assert_allclose(row.context_activations, w.coefficients[layer][c0:c1, neuron], rtol=1e-5,
                                           atol=1e-6)


# ---- one document of a million tokens ----
RSS_SCRIPT = r"""
import json, os, sys, threading, time
import psutil
import kvmem

model = kvmem.load_model(sys.argv[1], device="cpu")
tokens = int(sys.argv[2])
text = "".join(f" w{i % 9973}" for i in range(tokens // 3))  # ' w123' is three GPT-2 tokens
n = len(model.tokenizer(text, add_special_tokens=False)["input_ids"])
process = psutil.Process()
# the cheapest scan that still streams every token through the model and the state (one layer, top-1, no
# samples or context coefficients): what is measured is what grows with the document
SETTINGS = dict(window=127, top_k=1, batch_size=32, layers=[0], context_activations=False, random_samples=0, skip_first=0,
                bin_samples=0, key_projections=False, conventions=("raw",), top_n=1, progress=False)
kvmem.scan(model, ["warm up"], out=None, **SETTINGS)  # kernels, projections, allocator
del text
base = process.memory_info().rss
peak = [base]
done = threading.Event()

def watch():
    while not done.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.02)

thread = threading.Thread(target=watch, daemon=True)
thread.start()
text = "".join(f" w{i % 9973}" for i in range(tokens // 3))
atlas = kvmem.scan(model, [text], out=None, **SETTINGS)
done.set()
thread.join()
print(json.dumps({"tokens": n, "scanned": atlas.manifest.tokens, "growth": peak[0] - base}))
"""


def _peak_growth(gpt2_dir, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(gpt2_dir), str(tokens)], capture_output=True,
                            text=True, env=env, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_million_token_document_keeps_memory_bounded_by_the_window(gpt2_dir):
    """Peak RSS growth while scanning one document of ~1M tokens, against one of ~3M, each in a fresh
    process. A long document is tokenized in pieces and its windows are made as they are read
    (kvmem.tokenization, kvmem.plan), so three times the tokens cost no more memory: measured here, 102 MB of
    growth at 1M tokens and 100 MB at 3M. The growth levels off by about 1M tokens (58-82 MB at 100k, 75 MB at
    300k, allocator noise of some tens of MB), so both documents are past that. Holding the document's tokens,
    offsets and windows, as kvmem did before, cost about 0.4 KB a token (+800 MB here)."""
    small = _peak_growth(gpt2_dir, 1_000_000)
    large = _peak_growth(gpt2_dir, 3_000_000)
    assert small["scanned"] == small["tokens"] > 900_000 and large["scanned"] == large["tokens"] > 2_700_000
    assert large["growth"] < small["growth"] + 48 * 2**20, (small, large)
