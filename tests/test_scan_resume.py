"""Shards, ties and resume: shard atlases merge to the single scan, and a scan killed for real (SIGKILL)
resumes from its checkpoint; checkpoints are never unpickled."""

from __future__ import annotations

import json

import pytest
from conftest import SHORT_DOCS

import kvmem
import kvmem.schema

WINDOW = 8
K = 4

SHARDABLE = dict(top_k=K, window=WINDOW, batch_size=3, per_document=True, top_n=5, block_documents=2, progress=False)


def assert_same_atlas(a, b):
    """The same tables, every one byte-identical, and the manifests equal but for timing."""
    tables = sorted(p.name for p in a.path.glob("*.parquet"))
    assert tables == sorted(p.name for p in b.path.glob("*.parquet"))
    assert {f"{table}.parquet" for table in kvmem.schema.TABLES} - set(tables) <= {"values.parquet", "keys.parquet"}
    for table in tables:
        assert (a.path / table).read_bytes() == (b.path / table).read_bytes(), table
    ma, mb = (json.loads((x.path / "manifest.json").read_text()) for x in (a, b))
    ma.pop("timing"), mb.pop("timing")
    assert ma == mb


def test_shards_merge_to_single_scan(gpt2_dir, gpt2_model, tmp_path):
    whole = kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "whole", **SHARDABLE)
    shards = [kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / f"s{i}", shard=(i, 3), **SHARDABLE) for i in range(3)]
    assert sum(s.manifest.tokens for s in shards) == whole.manifest.tokens
    merged = kvmem.merge(list(reversed(shards)), out=tmp_path / "merged", model=gpt2_model)
    assert_same_atlas(whole, merged)
    assert merged.manifest.corpus["sha256_chain"] == whole.manifest.corpus["sha256_chain"]
    with pytest.raises(kvmem.KvmemError, match=r"shard\(s\) 0/3 given twice"):
        kvmem.merge([shards[0], shards[0], shards[1]], out=tmp_path / "twice", model=gpt2_model)
    with pytest.raises(kvmem.KvmemError, match=r"incomplete set of shards: missing 2/3"):
        kvmem.merge(shards[:2], out=tmp_path / "two", model=gpt2_model)
    other = kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "o0", shard=(0, 3), **{**SHARDABLE, "top_k": 3})
    with pytest.raises(kvmem.KvmemError, match=r"their scan differ"):
        kvmem.merge([other, shards[1], shards[2]], out=tmp_path / "mixed", model=gpt2_model)
    with pytest.raises(kvmem.KvmemError, match=r"is not a shard atlas"):
        kvmem.merge([whole, shards[1]], out=tmp_path / "bad", model=gpt2_model)
    used = shards[0].manifest.engine
    assert (used["device"], used["dtype"]) == ("cpu", "float32") and "extremes" in used["statistics"]
    more = kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "t1", shard=(1, 3), statistics=("magnitude_percentiles",),
                      **SHARDABLE)
    with pytest.raises(kvmem.KvmemError, match=r"cannot merge .*t1 with .*s0: their scan differ"):
        kvmem.merge([shards[0], more, shards[2]], out=tmp_path / "mixed-statistics", model=gpt2_model)
    half = kvmem.load_model(gpt2_dir, device="cpu", dtype="bfloat16")
    low = kvmem.scan(half, SHORT_DOCS, out=tmp_path / "b2", shard=(2, 3), **SHARDABLE)
    with pytest.raises(kvmem.KvmemError, match=r"cannot merge .*b2 with .*s0: .*b2 was scanned with dtype bfloat16"):
        kvmem.merge([shards[0], shards[1], low], out=tmp_path / "mixed-dtype", model=gpt2_model)


def test_repeated_text_ties_break_by_lowest_position(gpt2_model, tmp_path):
    """Identical lines give identical coefficients; the lowest (doc, pos) wins, in shards as in one scan."""
    docs = ["ROMEO. Speak again.", "JULIET. Ay me!", "ROMEO. Speak again.", "JULIET. Ay me!"] * 3
    settings = {**SHARDABLE, "per_document": False, "top_k": 2, "block_documents": 4}  # read out of order
    whole = kvmem.scan(gpt2_model, docs, out=tmp_path / "whole", **settings)
    shards = [kvmem.scan(gpt2_model, docs, out=tmp_path / f"s{i}", shard=(i, 3), **settings) for i in range(3)]
    assert_same_atlas(whole, kvmem.merge(shards, out=tmp_path / "merged", model=gpt2_model))
    top = whole.triggers(0, 0, kind="top")
    assert top.doc.tolist() == sorted(top.doc.tolist()) and top.doc.iloc[0] in (0, 1)


def test_resume_after_sigkill(gpt2_dir, gpt2_model, tmp_path):
    """A scan killed for real (SIGKILL) resumes from its checkpoint without redoing finished batches, also
    from a checkpoint of the kvmem before windows were read longest first (a per-document scan reads
    documents shortest first either way); a default scan refuses such a checkpoint with one line."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from kvmem.scanning import runner
    from kvmem.scanning.checkpoint import load_state
    from kvmem.scanning.config import ScanConfig

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in SHORT_DOCS * 4))
    settings = dict(top_k=K, window=WINDOW, batch_size=2, per_document=True, top_n=5, block_documents=2,
                    checkpoint_every=10)
    out = tmp_path / "resumed"
    child = f"""
import time, kvmem
from kvmem.scanning import runner
real, calls = runner._run_batch, [0]
def slow(*args, **kwargs):
    calls[0] += 1
    if calls[0] > 12:
        time.sleep(600)  # stuck: the parent kills us here
    return real(*args, **kwargs)
runner._run_batch = slow
kvmem.scan(kvmem.load_model({str(gpt2_dir)!r}), {str(corpus)!r}, out={str(out)!r}, progress=False, **{settings!r})
"""
    process = subprocess.Popen([sys.executable, "-c", child])
    state_file = tmp_path / "resumed.checkpoint" / "state.json"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and process.poll() is None:
            if state_file.exists() and json.loads(state_file.read_text())["batches"] >= 6:
                break
            time.sleep(0.2)
        assert process.poll() is None, "the child ended before it could be killed"
        time.sleep(2)  # let it reach the stuck batch
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL and not out.exists()
    saved = json.loads(state_file.read_text())
    done, blocks_done = saved["batches"], saved["position"]["blocks_done"]

    with pytest.raises(kvmem.KvmemError, match="cannot resume from .*: these settings differ from the checkpoint's: top_k"):
        kvmem.scan(gpt2_model, str(corpus), out=out, resume=True, progress=False, **{**settings, "top_k": 3})
    with pytest.raises(kvmem.KvmemError, match="these settings differ from the checkpoint's: statistics;"):
        kvmem.scan(gpt2_model, str(corpus), out=out, resume=True, progress=False,
                   **{**settings, "statistics": ("magnitude_percentiles",)})
    half = kvmem.load_model(gpt2_dir, device="cpu", dtype="bfloat16")
    with pytest.raises(kvmem.KvmemError, match="these settings differ from the checkpoint's: .*dtype"):
        kvmem.scan(half, str(corpus), out=out, resume=True, progress=False, **settings)
    # as the kvmem before longest_windows_first wrote it: its plan lacks the field, its rule read otherwise
    meta = json.loads(state_file.read_text())
    del meta["header"]["plan"]["longest_windows_first"]
    meta["header"]["plan"]["rule"] = "the rule's earlier text"
    state_file.write_text(json.dumps(meta))
    windows_first = {**saved["header"], "plan": {**saved["header"]["plan"], "longest_windows_first": True}}
    with pytest.raises(kvmem.KvmemError, match="an earlier kvmem wrote it, which read each block's documents"):
        load_state(state_file.parent, windows_first,  # a default scan's plan now reads windows longest first
                   runner.statistics_of(gpt2_model, ScanConfig(**settings)))
    real, computed = runner._run_batch, []
    try:
        runner._run_batch = lambda model, batch, *a, **kw: (computed.append(batch), real(model, batch, *a, **kw))[1]
        resumed = kvmem.scan(gpt2_model, str(corpus), out=out, resume=True, progress=False, **settings)
    finally:
        runner._run_batch = real
    whole = kvmem.scan(gpt2_model, str(corpus), out=tmp_path / "whole", progress=False, **settings)
    # the resumed run computed exactly the batches the checkpoint lacked, none of the finished blocks
    assert done >= 6 and len(computed) + done == whole.manifest.timing["batches"]
    assert min(batch.block for batch in computed) >= blocks_done
    assert_same_atlas(whole, resumed)
    assert not (tmp_path / "resumed.checkpoint").exists()


def test_checkpoint_with_pickle_payload_is_refused(gpt2_model, tmp_path):
    import pickle

    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    out = tmp_path / "atlas"
    checkpoint = tmp_path / "atlas.checkpoint"
    checkpoint.mkdir()
    (checkpoint / "state.x.safetensors").write_bytes(pickle.dumps(Payload()))
    (checkpoint / "state.json").write_text(json.dumps({"kvmem_state": 4, "generation": "x",
                                                      "tensor_file": "state.x.safetensors"}))
    with pytest.raises(kvmem.KvmemError) as error:
        kvmem.scan(gpt2_model, SHORT_DOCS, out=out, resume=True, checkpoint_every=5, progress=False)
    assert "is not a safetensors file" in str(error.value) and "\n" not in str(error.value)
    (checkpoint / "state.x.safetensors").unlink()
    (checkpoint / "state.json").unlink()
    (checkpoint / "state.pt").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(kvmem.KvmemError, match="nothing to resume: no checkpoint at"):  # a pickle is never loaded
        kvmem.scan(gpt2_model, SHORT_DOCS, out=out, resume=True, checkpoint_every=5, progress=False)
    assert not (tmp_path / "pwned").exists()
