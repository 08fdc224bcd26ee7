"""The torch step waits for the device at most twice per layer and batch, per-document sides and samples
included, counted by the operators torch's dispatcher runs (benchmarks/host_syncs.py: ``nonzero``,
``bincount``, ``item``/``is_nonzero`` (``int()``/``bool()``), boolean-mask indexing, ``.tolist()`` ...)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_syncs  # noqa: E402  (a script, found on the benchmarks path)

from kvmem.scanning.reads import Reads, run_rounds, sizes  # noqa: E402
from kvmem.scanning.statistics import OPTIONAL  # noqa: E402


@pytest.mark.parametrize("per_document", [False, True])
def test_two_waits_per_layer_and_batch(gpt2_model, per_document):
    """Every statistic composed (the optional ones too): their reads share the layer's two rounds."""
    result = host_syncs.count(gpt2_model, "pydoc", tokens=1500, per_document=per_document, batch_size="4",
                              statistics=OPTIONAL)
    assert result["batches"] >= 3 and result["layers"] == 2
    assert result["step_syncs_per_layer_per_batch"] <= 2, result
    assert set(result["step_syncs_by_operator_per_batch"]) == {"Tensor.tolist"}, result


def test_the_counter_sees_what_bool_and_bincount_dispatch():
    """The operators the step must not run are the ones the counter counts (inference mode included)."""
    mode = host_syncs.Counting()
    mode.part = "step"
    with torch.inference_mode(), mode:
        x = torch.arange(6.0)
        bool((x > 2).any()), int(x.sum()), torch.bincount(x.long()), x[x > 2], x.nonzero()
    assert {"is_nonzero", "item", "bincount", "index[bool mask]", "nonzero"} <= set(mode.syncs["step"]), mode.syncs


def test_rounds_share_one_read():
    """Pending steps of one block read their sizes together: as many reads as the longest needs."""
    reads, log = Reads(), []

    def step(name: str, rounds: int):
        for r in range(rounds):
            (value,) = yield sizes(torch.tensor(10 * r + len(name)))
            log.append((name, value))

    real = torch.Tensor.tolist
    calls = []
    torch.Tensor.tolist = lambda self: calls.append(1) or real(self)
    try:
        with reads.collecting():
            reads.defer(step("a", 2))
            reads.defer(step("bb", 1))
            reads.defer(step("ccc", 2))
            assert log == []  # nothing ran inside the block
    finally:
        torch.Tensor.tolist = real
    assert len(calls) == 2
    assert sorted(log) == [("a", 1), ("a", 11), ("bb", 2), ("ccc", 3), ("ccc", 13)]
    run_rounds([])
