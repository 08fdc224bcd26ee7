"""``--batch-size auto``: the probe's memory estimate holds for long documents (on the CPU, with the GPU's
accounting simulated: the bytes of the tensors alive, as torch's CUDA allocator counts what it has
handed out), a resumed scan reuses the size its checkpoint recorded, and ranks agree on one size."""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvmem.plan import Batch, WindowText
from kvmem.scanning import distributed, runner
from kvmem.scanning.checkpoint import save_state
from kvmem.scanning.config import ScanConfig


class LiveBytes(TorchDispatchMode):
    """The peak, inside the block, of the bytes held by storages created inside it and still referenced by
    a tensor (the memory model of ``torch.cuda.max_memory_allocated`` minus what was there before)."""

    def __enter__(self):
        self.live: dict[int, list] = {}  # storage pointer -> [bytes, live tensors]
        self.now = self.bytes = 0
        return super().__enter__()

    def _release(self, pointer: int) -> None:
        entry = self.live.get(pointer)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.live[pointer]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            pointer = t.untyped_storage().data_ptr()
            if pointer in inputs and pointer not in self.live:
                continue  # an in-place result or a view of memory from before the block
            entry = self.live.setdefault(pointer, [t.untyped_storage().nbytes(), 0])
            if entry[1] == 0:
                self.now += entry[0]
                self.bytes = max(self.bytes, self.now)
            entry[1] += 1
            weakref.finalize(t, self._release, pointer)
        return out


def layout_batch(window: int, pieces: list[tuple[int, int]]) -> Batch:
    """Windows of (document, tokens), tokens drawn from the vocabulary (seeded, not the probe's seed):
    consecutive windows of one document continue it."""
    generator = torch.Generator().manual_seed(1)
    texts, starts = [], {}
    for doc, tokens in pieces:
        start = starts.get(doc, 0)
        texts.append(WindowText(doc, f"d{doc}", start, tuple(torch.randint(0, 50257, (tokens,), generator=generator).tolist()),
                                -1, ""))
        starts[doc] = start + tokens
    return Batch(0, texts, sum(t for _, t in pieces))


def step_peak(model, config, window: int, batch: Batch) -> int:
    state = runner._fresh_state(model, config, runner._check_layers(model, config))  # a first, dense batch
    plan = runner.token_plan(model, config, batch_size=len(batch.windows))
    with LiveBytes() as peak:
        runner._run_batch(model, batch, plan, config, state)
    return peak.bytes


def test_the_estimate_holds_for_long_documents(gpt2_model, monkeypatch):
    """The probe's peak at 8 windows, scaled to B windows, bounds a first batch's peak at 16 and 64 windows
    for one long document, a long document after short ones, and short documents each."""
    window = 32
    config = ScanConfig(per_document=True, window=window, top_k=25, batch_size="auto")
    layers = runner._check_layers(gpt2_model, config)
    with torch.inference_mode():
        peak = runner.probe_peak(gpt2_model, config, window, lambda: runner._fresh_state(gpt2_model, config, layers),
                                 LiveBytes)
    assert runner.PROBE_WINDOWS == 8 and peak > 0
    for windows in (16, 64):
        estimate = peak * windows / runner.PROBE_WINDOWS
        assert runner.batch_for(peak, runner.PROBE_WINDOWS, estimate) == windows  # the budget that allows this batch
        layouts = {
            "one long document": [(0, window)] * windows,
            "a long document after short ones": [(d, 3) for d in range(windows // 2)] + [(99, window)] * (windows // 2),
            "short documents": [(d, window) for d in range(windows)],
        }
        measured = {name: step_peak(gpt2_model, config, window, layout_batch(window, pieces))
                    for name, pieces in layouts.items()}
        assert all(0 < bytes_ <= estimate for bytes_ in measured.values()), (windows, estimate, measured)


def test_a_resumed_scan_keeps_the_recorded_batch_size(gpt2_model, tmp_path):
    """An 'auto' scan resumed from a checkpoint takes the size the checkpoint was saved with, whatever a
    new probe would choose (here the CPU's rule gives 2048 // 32 = 64 windows, the checkpoint says 3)."""
    config = ScanConfig(window=32, batch_size="auto", max_tokens=200, checkpoint_every=50)
    state = runner.stream(gpt2_model, "pydoc", window=32, batch_size=3, max_tokens=100)
    plan = runner.token_plan(gpt2_model, config, batch_size=3)
    save_state(tmp_path / "atlas.checkpoint", state, {"plan": plan.to_dict()})
    assert runner.resolve_batch_size(gpt2_model, config, 32) == 64
    agreed = runner.agreed_batch_size(gpt2_model, config, checkpoint=tmp_path / "atlas.checkpoint", resume=True,
                                      world=1)
    assert agreed == 3
    assert runner.agreed_batch_size(gpt2_model, config, checkpoint=tmp_path / "none", resume=False, world=1) == 64
    assert runner.agreed_batch_size(gpt2_model, ScanConfig(batch_size=5), checkpoint=tmp_path / "atlas.checkpoint",
                                    resume=True, world=1) is None


def _rank(rank: int, world: int, port: int, values: list[int], out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = distributed.smallest(values[rank], "cpu")
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_smallest_size():
    """Under torchrun every rank probes its own device; all take the smallest size."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Manager().dict()
    mp.start_processes(_rank, args=(2, port, [7, 5], out), nprocs=2, start_method="spawn", join=True)
    assert dict(out) == {0: 5, 1: 5}
