"""The per-model projection cache is keyed by what is projected (float32 content), not by the scan's
dtype; cached tables are linked into atlases, which stay self-contained."""

from __future__ import annotations

import os
import shutil
import threading

import pyarrow.parquet as pq
import pytest
import torch
from projection_oracle import top_bottom

import kvmem
from kvmem.atomic import waited_lock
from kvmem.scanning import projection
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.projection import cached_projection_files

CONFIG = ScanConfig(top_n=4)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def bf16_exact_dir(llama_dir, tmp_path_factory):
    """The tiny Llama with every weight rounded to bfloat16 (so float32 and bfloat16 loads hold the same numbers)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(llama_dir)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.bfloat16().float())
    path = tmp_path_factory.mktemp("llama-bf16-exact")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(llama_dir).save_pretrained(path)
    return path


def tables(files) -> dict:
    return {name: pq.read_table(path) for name, path in files["files"].items()}


def test_same_weights_in_another_dtype_share_the_cache(bf16_exact_dir, cache):
    full = kvmem.load_model(bf16_exact_dir, dtype="float32")
    half = kvmem.load_model(bf16_exact_dir, dtype="bfloat16")
    assert half.dtype == torch.bfloat16 and half.keys(0).dtype == torch.bfloat16
    layers = list(range(full.n_layers))
    first = cached_projection_files(full, layers, CONFIG)
    second = cached_projection_files(half, layers, CONFIG)
    assert not first["cached"] and second["cached"] and first["files"] == second["files"]
    # the cached tables are what a float64 brute force gives for the bfloat16 model's weights
    got = tables(second)["values"].to_pandas()
    raw = got[(got.convention == "raw") & (got.kind == "promote") & (got.layer == 1) & (got.neuron == 5)]
    want = top_bottom(half.values(1)[5:6].float().numpy(), half.unembedding().float().numpy(), 4)
    assert raw.token_id.tolist() == want["top_ids"][0].tolist()
    assert raw.score.tolist() == want["top_scores"][0].tolist()


def test_a_change_in_what_is_projected_invalidates_the_cache(llama_dir, cache):
    model = kvmem.load_model(llama_dir)
    layers = list(range(model.n_layers))
    first = cached_projection_files(model, layers, CONFIG)
    assert cached_projection_files(model, layers, CONFIG)["cached"]
    # same weight files (same fingerprint), but the values read differently: e.g. a norm gain folded in
    down = model.hf_model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        down.mul_(torch.linspace(0.5, 1.5, down.shape[0])[:, None])
    changed = cached_projection_files(model, layers, CONFIG)
    assert not changed["cached"] and changed["files"] != first["files"]
    values = tables(changed)["values"].to_pandas()
    row = values[(values.convention == "raw") & (values.kind == "promote") & (values.layer == 1) & (values.neuron == 3)]
    want = top_bottom(model.values(1)[3:4].float().numpy(), model.unembedding().float().numpy(), 4)
    assert row.token_id.tolist() == want["top_ids"][0].tolist()


def test_the_record_beside_the_tables_names_the_method(llama_dir, cache):
    """The entry records the method that computed it; a second call reads the entry (the same files)."""
    model = kvmem.load_model(llama_dir)
    layers = list(range(model.n_layers))
    first = cached_projection_files(model, layers, CONFIG)
    assert not first["cached"] and first["method"] == "torch-screen"
    again = cached_projection_files(model, layers, CONFIG)
    assert again["cached"] and again["files"] == first["files"] and again["method"] == "torch-screen"
    computed = tables(first)["keys"].to_pandas()
    assert len(computed) == model.n_layers * model.d_ff * 2 * 2 * CONFIG.top_n  # key and gate, top and bottom


def test_atlas_links_the_cached_files_and_survives_their_deletion(gpt2_model, cache, tmp_path):
    atlas = kvmem.scan(gpt2_model, ["one small document.", "and another one"], out=tmp_path / "a", top_k=2,
                       window=8, top_n=3, progress=False, projections="eager")
    files = cached_projection_files(gpt2_model, atlas.layers, atlas.manifest.config)
    assert files["cached"] and atlas.manifest.projection["method"] == files["method"]
    for name, source in files["files"].items():
        assert os.path.samefile(source, atlas.path / f"{name}.parquet")  # a link: no bytes rewritten
    before = atlas.values(1, 2)
    for source in files["files"].values():
        os.remove(source)
    assert kvmem.open(atlas.path).values(1, 2).equals(before)


def test_a_process_waiting_for_an_entry_reads_it_instead_of_computing_it(gpt2_model, tmp_path, monkeypatch):
    """Two scans that need the same cache entry at once compute it once: the second waits on the entry's
    lock (a real flock, held here), then finds the entry that the holder wrote and reads it."""
    layers = list(range(gpt2_model.n_layers))
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "a"))
    computed = cached_projection_files(gpt2_model, layers, CONFIG)
    entry = computed["files"]["values"].parent
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "b"))
    target = tmp_path / "b" / "projections" / entry.name
    got = {}
    with waited_lock(target.parent / f".{entry.name}.lock"):
        waiter = threading.Thread(target=lambda: got.update(cached_projection_files(gpt2_model, layers, CONFIG)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not target.exists()  # waiting on the lock, not computing
        shutil.copytree(entry, target)  # what the holder of the lock would have written
    waiter.join(timeout=60)
    assert got["cached"] and got["files"]["values"] == target / "values.parquet"
    assert tables(got)["values"].equals(tables(computed)["values"])


def test_a_cached_entry_is_read_without_projecting(gpt2_model, cache, monkeypatch):
    """A scan whose projections are cached projects nothing; a missing entry does."""
    layers = list(range(gpt2_model.n_layers))
    first = cached_projection_files(gpt2_model, layers, CONFIG)

    def refuse(*args, **kwargs):
        raise AssertionError("projected for a cached entry")

    monkeypatch.setattr(projection, "project_rows", refuse)
    second = cached_projection_files(gpt2_model, layers, CONFIG)
    assert not first["cached"] and second["cached"] and second["files"] == first["files"]
    assert second["method"] == first["method"] != "unknown"
    with pytest.raises(AssertionError, match="projected for a cached entry"):  # a missing entry does project
        cached_projection_files(gpt2_model, layers[:1], CONFIG)


def test_kept_rows_answer_without_the_model_once_their_key_is_remembered(gpt2_dir, cache, tmp_path):
    """A whole layer computed with the model the manifest names is kept, and its cache key remembered under what the
    manifest says of that model: once the model's directory is gone, a later reader gets the same rows. Until a
    key is remembered, nothing answers without the model, and a model passed in by the caller is keyed by its own
    weights and never remembered (it may be edited in memory)."""
    weights = tmp_path / "model"
    shutil.copytree(gpt2_dir, weights)
    model = kvmem.load_model(weights, device="cpu")
    atlas = kvmem.scan(model, ["one small document.", "and another one"], out=tmp_path / "a", top_k=2, window=8,
                       top_n=3, progress=False)
    remembered = cache / "projections" / "remembered"
    convention, everyone = atlas.default_convention, range(atlas.d_ff)
    want = kvmem.open(atlas.path, model=model).projection_rows("values", 1, everyone, labels=[convention])
    assert not remembered.exists()  # the caller's model is not remembered
    weights.rename(tmp_path / "moved")  # the model cannot load: its directory is gone
    with pytest.raises(kvmem.KvmemError, match="cannot load here"):  # no key is known yet without the model
        kvmem.open(atlas.path).projection_rows("values", 1, everyone, labels=[convention])
    (tmp_path / "moved").rename(weights)
    loaded = kvmem.open(atlas.path)
    assert loaded.projection_rows("values", 1, everyone, labels=[convention]).equals(want)
    assert loaded.projections.loaded and len(list(remembered.iterdir())) == 2  # the whole tables' key, the layer's
    weights.rename(tmp_path / "moved")
    again = kvmem.open(atlas.path)
    assert again.projection_rows("values", 1, everyone, labels=[convention]).equals(want)
    assert not again.projections.loaded
    with pytest.raises(kvmem.KvmemError, match="cannot load here"):  # another layer is not kept: computing it
        again.projection_rows("values", 0, everyone, labels=[convention])  # needs the model
