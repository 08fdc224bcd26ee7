"""Fixtures and builders shared by the experiment tests (tiny models edited so answers are forced)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

import kvmem


# ---- fixtures ----
@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    """Real English text (the first pydoc topics, fixed for a Python version) as a .txt corpus."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics)[:6])
    path = tmp_path_factory.mktemp("corpus") / "pydoc6.txt"
    path.write_text(text)
    return path


def _scan(model, corpus, out: Path, **settings):
    settings = {"unit": "paragraph", "window": 32, "max_tokens": 600, "top_k": 5, "per_document": True,
                "context_activations": False, "progress": False, **settings}
    return kvmem.scan(model, corpus, out=out, overwrite=True, **settings)


@pytest.fixture(scope="module")
def atlas(gpt2_model, corpus_file, tmp_path_factory):
    return _scan(gpt2_model, corpus_file, tmp_path_factory.mktemp("atlas") / "atlas")


def _edited_gpt2(gpt2_dir: Path, target: Path, edit) -> Path:
    """A copy of the tiny GPT-2 with ``edit(hf_model)`` applied to its weights (tokenizer files copied)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(gpt2_dir)
    with torch.no_grad():
        edit(hf)
    hf.save_pretrained(target)
    for file in Path(gpt2_dir).iterdir():
        if file.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            shutil.copy(file, target / file.name)
    return target


@pytest.fixture(scope="module")
def always_on(gpt2_dir, tmp_path_factory):
    """Layer 0 has one slot (0) that is always on (m_0 = gelu(100) = 100) and all others off (gelu(-100) = -0),
    and b2 = 0, so that layer's FFN output is exactly 100 * v_0."""
    def edit(hf):
        mlp = hf.transformer.h[0].mlp
        mlp.c_fc.weight.zero_()
        mlp.c_fc.bias.fill_(-100.0)
        mlp.c_fc.bias[0] = 100.0
        mlp.c_proj.bias.zero_()

    model = kvmem.load_model(_edited_gpt2(gpt2_dir, tmp_path_factory.mktemp("always-on"), edit), device="cpu")
    assert (model.n_layers, model.d_model, model.d_ff) == (2, 64, 256)
    return model


@pytest.fixture(scope="module")
def context_free(gpt2_dir, tmp_path_factory):
    """Layer 0's attention writes nothing and there are no position embeddings: layer 0's FFN sees only the
    current token, so removing any earlier token cannot change its coefficient."""
    def edit(hf):
        hf.transformer.wpe.weight.zero_()
        attention = hf.transformer.h[0].attn.c_proj
        attention.weight.zero_()
        attention.bias.zero_()

    model = kvmem.load_model(_edited_gpt2(gpt2_dir, tmp_path_factory.mktemp("context-free"), edit), device="cpu")
    assert (model.n_layers, model.d_model, model.d_ff) == (2, 64, 256)
    return model


def _fake_atlas(path: Path, triggers: pd.DataFrame, values: pd.DataFrame, *, d_ff: int, vocab_size: int,
                top_k: int, gated: bool = False) -> Path:
    """A minimal atlas directory (manifest + triggers + values) with hand-written rows: only the columns
    the experiments read, so the tables are written directly, not through the scan's schema-checked writer."""
    import pyarrow as pa

    from kvmem.manifest import Manifest
    from kvmem.scanning.parquet import write_parquet
    from kvmem.schema import FORMAT_VERSION

    manifest = Manifest(
        format_version=FORMAT_VERSION, kvmem_version=kvmem.__version__,
        model={"name": "hand-built", "fingerprint": "sha256:none", "d_ff": d_ff, "vocab_size": vocab_size,
               "gated": gated},
        corpus={"spec": "list[0]", "unit": "document"}, tokens=0, layers=sorted(values.layer.unique().tolist()),
        tokenization={"window": 8, "prepend_bos": False, "bos_token_id": None, "rule": "-"},
        scan={"top_k": top_k, "per_document": False, "conventions": ["final_norm"]},
        histogram={}, projection={"conventions": {"final_norm": "-"}, "default_convention": "final_norm"},
    )
    path.mkdir(parents=True, exist_ok=True)
    for name, frame in (("triggers", triggers), ("values", values)):  # row groups per (layer, neuron block)
        frame = frame.sort_values(["layer", "neuron"], kind="stable")
        write_parquet(path / f"{name}.parquet", pa.Table.from_pandas(frame, preserve_index=False))
    manifest.write(path / "manifest.json")
    return path


