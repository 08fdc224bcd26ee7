"""kvmem.atlas_origin: the scanned model (name, dtype and hub revision from the manifest), the scanned corpus, and the
one fingerprint policy (refuse for records and merges, warn for experiments)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import kvmem
import kvmem.loading
from kvmem.atlas import open_atlas
from kvmem.atlas_origin import ON_MISMATCH, FingerprintWarning, check_model, load_scanned_model, scanned_corpus
from kvmem.corpus import open_corpus
from kvmem.errors import KvmemError
from kvmem.experiments.atlas_inputs import check_fingerprint, model_for_atlas
from kvmem.manifest import Manifest


def _edited_copy(atlas, target, **model_fields):
    """A copy of ``atlas`` whose manifest's ``model`` entry has ``model_fields`` set."""
    shutil.copytree(atlas.path, target)
    path = target / "manifest.json"
    data = json.loads(path.read_text())
    data["model"].update(model_fields)
    path.write_text(json.dumps(data))
    return open_atlas(target)


@pytest.fixture
def loads(monkeypatch, gpt2_model):
    """Every kvmem.loading.load_model call's arguments; each returns the tiny GPT-2."""
    calls = []

    def load_model(name_or_path, **kwargs):
        calls.append({"name": name_or_path, **kwargs})
        return gpt2_model

    monkeypatch.setattr(kvmem.loading, "load_model", load_model)
    return calls


def test_the_manifests_revision_reaches_load_model(atlas, tmp_path, loads, gpt2_model):
    pinned = _edited_copy(atlas, tmp_path / "pinned", name="someone/some-model", revision="0123abcd",
                          dtype="bfloat16")
    expected = {"name": "someone/some-model", "revision": "0123abcd", "dtype": "bfloat16", "device": "cpu"}
    assert load_scanned_model(pinned, device="cpu") is gpt2_model
    # merging shards has only manifests; experiments go through model_for_atlas
    assert load_scanned_model(Manifest.read(pinned.path / "manifest.json"), device="cpu") is gpt2_model
    assert model_for_atlas(pinned, device="cpu") is gpt2_model
    assert loads == [expected] * 3
    # a model named by the user is loaded as named (no revision or dtype taken from the atlas)
    loads.clear()
    model_for_atlas(pinned, "other-model", device="cpu")
    assert loads == [{"name": "other-model", "device": "cpu"}]


def test_the_scanned_model_loads_from_its_local_directory(atlas, gpt2_dir):
    from transformers import GPT2LMHeadModel

    assert atlas.manifest.model["name"] == str(gpt2_dir) and atlas.manifest.model["revision"] is None
    model = load_scanned_model(atlas, device="cpu")
    assert model.fingerprint == atlas.manifest.model["fingerprint"] and model.source == str(gpt2_dir)
    hf = GPT2LMHeadModel.from_pretrained(gpt2_dir)  # the plain HF module as the oracle for the weights
    assert torch.equal(model.values(1), hf.transformer.h[1].mlp.c_proj.weight.detach())


def test_one_policy_refuses_or_warns(atlas, tmp_path, gpt2_model, llama_model):
    assert check_model(atlas, gpt2_model) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_model(atlas, gpt2_model, on_mismatch="warn") is True and check_fingerprint(atlas, gpt2_model)
    with pytest.raises(KvmemError, match="not the scanned model") as refused:
        check_model(atlas, llama_model)
    assert "\n" not in str(refused.value) and llama_model.fingerprint in str(refused.value)
    assert atlas.manifest.model["fingerprint"] in str(refused.value)
    with pytest.warns(FingerprintWarning, match="mix two models") as caught:
        assert check_model(atlas, llama_model, on_mismatch="warn") is False
    assert caught[0].filename == __file__  # the warning names the caller's line
    with pytest.warns(FingerprintWarning, match="not the scanned model"):
        assert check_fingerprint(atlas, llama_model) is False  # the experiments' side: warn
    with pytest.raises(KvmemError, match="on_mismatch must be one of raise, warn"):
        check_model(atlas, gpt2_model, on_mismatch="ignore")
    assert list(ON_MISMATCH) == ["raise", "warn"]

    # the scanned model's weights changed on disk since the scan: refused, or reported for experiments
    changed = _edited_copy(atlas, tmp_path / "changed", fingerprint="sha256:" + "0" * 64)
    with pytest.raises(KvmemError, match="not the scanned model"):
        load_scanned_model(changed, device="cpu")
    with pytest.warns(FingerprintWarning):
        assert model_for_atlas(changed, device="cpu").fingerprint == gpt2_model.fingerprint


def test_the_scanned_corpus_is_the_stream_the_atlas_indexes(atlas, corpus_file, gpt2_model, tmp_path):
    reopened = {d.index: d.id for d in scanned_corpus(atlas)}
    triggers = atlas.table("triggers", ["doc", "doc_id"]).drop_duplicates()
    assert len(triggers) > 1 and all(reopened[int(d)] == i for d, i in zip(triggers.doc, triggers.doc_id))
    # the manifest's unit applies to a corpus given in place of the spec
    given = [d.id for d in scanned_corpus(atlas, str(corpus_file))]
    assert atlas.manifest.corpus["unit"] == "paragraph" and given == list(reopened.values())
    assert [d.id for d in scanned_corpus(atlas, ["a\n\nb"])] == ["list:0#p0", "list:0#p1"]

    in_memory = kvmem.scan(gpt2_model, ["one two three", "four five"], out=tmp_path / "mem", window=8, top_k=2,
                           progress=False)
    with pytest.raises(KvmemError, match="in-memory corpus") as refused:
        scanned_corpus(in_memory)
    assert "\n" not in str(refused.value)
    assert [d.text for d in scanned_corpus(in_memory, ["one two three"])] == ["one two three"]
    assert [d.id for d in scanned_corpus(atlas, open_corpus(str(corpus_file)))] == list(reopened.values())
