"""The taxonomy's scan-time sums against brute force: Σ m·p, Σp, Σp², the gate/up sign quadrants, each
kept trigger's gate and up, the unigram counts and the columns built from them; their
merge across shards (byte-identical tables; across torchrun ranks: tests/test_distributed.py); the
checkpoint version and the off switch.

Oracle: plain HF forwards window by window under the plan's rule, with torch hooks on the HF modules
themselves (the input of down_proj, the outputs of gate_proj and up_proj), statistics in numpy float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import SHORT_DOCS

import kvmem
from kvmem.errors import KvmemError
from kvmem.scanning.checkpoint import load_state, save_state
from kvmem.scanning.runner import stream
from kvmem.schema import TABLES
from kvmem.taxonomy import build_taxonomy

WINDOW = 8
SKIP = 1  # tokens of each window read, not scored (the default)
SETTINGS = dict(window=WINDOW, top_k=4, batch_size=3, block_documents=2, per_document=True, top_n=5,
                conventions=("raw",), random_samples=6, bin_samples=2, sample_rate=1.0, projections="eager")


def _unwrap(module):
    return getattr(module, "original_component", module)


def hf_positions(model, docs: list[str]) -> dict:
    """Every scored position in reading order: doc, pos, place in window, token, and per layer the HF
    coefficients m (input of down_proj) and, when gated, gate and up (outputs of gate_proj, up_proj)."""
    hf = model.hf_model
    gated = hasattr(hf, "model")
    blocks = hf.model.layers if gated else hf.transformer.h
    captured: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for layer, block in enumerate(blocks):
        down = _unwrap(block.mlp.down_proj if gated else block.mlp.c_proj)
        handles.append(down.register_forward_pre_hook(
            lambda mod, args, layer=layer: captured.__setitem__((layer, "m"), args[0].detach().clone())))
        if gated:
            for site in ("gate_proj", "up_proj"):
                handles.append(_unwrap(getattr(block.mlp, site)).register_forward_hook(
                    lambda mod, args, out, key=(layer, site): captured.__setitem__(key, out.detach().clone())))
    out: dict = {"doc": [], "pos": [], "place": [], "token": []}
    parts: dict[tuple[int, str], list] = {}
    try:
        with torch.no_grad():
            for doc, text in enumerate(docs):
                ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
                for start in range(0, len(ids), WINDOW):
                    chunk = ids[start:start + WINDOW]
                    hf(torch.tensor([[model.bos_token_id] + chunk]))
                    # BOS is never scored, nor the window's first token (SKIP, the scan's default)
                    for key, tensor in captured.items():
                        parts.setdefault(key, []).append(tensor[0, 1 + SKIP:].float().numpy())
                    out["doc"] += [doc] * (len(chunk) - SKIP)
                    out["pos"] += list(range(start + SKIP, start + len(chunk)))
                    out["place"] += list(range(SKIP, len(chunk)))  # the place in the window: the first token is 0
                    out["token"] += chunk[SKIP:]
    finally:
        for handle in handles:
            handle.remove()
    out = {name: np.asarray(values, np.int64) for name, values in out.items()}
    out.update({key: np.concatenate(values).astype(np.float64) for key, values in parts.items()})
    return out


@pytest.fixture(scope="module")
def oracle(llama_model):
    return hf_positions(llama_model, SHORT_DOCS)


def test_streaming_sums_equal_brute_force(llama_model, oracle):
    state = stream(llama_model, SHORT_DOCS, **SETTINGS)
    place = oracle["place"].astype(np.float64)
    assert state.tokens == len(place)
    np.testing.assert_array_equal(state.scan_states["unigrams"].numpy(),
                                  np.bincount(oracle["token"], minlength=llama_model.vocab_size))
    for layer, layer_states in state.layer_states.items():
        layer_state = layer_states["taxonomy"]
        m, gate, up = oracle[(layer, "m")], oracle[(layer, "gate_proj")], oracle[(layer, "up_proj")]
        assert layer_state.position_total == int(place.sum()) and layer_state.position_sq_total == int((place ** 2).sum())
        got = (layer_state.position_product[0] + layer_state.position_product[1]).numpy()
        np.testing.assert_allclose(got, (m * place[:, None]).sum(0), rtol=1e-5, atol=1e-6)
        expected = np.stack([((gate > 0) & (up > 0)).sum(0), ((gate > 0) & (up <= 0)).sum(0),
                             ((gate <= 0) & (up > 0)).sum(0), ((gate <= 0) & (up <= 0)).sum(0)])
        np.testing.assert_array_equal(layer_state.quadrants.numpy(), expected)
        assert (expected.sum(1) > 0).all() and len({tuple(row) for row in expected}) == 4  # a swapped row is caught
        assert layer_state.quadrants.sum(0).eq(state.tokens).all()


@pytest.fixture(scope="module")
def whole_atlas(llama_model, tmp_path_factory):
    return kvmem.scan(llama_model, SHORT_DOCS, out=tmp_path_factory.mktemp("taxo-whole") / "a", progress=False,
                      **SETTINGS)


def test_trigger_gate_and_up_equal_the_hf_projections(whole_atlas, oracle):
    triggers = whole_atlas.table("triggers")
    at = {(d, p): i for i, (d, p) in enumerate(zip(oracle["doc"].tolist(), oracle["pos"].tolist()))}
    rows = np.array([at[(d, p)] for d, p in zip(triggers.doc, triggers.pos)])
    for layer in whole_atlas.layers:
        mine = (triggers.layer == layer).to_numpy()
        neurons = triggers.neuron.to_numpy()[mine]
        for column, site in (("gate_pre", "gate_proj"), ("up_pre", "up_proj")):
            want = oracle[(layer, site)][rows[mine], neurons]
            np.testing.assert_allclose(triggers[column].to_numpy()[mine], want, rtol=1e-5, atol=1e-6)
        activation = oracle[(layer, "m")][rows[mine], neurons]
        np.testing.assert_allclose(triggers.activation.to_numpy()[mine], activation, rtol=1e-5, atol=1e-6)
    assert set(triggers.kind) == {"top", "bottom", "top_doc", "bottom_doc"}
    # exemplars split by quadrant: the bottom (most negative m) triggers of a SwiGLU neuron have gate > 0, up < 0
    bottom = triggers[(triggers.kind == "bottom") & (triggers["rank"] == 0)]
    assert ((bottom.gate_pre > 0) & (bottom.up_pre < 0)).mean() > 0.5


def test_taxonomy_scan_columns_equal_numpy(llama_model, whole_atlas, oracle):
    frame, metadata = build_taxonomy(llama_model, atlas=whole_atlas)
    place = oracle["place"].astype(np.float64)
    counts = np.bincount(oracle["token"], minlength=llama_model.vocab_size)
    seen = np.flatnonzero(counts > 0)
    log_frequency = np.log(counts[seen] / counts.sum())
    hf = llama_model.hf_model
    w_u = hf.lm_head.weight.detach().double().numpy().T  # [d_model, vocab]
    assert metadata["scan_columns"]["unigram_types"] == len(seen)
    for layer in whole_atlas.layers:
        got = frame[frame.layer == layer].sort_values("neuron")
        m, gate, up = oracle[(layer, "m")], oracle[(layer, "gate_proj")], oracle[(layer, "up_proj")]
        want = np.array([np.corrcoef(m[:, i], place)[0, 1] for i in range(m.shape[1])])
        np.testing.assert_allclose(got.position_correlation.to_numpy(), want, rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(got.positional.to_numpy(), np.abs(got.position_correlation.to_numpy()) >= 0.5)
        np.testing.assert_allclose(got.quadrant_pn.to_numpy(), ((gate > 0) & (up <= 0)).mean(0), rtol=1e-12)
        np.testing.assert_allclose(got.quadrant_np.to_numpy(), ((gate <= 0) & (up > 0)).mean(0), rtol=1e-12)
        values = hf.model.layers[layer].mlp.down_proj.weight.detach().double().numpy().T  # [d_ff, d_model]
        logits = values @ w_u[:, seen]  # the direct logit effect on the tokens the corpus holds
        want = np.array([np.corrcoef(row, log_frequency)[0, 1] for row in logits])
        np.testing.assert_allclose(got.unigram_alignment.to_numpy(), want, rtol=1e-7, atol=1e-9)
    assert frame.position_correlation.abs().max() > 0.3  # window positions do move this model's coefficients


def test_two_shards_merged_equal_one_scan_byte_identical(llama_model, whole_atlas, tmp_path):
    shards = [kvmem.scan(llama_model, SHORT_DOCS, out=tmp_path / f"s{i}", shard=(i, 2), progress=False, **SETTINGS)
              for i in range(2)]
    assert all(s.manifest.tokens > 0 for s in shards)
    merged = kvmem.merge(shards, out=tmp_path / "merged", model=llama_model)
    assert "unigrams" in TABLES
    for table in TABLES:
        a, b = (Path(x.path) / f"{table}.parquet" for x in (whole_atlas, merged))
        assert a.read_bytes() == b.read_bytes(), table
    one, _ = build_taxonomy(llama_model, atlas=whole_atlas)
    two, _ = build_taxonomy(llama_model, atlas=merged)
    pd.testing.assert_frame_equal(one, two, check_exact=True)


def test_off_switch_and_older_checkpoints(llama_model, tmp_path):
    atlas = kvmem.scan(llama_model, SHORT_DOCS, out=tmp_path / "off", progress=False, taxonomy_sums=False, **SETTINGS)
    neurons = atlas.neurons
    assert neurons.position_act_sum.isna().all() and neurons.quadrant_pp.isna().all()
    assert len(atlas.table("unigrams")) == 0 and atlas.table("triggers").gate_pre.isna().all()
    frame, metadata = build_taxonomy(llama_model, atlas=atlas)
    assert frame.get("position_correlation") is None and "--no-taxonomy-sums" in metadata["scan_columns"]["missing"]
    # a checkpoint of the previous state format is refused in one line
    state = stream(llama_model, SHORT_DOCS, **SETTINGS)
    save_state(tmp_path / "ck", state, {"h": 1})
    meta = json.loads((tmp_path / "ck" / "state.json").read_text())
    assert load_state(tmp_path / "ck", {"h": 1}, state.statistics).scan_states["unigrams"].sum() == state.tokens
    meta["kvmem_state"] = 1
    (tmp_path / "ck" / "state.json").write_text(json.dumps(meta))
    with pytest.raises(KvmemError, match="another version") as error:
        load_state(tmp_path / "ck", {"h": 1}, state.statistics)
    assert "\n" not in str(error.value)
