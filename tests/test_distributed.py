"""torchrun: the README's command on 3 CPU ranks (gloo) writes the atlas one process writes, byte for byte;
the process group's arguments (nccl bound to the rank's device, a settable timeout) are pinned without
a GPU; rank 0 merges the ranks' states one at a time, in rank order."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import kvmem
from kvmem.cli import main
from kvmem.scanning import distributed

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"


def readme_torchrun_command() -> list[str]:
    """The README's torchrun example on CPU processes (the one that sets OMP_NUM_THREADS), as words."""
    readme = (ROOT / "README.md").read_text()
    line = next(line.strip() for line in readme.splitlines() if re.match(r"OMP_NUM_THREADS=\S+ torchrun --standalone\b", line))
    return shlex.split(line)


def same_tables(a: Path, b: Path) -> list[str]:
    """The tables whose parquet bytes differ, and 'manifest' if the manifests differ but for timing."""
    names = sorted({p.name for p in a.glob("*.parquet")} | {p.name for p in b.glob("*.parquet")})
    differ = [n for n in names if not (a / n).exists() or not (b / n).exists() or (a / n).read_bytes() != (b / n).read_bytes()]
    ma, mb = (json.loads((x / "manifest.json").read_text()) for x in (a, b))
    ma.pop("timing"), mb.pop("timing")
    return differ + (["manifest"] if ma != mb else [])


@pytest.mark.skipif(not TORCHRUN.exists(), reason="the venv has no torchrun script")
def test_readme_torchrun_example_equals_one_process(llama_dir, tmp_path):
    """On the tiny gated model, so the taxonomy's sums (gate/up quadrants, each trigger's gate and up,
    Σ m·position, unigrams) are byte-identical across ranks too."""
    words = readme_torchrun_command()
    env_words = [w for w in words if re.fullmatch(r"[A-Z_]+=\S*", w)]
    command = words[len(env_words):]
    assert env_words == ["OMP_NUM_THREADS=1"] and command[:4] == ["torchrun", "--standalone", "--nproc-per-node", "3"]
    assert command[4:8] == ["-m", "kvmem", "scan", "--model"]
    # 200 documents: four blocks of 64, so every rank has a share (blocks 0 and 3, 1, 2)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"Document {i}: " + "the cat sat on mat " * (1 + i % 5)})
                                for i in range(200)))
    given = {"--model": str(llama_dir), "--corpus": str(corpus)}
    command = [str(TORCHRUN)] + [given.get(before, word) for before, word in zip(["", *command], command)][1:]
    out = command.index("--out") + 1
    env = {**os.environ, **dict(w.split("=", 1) for w in env_words)}
    one = [sys.executable, *command[4:]]  # the same scan in one process
    one[one.index("--out") + 1] = str(tmp_path / "one")
    command[out] = str(tmp_path / "three")
    subprocess.run(one, env=env, check=True, timeout=600, capture_output=True)
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert same_tables(tmp_path / "one", tmp_path / "three") == []
    three = kvmem.open(tmp_path / "three")
    assert three.manifest.timing["world_size"] == 3 and kvmem.open(tmp_path / "one").manifest.timing["world_size"] == 1
    assert three.manifest.tokens == kvmem.open(tmp_path / "one").manifest.tokens > 0
    assert three.neurons.quadrant_pp.notna().all() and three.table("triggers").gate_pre.notna().any()
    assert not list(tmp_path.glob("three*.checkpoint"))


MERGE_PROBE = """
import os, sys
from kvmem.scanning import distributed
rank, world = distributed.start("cpu")
events = []
def from_bytes(data):
    events.append("recv " + data.decode())
    return data.decode()
def merge(a, b):
    events.append(f"merge {b}")
    return a + "+" + b
part = f"r{rank}:" + "x" * (3 * rank)
merged = distributed.merge_to_rank0(part, rank=rank, world=world, device="cpu", to_bytes=str.encode,
                                    from_bytes=from_bytes, merge=merge)
if rank == 0:
    print("EVENTS", "|".join(events))
    print("MERGED", merged)
else:
    assert merged == part and events == []
distributed.stop()
"""


@pytest.mark.skipif(not TORCHRUN.exists(), reason="the venv has no torchrun script")
def test_rank0_merges_one_state_at_a_time_in_rank_order(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(MERGE_PROBE)
    run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "4", str(script)],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("EVENTS", "MERGED")))
    # each received state is merged before the next is received: rank 0 never holds two of them
    assert lines["EVENTS"].split("|") == ["recv r1:xxx", "merge r1:xxx", "recv r2:xxxxxx", "merge r2:xxxxxx",
                                          "recv r3:xxxxxxxxx", "merge r3:xxxxxxxxx"]
    assert lines["MERGED"] == "r0:+r1:xxx+r2:xxxxxx+r3:xxxxxxxxx"


def test_nccl_group_is_bound_to_the_rank_device(monkeypatch):
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.group_arguments("cuda:3") == {"backend": "nccl", "timeout": timedelta(hours=2),
                                                     "device_id": torch.device("cuda", 3)}
    monkeypatch.setenv("LOCAL_RANK", "5")  # a bare "cuda" under torchrun is the rank's own GPU
    assert distributed.group_arguments("cuda", timeout_s=60)["device_id"] == torch.device("cuda", 5)
    assert distributed.group_arguments("cuda", timeout_s=60)["timeout"] == timedelta(seconds=60)
    assert distributed.group_arguments("cpu") == {"backend": "gloo", "timeout": timedelta(hours=2)}
    with pytest.raises(kvmem.KvmemError, match="cpu \\(gloo\\) or cuda \\(nccl\\), not on 'meta'"):
        distributed.group_arguments("meta")


def test_start_sets_the_rank_device_before_the_group(monkeypatch):
    """What start() hands torch: the device made current first, then the group with the same device."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setenv("RANK", "2"), monkeypatch.setenv("WORLD_SIZE", "4"), monkeypatch.setenv("MASTER_ADDR", "h")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    assert distributed.start("cuda:2", timeout_s=600) == (2, 4)
    assert calls == [("set_device", torch.device("cuda", 2)),
                     ("init", {"backend": "nccl", "timeout": timedelta(seconds=600), "device_id": torch.device("cuda", 2)})]


def test_timeout_is_settable_and_checked(monkeypatch):
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.timeout_seconds() == distributed.DEFAULT_TIMEOUT_S == 7200
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "90")
    assert distributed.timeout_seconds() == 90 and distributed.timeout_seconds(30) == 30
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "two hours")
    with pytest.raises(kvmem.KvmemError, match="KVMEM_DIST_TIMEOUT must be a number of seconds, got 'two hours'"):
        distributed.timeout_seconds()
    for bad in (0, -5.0, True):
        with pytest.raises(kvmem.KvmemError, match="--dist-timeout must be a positive number of seconds"):
            distributed.timeout_seconds(bad)


def test_cli_refuses_a_bad_timeout_in_one_line(capsys, tmp_path):
    code = main(["scan", "--model", "gpt2-random", "--corpus", "pydoc", "--out", str(tmp_path / "a"),
                 "--dist-timeout", "0"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvmem: error: --dist-timeout must be a positive number of seconds (e.g. 7200), got 0.0"


def test_outside_torchrun_there_is_no_group(monkeypatch):
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.start("cuda:0") == (0, 1) and not dist.is_initialized()
