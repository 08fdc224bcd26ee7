"""The atlas writer (kvmem/scanning/writer.py): how tables are handed to the writer threads, and what the
scan's process looks like after it."""

from __future__ import annotations

import pytest
import torch
from conftest import SHORT_DOCS

import kvmem
from kvmem.scanning import writer

WINDOW = 8


def test_tables_built_with_one_torch_thread_and_the_count_restored(gpt2_model, tmp_path, monkeypatch):
    """The neurons table keeps torch's threads (its reductions run before any writer thread); the other
    tables are built with one, and the caller's count comes back, after a scan and after a failed one
    (which also ends the open table streams' writer threads: the scan returns, nothing is left behind)."""
    seen = {}
    for name in ("neurons_table", "trigger_part"):
        build = getattr(writer, name)

        def spy(*args, build=build, name=name, **kwargs):
            seen[name] = torch.get_num_threads()
            return build(*args, **kwargs)

        monkeypatch.setattr(writer, name, spy)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        kvmem.scan(gpt2_model, SHORT_DOCS[:3], out=tmp_path / "a", top_k=2, window=WINDOW, progress=False)
        assert seen == {"neurons_table": 3, "trigger_part": 1}
        assert torch.get_num_threads() == 3

        def fails(layer, state):
            raise RuntimeError("table build failed")

        monkeypatch.setattr(writer, "sample_part", fails)  # the samples and triggers streams are open then
        with pytest.raises(RuntimeError, match="table build failed"):
            kvmem.scan(gpt2_model, SHORT_DOCS[:3], out=tmp_path / "b", top_k=2, window=WINDOW, progress=False)
        assert torch.get_num_threads() == 3
        assert not (tmp_path / "b").exists()  # nothing half written
    finally:
        torch.set_num_threads(before)
