"""Faults made for real while ``kvmem scan`` writes its atlas: one line on stderr, exit 2, nothing
half-written left behind.

Two ways to run out of room, both without mocks:
- a 512 KiB tmpfs mounted as the parent of ``--out`` (needs root; the atlas of this scan is about
  2 MB, so the disk fills while the tables are written: ENOSPC);
- a file-size limit (``RLIMIT_FSIZE``, set in the child before it runs, SIGXFSZ ignored) so that
  the kernel refuses writes past 64 KiB with EFBIG. This needs no privileges, so it runs everywhere.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCAN = ["--corpus", "pydoc", "--max-tokens", "2000", "--window", "32", "--top-k", "4", "--quiet"]


def cli(args: list[str], *, preexec_fn=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m kvmem ARGS`` in a fresh process (this checkout first on the path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kvmem", *args], capture_output=True, text=True, env=env,
                          preexec_fn=preexec_fn, timeout=timeout)


def assert_one_line_exit_2(result: subprocess.CompletedProcess, *reason: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("kvmem: error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert any(r in lines[0] for r in reason), lines[0]
    return lines[0]


def test_disk_full_on_a_small_tmpfs(gpt2_dir, tmp_path):
    """ENOSPC for real: --out on a 512 KiB tmpfs. The scan's tables do not fit; the command says so in
    one line, exits 2, and leaves the file system as empty as it found it (no staged directory)."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); "
                    f"test_file_size_limit_while_writing makes the same fault without privileges")
    try:
        result = cli(["scan", "--model", str(gpt2_dir), "--out", str(mount / "atlas"), *SCAN])
        line = assert_one_line_exit_2(result, "No space left on device")
        assert "free some space" in line and str(mount / "atlas") in line
        assert list(mount.iterdir()) == []  # neither the atlas nor its staging directory
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_file_size_limit_while_writing(gpt2_dir, tmp_path):
    """EFBIG for real (an OSError that is not ENOSPC): the child may write no file past 64 KiB, and the
    atlas's value tables are larger. One line naming the limit, exit 2, no staging directory left, and
    the atlas already at --out (replaced with --overwrite) is left exactly as it was."""
    from kvmem.cli import main

    out = tmp_path / "atlas"
    assert main(["scan", "--model", str(gpt2_dir), "--out", str(out), *SCAN, "--top-k", "2"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = cli(["scan", "--model", str(gpt2_dir), "--out", str(out), "--overwrite", *SCAN],
                preexec_fn=_limit_file_size)
    line = assert_one_line_exit_2(again, "File too large")
    assert "ulimit -f" in line and str(out) in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atlas"]


CHECKPOINTING = [*SCAN, "--max-tokens", "700", "--checkpoint-every", "200", "--batch-size", "1", "--block-documents", "1",
                 "--random-samples", "20"]  # the checkpoint sizes below (2.8 MB) hold 20 random samples per layer


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(gpt2_dir, tmp_path):
    """ENOSPC for real in the middle of a scan: a 4 MiB tmpfs holds one checkpoint of this scan (2.8 MB)
    but not the next one beside it. One line, exit 2; the first checkpoint stays whole and nothing else
    is left; after the disk grows, --resume finishes the scan with the tables of an uninterrupted one."""
    from kvmem.cli import main

    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
    try:
        argv = ["scan", "--model", str(gpt2_dir), "--out", str(mount / "atlas"), *CHECKPOINTING]
        result = cli(argv)
        line = assert_one_line_exit_2(result, "No space left on device")
        assert "cannot write the checkpoint" in line and "previous checkpoint is kept" in line
        checkpoint = mount / "atlas.checkpoint"
        assert sorted(p.name for p in mount.iterdir()) == ["atlas.checkpoint"]
        names = sorted(p.name for p in checkpoint.iterdir())
        assert len(names) == 2 and "state.json" in names, names  # the committed pair, nothing half-written
        assert json.loads((checkpoint / "state.json").read_text())["batches"] > 0
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)
        assert main([*argv, "--resume"]) == 0
        assert main(["scan", "--model", str(gpt2_dir), "--out", str(tmp_path / "whole"), *CHECKPOINTING]) == 0
        tables = sorted(p.name for p in (tmp_path / "whole").glob("*.parquet"))
        assert tables == sorted(p.name for p in (mount / "atlas").glob("*.parquet")) and "triggers.parquet" in tables
        for path in tables:
            assert (mount / "atlas" / path).read_bytes() == (tmp_path / "whole" / path).read_bytes(), path
        assert not checkpoint.exists()
    finally:
        subprocess.run(["umount", str(mount)], check=True)
