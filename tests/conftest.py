"""Shared fixtures: tiny random-init models whose sizes are asserted, seeded RNGs, small corpora."""

from __future__ import annotations

import os

# Under pytest-xdist the workers share the machine's cores: each worker, and every process it starts
# (inheriting these variables), gets its share of threads instead of all of them, so two workers on
# two cores do not run four spinning OpenMP threads. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, _share)

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# fixtures of the experiment tests (tests/test_experiments*.py)
from experiment_fixtures import always_on, atlas, context_free, corpus_file  # noqa: F401
from explain_fixtures import explain_atlas, explain_atlas_source, tiny_chat_dir  # noqa: F401
from explorer_fixtures import explorer_atlas, explorer_server  # noqa: F401

import kvmem
from kvmem.builtin import gpt2_random_dir, gpt2_tokenizer_dir

TINY_GPT2 = dict(n_layer=2, n_embd=64, n_head=4, n_positions=128)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)

SHORT_DOCS = [
    "The cat sat on the mat. It was a sunny day in Paris.",
    "Assert statements are a convenient way to insert debugging assertions into a program.",
    "def f(x):\n    return x + 1\n",
    "Key-value memories store patterns and the tokens they promote.",
    "Feed-forward layers hold two thirds of a transformer's parameters.",
    "A short one.",
    "Numbers: 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144.",
]


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def gpt2_dir():
    return gpt2_random_dir(**TINY_GPT2)


@pytest.fixture(scope="session")
def gpt2_model(gpt2_dir):
    model = kvmem.load_model(gpt2_dir, device="cpu")
    assert (model.n_layers, model.d_model, model.d_ff, model.vocab_size) == (2, 64, 256, 50257)
    return model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM

    tokenizer = GPT2TokenizerFast.from_pretrained(gpt2_tokenizer_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **TINY_LLAMA)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # random init leaves RMSNorm gains at 1: make them non-trivial
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama_model(llama_dir):
    model = kvmem.load_model(llama_dir, device="cpu")
    assert (model.n_layers, model.d_model, model.d_ff, model.gated) == (2, 64, 96, True)
    return model


@pytest.fixture(params=["gpt2", "llama"])
def tiny_model(request, gpt2_model, llama_model):
    return {"gpt2": gpt2_model, "llama": llama_model}[request.param]
