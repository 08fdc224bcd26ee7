"""The per-model projection cache is keyed by what is projected (float32 content), not by the scan's
dtype; cached tables are linked into atlases, which stay self-contained."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
import torch

import kvmem
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
    # the cached tables are what a float32 brute force gives for the bfloat16 model's weights
    got = tables(second)["values"].to_pandas()
    raw = got[(got.convention == "raw") & (got.kind == "promote") & (got.layer == 1) & (got.neuron == 5)]
    scores = half.values(1)[5].float() @ half.unembedding().float()
    assert raw.token_id.tolist() == torch.topk(scores, 4).indices.tolist()


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
    assert row.token_id.tolist() == torch.topk(model.values(1)[3].float() @ model.unembedding().float(), 4).indices.tolist()


def test_atlas_links_the_cached_files_and_survives_their_deletion(gpt2_model, cache, tmp_path):
    atlas = kvmem.scan(gpt2_model, ["one small document.", "and another one"], out=tmp_path / "a", top_k=2,
                       window=8, top_n=3, progress=False)
    files = cached_projection_files(gpt2_model, atlas.layers, atlas.manifest.config)
    assert files["cached"]
    for name, source in files["files"].items():
        assert os.path.samefile(source, atlas.path / f"{name}.parquet")  # a link: no bytes rewritten
    before = atlas.values(1, 2)
    for source in files["files"].values():
        os.remove(source)
    assert kvmem.open(atlas.path).values(1, 2).equals(before)
