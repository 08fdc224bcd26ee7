"""The command line's scan options end to end: ``--shard`` parsing, ``kvmem merge`` of real shard scans,
and ``--resume`` after a real SIGKILL of a checkpointing ``kvmem scan`` process. Each result is compared
with an uninterrupted single ``kvmem scan`` of the same corpus: every table byte-identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SHORT_DOCS

import kvmem.schema
from kvmem.cli import main

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ["--top-k", "4", "--window", "8", "--batch-size", "1", "--per-document", "--top-n", "3",
            "--block-documents", "2", "--checkpoint-every", "10", "--quiet"]


def _saved_batches(checkpoint: Path, argv: list[str]) -> int:
    """The batches of the state committed in ``checkpoint``, loaded whole (tensors checked against their JSON)
    with the statistics of the scan ``argv`` describes."""
    from kvmem.cli import build_parser
    from kvmem.scanning.checkpoint import load_state
    from kvmem.scanning.config import ScanConfig
    from kvmem.scanning.statistics import compose

    args = build_parser().parse_args(argv)
    config = ScanConfig(top_k=args.top_k, window=args.window, per_document=args.per_document, top_n=args.top_n)
    return load_state(checkpoint, None, compose(config, gated=False)).batches


def assert_same_tables(a: Path, b: Path, *, same_path: bool = True) -> None:
    """Every table byte-identical, and the manifests equal but for timing and the environment variables
    they record (a test sets KVMEM_PREFETCH for one run; and the corpus path unless ``same_path``: the
    same text read from a copy)."""
    tables = sorted(path.name for path in a.glob("*.parquet"))
    assert tables == sorted(path.name for path in b.glob("*.parquet"))
    assert {f"{table}.parquet" for table in kvmem.schema.TABLES if table not in ("values", "keys")} <= set(tables)
    for table in tables:
        assert (a / table).read_bytes() == (b / table).read_bytes(), table
    ma, mb = (json.loads((x / "manifest.json").read_text()) for x in (a, b))
    for manifest in (ma, mb):
        manifest.pop("timing")
        manifest["environment"].pop("variables")
        if not same_path:
            manifest["corpus"].pop("spec")
    assert ma == mb


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli-corpus") / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in SHORT_DOCS * 2))
    return path


@pytest.fixture(scope="module")
def whole(gpt2_dir, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli-whole") / "whole"
    assert main(["scan", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(out), *SETTINGS]) == 0
    return out


@pytest.mark.parametrize(("shard", "message"), [
    ("2", r"--shard expects i/N \(e\.g\. 0/4\), got '2'"),
    ("a/b", r"--shard expects i/N \(e\.g\. 0/4\), got 'a/b'"),
    ("1/2/3", r"--shard expects i/N \(e\.g\. 0/4\), got '1/2/3'"),
    ("3/3", r"shard must be i/N with 0 <= i < N, got 3/3"),
    ("-1/2", r"shard must be i/N with 0 <= i < N, got -1/2"),
    ("0/0", r"shard must be i/N with 0 <= i < N, got 0/0"),
])
def test_bad_shard_is_one_line_before_the_model_loads(shard, message, corpus, tmp_path, capsys):
    import re

    # a model that does not exist: the shard is refused first, so no model is loaded
    code = main(["scan", "--model", str(tmp_path / "no-model"), "--corpus", str(corpus), "--out", str(tmp_path / "a"),
                 f"--shard={shard}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and re.search(message, err[0]), err


def test_cli_shards_merge_to_the_single_scan(gpt2_dir, corpus, whole, tmp_path, capsys):
    shards = []
    for index in range(2):
        out = tmp_path / f"shard{index}"
        assert main(["scan", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(out),
                     "--shard", f"{index}/2", *SETTINGS]) == 0
        shards.append(out)
    tokens = [json.loads((s / "manifest.json").read_text())["tokens"] for s in shards]
    assert all(t > 0 for t in tokens) and sum(tokens) == json.loads((whole / "manifest.json").read_text())["tokens"]
    capsys.readouterr()
    assert main(["merge", *map(str, reversed(shards)), "--out", str(tmp_path / "merged"), "--quiet"]) == 0
    assert "merged" in capsys.readouterr().out
    assert_same_tables(whole, tmp_path / "merged")
    # an incomplete set is one line, exit 2, and writes nothing
    assert main(["merge", str(shards[0]), "--out", str(tmp_path / "one"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing 1/2" in err[0] and not (tmp_path / "one").exists()


SLOW_CLI = """
import sys, time
from kvmem.scanning import runner
real = runner._run_batch
def slow(*args, **kwargs):  # a slow machine: every forward takes 0.1 s more
    time.sleep(0.1)
    return real(*args, **kwargs)
runner._run_batch = slow
from kvmem.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _kill_after_checkpointed_batches(argv: list[str], state: Path, batches: int = 8) -> None:
    """Run ``kvmem ARGV`` (slowed) in a child, SIGKILL it once its checkpoint holds ``batches`` batches."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # KVMEM_PREFETCH too
    process = subprocess.Popen([sys.executable, "-c", SLOW_CLI, *argv], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and process.poll() is None:
            try:
                if json.loads(state.read_text())["batches"] >= batches:
                    break
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                pass
            time.sleep(0.05)
        assert process.poll() is None, f"the scan ended before it could be killed: {process.stderr.read()[-2000:]}"
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    assert json.loads(state.read_text())["batches"] >= batches


@pytest.mark.parametrize("prefetch", ["0", "1"])
def test_cli_resume_after_sigkill_equals_the_uninterrupted_scan(prefetch, gpt2_dir, corpus, whole, tmp_path, capsys,
                                                               monkeypatch):
    """Killed and resumed, with and without the read-ahead thread (KVMEM_PREFETCH; its checkpoints must
    record the position of their block end, not the thread's): the tables of one uninterrupted scan."""
    monkeypatch.setenv("KVMEM_PREFETCH", prefetch)
    out = tmp_path / "resumed"
    argv = ["scan", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(out), *SETTINGS]
    state = tmp_path / "resumed.checkpoint" / "state.json"
    _kill_after_checkpointed_batches(argv, state)
    assert not out.exists()
    assert main([*argv, "--resume"]) == 0
    assert kvmem.open(out).manifest.environment["variables"]["KVMEM_PREFETCH"] == prefetch
    assert_same_tables(whole, out)
    assert not state.parent.exists()
    capsys.readouterr()
    # nothing left to resume: one line
    assert main([*argv[:6], str(tmp_path / "never"), *SETTINGS, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to resume" in err[0]


def test_resume_refuses_a_corpus_changed_after_the_kill(gpt2_dir, corpus, whole, tmp_path, capsys):
    """The documents of the blocks read before the kill are checked against their recorded digests: an edit
    names the first changed document, a shortened corpus says so; restored, the resume ends as if never
    interrupted."""
    copy = tmp_path / "c.jsonl"
    original = corpus.read_text()
    copy.write_text(original)
    out = tmp_path / "resumed"
    argv = ["scan", "--model", str(gpt2_dir), "--corpus", str(copy), "--out", str(out), *SETTINGS]
    state = tmp_path / "resumed.checkpoint" / "state.json"
    _kill_after_checkpointed_batches(argv, state)
    assert json.loads(state.read_text())["position"]["documents"] >= 3
    lines = original.splitlines()
    edited = [*lines[:1], json.dumps({"text": json.loads(lines[1])["text"] + " (edited)"}), *lines[2:]]
    capsys.readouterr()
    for changed, expected in (("\n".join(edited), "document 1 ('c.jsonl:2') differs from the one read before"),
                              (lines[0], "it ends after 1 documents")):
        copy.write_text(changed)
        assert main([*argv, "--resume"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the corpus changed since the checkpoint" in err[0] and expected in err[0], err
        assert not out.exists() and state.exists()  # nothing written, the checkpoint kept
    copy.write_text(original)
    assert main([*argv, "--resume"]) == 0
    assert_same_tables(whole, out, same_path=False)


KILL_IN_SAVE = """
import os, signal, sys
from pathlib import Path
import safetensors.torch

where = sys.argv.pop(1)
saves = []
real_save, real_replace = safetensors.torch.save_file, os.replace

def save_file(tensors, path, metadata=None):  # the second save is killed half-way through its tensor file
    saves.append(path)
    real_save(tensors, path, metadata=metadata)
    if where == "tensors" and len(saves) == 2:
        with open(path, "rb+") as handle:
            handle.truncate(os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

def replace(src, dst, *args, **kwargs):  # or killed after both files are written, before the commit
    if where == "commit" and len(saves) == 2 and Path(dst).name == "state.json":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst, *args, **kwargs)

safetensors.torch.save_file, os.replace = save_file, replace
from kvmem.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["tensors", "commit"])
def test_kill_inside_a_checkpoint_write_resumes_from_the_previous_one(where, gpt2_dir, corpus, whole, tmp_path):
    """A real SIGKILL half-way through writing the second checkpoint's tensor file, or after writing it and
    before the commit: the first checkpoint stays whole, --resume continues from it, and the tables equal an
    uninterrupted scan's."""
    out = tmp_path / "resumed"
    argv = ["scan", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(out), *SETTINGS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", KILL_IN_SAVE, where, *argv], env=env, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    checkpoint = tmp_path / "resumed.checkpoint"
    first = json.loads((checkpoint / "state.json").read_text())
    leftovers = sorted(p.name for p in checkpoint.iterdir())
    assert len([n for n in leftovers if n.endswith(".safetensors")]) == 2  # the committed one and the killed one
    assert _saved_batches(checkpoint, argv) == first["batches"] > 0  # the first checkpoint, whole
    assert main([*argv, "--resume"]) == 0
    assert_same_tables(whole, out)
    assert not checkpoint.exists()


def test_a_second_scan_into_a_running_scans_out_is_refused(gpt2_dir, corpus, whole, tmp_path, capsys):
    """Two real processes: while a (slowed) scan runs, another scan into the same --out, with or without
    --overwrite or --resume, gets one line naming the running scan's pid and touches nothing; the first
    finishes with the tables of an undisturbed scan, and its lock is free again."""
    out = tmp_path / "atlas"
    argv = ["scan", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(out), *SETTINGS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    first = subprocess.Popen([sys.executable, "-c", SLOW_CLI, *argv], env=env, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".atlas.lock"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and first.poll() is None and not (lock.exists() and lock.read_text()):
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()[-2000:]
        capsys.readouterr()
        for extra in ([], ["--overwrite"], ["--resume"]):
            assert main([*argv, *extra]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"is in use by a running kvmem (pid {first.pid})" in err[0], err
        assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    finally:
        first.kill()
        first.wait()
        first.stderr.close()
    assert_same_tables(whole, out)
    assert not lock.exists()  # removed by the scan that held it
    assert main([*argv, "--overwrite"]) == 0  # free again


def test_the_command_process_delivers_all_its_output_and_status(whole, tmp_path, capsys):
    """``python -m kvmem`` ends without the interpreter's teardown (kvmem.cli.run); what it printed into
    pipes (block-buffered) still arrives whole, and its exit status is main()'s."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONUNBUFFERED", None)  # buffered, as a user's shell has it

    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvmem", *args], capture_output=True, text=True, env=env,
                              timeout=300)

    for args in (["info", "--atlas", str(whole)], ["neuron", "--atlas", str(whole), "1:3"]):
        assert main(list(args)) == 0
        expected = capsys.readouterr().out
        done = command(*args)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout == expected and len(expected) > 200
    missing = command("info", "--atlas", str(tmp_path / "no-atlas"))
    assert missing.returncode == 2 and missing.stderr.startswith("kvmem: error: ") and not missing.stdout


@pytest.mark.parametrize("buffered", [True, False])
def test_output_cut_short_by_its_reader_ends_quietly(whole, buffered):
    """``kvmem info ATLAS | head -0``: the reader is gone before the command prints; no error line, no
    traceback, status 141 (SIGPIPE's, as a shell reports it), whether stdout is buffered or not."""
    from kvmem.cli import BROKEN_PIPE

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen([sys.executable, "-m", "kvmem", "info", "--atlas", str(whole)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    process.stdout.close()  # the reader leaves before the first line
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=300) == BROKEN_PIPE and stderr == ""
