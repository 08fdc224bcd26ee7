"""The atlas writer (kvmem/scanning/writer.py): how tables are handed to the writer threads, and what the
scan's process looks like after it."""

from __future__ import annotations

import pytest
import torch
from conftest import SHORT_DOCS

import kvmem
from kvmem.scanning import writer
from kvmem.scanning.statistics import extremes, samples

WINDOW = 8


def test_tables_built_with_one_torch_thread_and_the_count_restored(gpt2_model, tmp_path, monkeypatch):
    """The neurons table keeps torch's threads (its reductions run before any writer thread); the other
    tables are built with one, and the caller's count comes back, after a scan and after a failed one
    (which also ends the open table streams' writer threads: the scan returns, nothing is left behind)."""
    seen = {}
    for module, name in ((writer, "neurons_table"), (extremes, "trigger_part")):
        build = getattr(module, name)

        def spy(*args, build=build, name=name, **kwargs):
            seen[name] = torch.get_num_threads()
            return build(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        kvmem.scan(gpt2_model, SHORT_DOCS[:3], out=tmp_path / "a", top_k=2, window=WINDOW, progress=False)
        assert seen == {"neurons_table": 3, "trigger_part": 1}
        assert torch.get_num_threads() == 3

        def fails(*args):
            raise RuntimeError("table build failed")

        monkeypatch.setattr(samples.Samples, "layer_part", fails)  # the layer tables' streams are open then
        with pytest.raises(RuntimeError, match="table build failed"):
            kvmem.scan(gpt2_model, SHORT_DOCS[:3], out=tmp_path / "b", top_k=2, window=WINDOW, progress=False)
        assert torch.get_num_threads() == 3
        assert not (tmp_path / "b").exists()  # nothing half written
    finally:
        torch.set_num_threads(before)


def test_a_stream_takes_parts_and_part_builders(tmp_path):
    """A table stream takes parts, functions that build a part in its writer thread, and either giving
    nothing for a layer: the file is the one ``add`` writes for the whole table. A builder that fails
    fails ``wait`` with its own error."""
    import numpy as np
    import pyarrow as pa
    from layer_driver import new_layer

    rng = np.random.default_rng(0)
    states = {}
    for layer in (0, 1, 3):
        states[layer] = new_layer(5, 2)
        counts = states[layer]["histogram"].counts
        counts += torch.from_numpy(rng.integers(0, 9, counts.shape))

    def histograms_table(layers, states):
        statistic = states[layers[0]].composition["histogram"]
        return pa.concat_tables([states[layer].part("histograms", layer, statistic) for layer in layers])
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    with writer.TableWriter(whole, overwrite=False) as out:
        out.add("histograms", histograms_table([0, 1, 3], states))
        out.wait()
    with writer.TableWriter(parts, overwrite=False) as out:
        stream = out.stream("histograms")
        stream.put(histograms_table([0], states))
        stream.put(lambda: histograms_table([1], states))  # built in the writer thread
        stream.put(None)
        stream.put(lambda: None)
        stream.put(lambda: histograms_table([3], states))
        stream.close()
        out.wait()
    assert (parts / "histograms.parquet").read_bytes() == (whole / "histograms.parquet").read_bytes()

    def fails():
        raise RuntimeError("part build failed")

    with pytest.raises(RuntimeError, match="part build failed"), writer.TableWriter(tmp_path / "c", overwrite=False) as out:
        stream = out.stream("histograms")
        stream.put(fails)
        stream.close()
        out.wait()
    assert not (tmp_path / "c").exists()

    # a stream that holds at most one part ahead: parts handed over after its writer failed do not wait
    # for it forever (the failure comes out of wait), and one fed in turns with another writes the same file
    with pytest.raises(RuntimeError, match="part build failed"), writer.TableWriter(tmp_path / "d", overwrite=False) as out:
        stream = out.stream("histograms", ahead=1)
        stream.put(fails)
        for _ in range(20):
            stream.put(histograms_table([0], states))
        stream.close()
        out.wait()
    assert not (tmp_path / "d").exists()
    with writer.TableWriter(tmp_path / "e", overwrite=False) as out:
        streams = [out.stream(name, ahead=1) for name in ("triggers", "samples", "histograms")]
        for layer in (0, 1, 3):  # three streams fed in turns, each at most one part ahead: none waits on another
            for stream in streams[:2]:
                stream.put(lambda: None)
            streams[2].put(histograms_table([layer], states))
        for stream in streams:
            stream.close()
        out.wait()
    assert (tmp_path / "e" / "histograms.parquet").read_bytes() == (whole / "histograms.parquet").read_bytes()
