"""A small atlas for the explanation tests: layer 0 of a tiny GPT-2 that sees only the current token."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import kvmem


@pytest.fixture(scope="session")
def explain_atlas_source(gpt2_dir, tmp_path_factory) -> Path:
    """Layer 0 of the tiny GPT-2 with attention output and position embeddings zeroed, so that its coefficients are
    a function of the current token alone; 1,500 tokens of pydoc text, 60 random samples, context coefficients."""
    from pydoc_data.topics import topics

    from transformers import GPT2LMHeadModel

    base = tmp_path_factory.mktemp("explain")
    hf = GPT2LMHeadModel.from_pretrained(gpt2_dir)
    hf.transformer.wpe.weight.data.zero_()
    hf.transformer.h[0].attn.c_proj.weight.data.zero_()
    hf.transformer.h[0].attn.c_proj.bias.data.zero_()
    hf.save_pretrained(base / "model")
    for file in Path(gpt2_dir).iterdir():
        if file.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            shutil.copy(file, base / "model" / file.name)
    model = kvmem.load_model(base / "model", device="cpu")
    assert (model.n_layers, model.d_model, model.d_ff) == (2, 64, 256)
    corpus = base / "pydoc.txt"
    corpus.write_text("\n\n".join(topics[k] for k in sorted(topics)[:10]))
    kvmem.scan(model, corpus, out=base / "atlas", unit="paragraph", window=32, max_tokens=1500, top_k=12,
               random_samples=60, layers=[0], progress=False)
    return base / "atlas"


@pytest.fixture
def explain_atlas(explain_atlas_source, tmp_path):
    """A fresh copy of the atlas (tests write explanations into it)."""
    target = tmp_path / "atlas"
    shutil.copytree(explain_atlas_source, target)
    return kvmem.open(target)


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama (d 32) at random init with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvmem.builtin import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    assert tokenizer.chat_template
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
