"""benchmarks/gpu_check.py stays runnable where no GPU is lent: its dry run (the CPU standing in for the
GPU) runs every step; each agreement criterion (benchmarks/gpu_criteria.py) fails on tables that break
it alone, ties are judged as sets and undecidable ones by value; rows are on disk as soon as measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvmem
from kvmem.builtin import gpt2_random_dir

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402  (a script, found on the benchmarks path)
import gpu_criteria  # noqa: E402

STEPS = ["models", "throughput", "agreement", "agreement", "bf16", "per-document", "two runs", "resume after SIGKILL",
         "torchrun"]


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), *args], capture_output=True, text=True,
                          timeout=900)


def test_dry_run_on_cpu_runs_every_step(tmp_path):
    done = run_script("--device", "cpu", "--out", str(tmp_path / "check"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "check" / "rows.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == STEPS  # two agreement rows: GPT-2 and the gated Llama
    judged = [r for r in rows if r["step"] != "throughput"]
    assert all(r["result"] == "ok" for r in judged), [r for r in judged if r["result"] != "ok"]
    assert "GPT-2 small" in rows[2]["details"] and "tiny Llama (gated)" in rows[3]["details"]
    for criterion in gpu_criteria.AGREEMENT:
        assert f"{criterion}:" in rows[2]["details"] and f"{criterion}:" in rows[5]["details"]
    # the stand-in's bottom triggers tie at GELU's floor as GPT-2 small's do: judged by value, not position
    bottom = rows[2]["details"].split("bottom ")[1].split("decidable")[0]
    assert float(bottom.split("(")[1].rstrip("% ")) < 50, rows[2]["details"]
    assert "SIGKILL after the checkpoint at" in rows[7]["details"] and "byte-identical" in rows[7]["details"]
    assert "tok/s" in rows[1]["details"]
    table = (tmp_path / "check" / "table.md").read_text().splitlines()
    assert len(table) == 2 + len(rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script checks it instead")
def test_without_a_gpu_it_says_so_in_one_line():
    done = run_script()
    assert done.returncode == 0
    assert done.stdout.strip().count("\n") == 0 and "no CUDA device" in done.stdout


@pytest.fixture(scope="module")
def atlas_tables(tmp_path_factory):
    model = kvmem.load_model(gpt2_random_dir(n_layer=1, n_embd=32, n_head=2, n_positions=64), device="cpu")
    atlas = kvmem.scan(model, "pydoc", out=tmp_path_factory.mktemp("gpu-check") / "a", max_tokens=400, top_k=6,
                       window=32, top_n=4, progress=False)
    return gpu_check.tables(atlas)


def copy(tables: dict) -> dict:
    return {name: frame.copy(deep=True) for name, frame in tables.items()}


def failing(cpu: dict, gpu: dict) -> list[str]:
    criteria = gpu_criteria.compare(cpu, gpu)
    assert [c.name for c in criteria] == list(gpu_criteria.AGREEMENT)
    return [c.name for c in criteria if not c.ok]


def tie_free_trigger(tables: dict) -> int:
    """Index (in the triggers table) of a rank-0 'top' trigger alone in its tie group, inside its list."""
    t = tables["triggers"]
    key = ["layer", "neuron", "kind"]
    top = t[t.kind.isin(("top", "bottom"))].sort_values([*key, "rank"])
    groups = gpu_criteria.tie_groups(top, key)
    alone = groups.group.map(groups.group.value_counts()) == 1
    rows = top[alone & ~groups.undecidable & (top["rank"] == 0) & (top.kind == "top")]
    return int(rows.index[0])


def test_identical_tables_meet_every_criterion(atlas_tables):
    assert failing(atlas_tables, copy(atlas_tables)) == []


def test_each_agreement_criterion_fails_alone(atlas_tables):
    """Every criterion of the agreement check is in force: tables that break one of them fail it, and only it."""
    cases = {}

    gpu = copy(atlas_tables)  # one neuron's std off by 1e-3 relative (tolerance 1e-4)
    gpu["neurons"].loc[0, "std"] *= 1 + 1e-3
    cases["statistics"] = gpu

    gpu = copy(atlas_tables)  # 1% of every neuron's counts moved one bin up (limit 0.1% of all counts)
    counts = np.stack(gpu["histograms"].counts.to_numpy())
    busiest = counts.argmax(axis=1)
    for row, column in enumerate(busiest):
        moved = max(1, counts[row, column] // 100)
        counts[row, column] -= moved
        counts[row, column + 1 if column + 1 < counts.shape[1] else column - 1] += moved
    gpu["histograms"]["counts"] = list(counts)
    cases["histogram"] = gpu

    gpu = copy(atlas_tables)  # a tie-free trigger at another position, same activation
    row = tie_free_trigger(atlas_tables)
    gpu["triggers"].loc[row, "pos"] += 1
    cases["trigger positions"] = gpu

    gpu = copy(atlas_tables)  # a kept activation off by 1e-3 relative at the same position
    gpu["triggers"].loc[row, "activation"] *= 1 + 1e-3
    cases["trigger activations"] = gpu

    gpu = copy(atlas_tables)  # the top promoted token of a tie-free value row swapped
    values = gpu["values"]
    first = values[(values.kind == "promote") & (values["rank"] == 0)]
    second = values[(values.kind == "promote") & (values["rank"] == 1)].set_index(["layer", "neuron", "convention"])
    gaps = first.score.to_numpy() - second.score.reindex(
        first.set_index(["layer", "neuron", "convention"]).index).to_numpy()
    target = first.index[int(np.argmax(gaps))]
    values.loc[target, "token_id"] = (values.loc[target, "token_id"] + 1) % 50257
    cases["value top tokens"] = gpu

    assert set(cases) == set(gpu_criteria.AGREEMENT)
    for name, gpu in cases.items():
        assert failing(atlas_tables, gpu) == [name], name
        assert gpu_criteria.judged(gpu_criteria.compare(atlas_tables, gpu))[0] == "FAIL"
    assert gpu_criteria.judged(gpu_criteria.compare(atlas_tables, atlas_tables))[0] == "ok"


def test_near_ties_are_not_judged_but_must_leave_enough(atlas_tables):
    """Swapping two triggers whose activations are within the tolerance passes; if most are ties, it fails."""
    gpu = copy(atlas_tables)
    t = gpu["triggers"]
    tops = t[(t.kind == "top") & (t["rank"] <= 1)].sort_values(["layer", "neuron", "rank"])
    first, second = tops.index[0], tops.index[1]
    assert t.loc[first, "neuron"] == t.loc[second, "neuron"]
    cpu = copy(atlas_tables)
    cpu["triggers"].loc[second, "activation"] = cpu["triggers"].loc[first, "activation"]  # an exact tie
    gpu["triggers"].loc[second, "activation"] = cpu["triggers"].loc[first, "activation"]
    for column in ("doc", "pos"):
        gpu["triggers"].loc[[first, second], column] = gpu["triggers"].loc[[second, first], column].to_numpy()
    assert "trigger positions" not in failing(cpu, gpu)
    flat = copy(atlas_tables)
    flat["triggers"]["activation"] = 1.0  # every trigger tied: nothing to judge, so the check refuses
    assert "trigger positions" in failing(flat, copy(flat))


def test_ties_are_compared_as_sets_and_undecidable_ones_by_value(atlas_tables):
    """Inside a list, a tie group's positions must be the same set (any order); the group holding the last
    kept rank is judged by its activations only, which must lie at the tied value."""
    t = atlas_tables["triggers"]
    tops = t[t.kind == "top"].sort_values(["layer", "neuron", "rank"])
    first, second, third = tops.index[:3]
    assert len(set(t.loc[[first, second, third], "neuron"])) == 1
    cpu = copy(atlas_tables)
    cpu["triggers"].loc[[first, second], "activation"] = cpu["triggers"].loc[first, "activation"]  # ranks 0, 1 tie
    gpu = copy(cpu)
    gpu["triggers"].loc[second, ["doc", "pos"]] = gpu["triggers"].loc[third, ["doc", "pos"]].to_numpy()  # not in the tie
    assert "trigger positions" in failing(cpu, gpu)

    last = tops[(tops.layer == tops.layer.iloc[0]) & (tops.neuron == tops.neuron.iloc[0])].index[-1]
    moved = copy(atlas_tables)  # the last rank: another position at the same value is not judged
    moved["triggers"].loc[last, "pos"] += 1000
    assert "trigger positions" not in failing(atlas_tables, moved)
    off = copy(atlas_tables)  # but a value away from the tie is
    off["triggers"].loc[last, "activation"] *= 1 + 1e-2
    assert "trigger positions" in failing(atlas_tables, off)


def test_bf16_criteria_fail_on_a_wrong_std(atlas_tables):
    assert all(c.ok for c in gpu_criteria.compare_bf16(atlas_tables, copy(atlas_tables)))
    gpu = copy(atlas_tables)
    gpu["neurons"]["std"] *= 1.2  # 20% off everywhere (tolerance 5%)
    names = [c.name for c in gpu_criteria.compare_bf16(atlas_tables, gpu) if not c.ok]
    assert names == [f"std within {gpu_criteria.BF16_RTOL:g}"]


def test_rows_are_on_disk_when_their_step_ends(tmp_path):
    check = gpu_check.Check(tmp_path / "out", "cpu", budget_s=600)
    seen = []

    def second():
        seen.append((tmp_path / "out" / "rows.jsonl").read_text())  # what a crash now would leave
        raise RuntimeError("the GPU fell off the bus")

    check.step("first", lambda: [dict(result="ok", details="measured 1.0", peak_gib="-")])
    check.step("second", second)
    check.step("third", lambda: [dict(result="ok", details="still runs", peak_gib="-")])
    assert json.loads(seen[0].strip())["details"] == "measured 1.0"
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert [(r["step"], r["result"]) for r in rows] == [("first", "ok"), ("second", "FAIL"), ("third", "ok")]
    assert "RuntimeError: the GPU fell off the bus" in rows[1]["details"]
    assert "| second | FAIL |" in (tmp_path / "out" / "table.md").read_text()
