"""benchmarks/gpu_check.py stays runnable where no GPU is lent: a dry run with the CPU standing in
for the GPU runs every step, and its agreement check fails on atlases that really differ."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvmem
from kvmem.builtin import gpt2_random_dir

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402  (a script, found on the benchmarks path)


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), *args], capture_output=True, text=True,
                          timeout=600)


def test_dry_run_on_cpu_checks_both_architectures():
    done = run_script("--device", "cpu", "--skip-smollm2")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny")]
    assert [row.split(" | ")[1] for row in rows] == ["ok", "ok"], done.stdout
    assert "tiny GPT-2 CPU vs CPU" in rows[0] and "tiny Llama CPU vs CPU" in rows[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script checks it instead")
def test_without_a_gpu_it_says_so_in_one_line():
    done = run_script()
    assert done.returncode == 0
    assert done.stdout.strip().count("\n") == 0 and "no CUDA device" in done.stdout


def test_compare_fails_on_atlases_that_differ(tmp_path):
    settings = dict(max_tokens=300, top_k=4, window=32, top_n=3, progress=False)
    atlases = [kvmem.scan(kvmem.load_model(gpt2_random_dir(n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=seed)),
                          "pydoc", out=tmp_path / str(seed), **settings) for seed in (0, 1)]
    assert gpu_check.compare(atlases[0], atlases[0])["ok"]
    differ = gpu_check.compare(atlases[0], atlases[1])
    assert not differ["ok"] and not differ["stats"]


def test_whole_scan_ratio_on_cpu(tmp_path):
    model = kvmem.load_model(gpt2_random_dir(n_layer=1, n_embd=32, n_head=2, n_positions=64))
    result = gpu_check.whole_scan_ratio(model, 400, 4, tmp_path)
    assert result["ratio"] > 0 and result["peak_gb"] == "-"
    assert {"stream", "texts", "write"} <= set(result["phases"])
