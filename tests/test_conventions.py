"""The projection-convention registry against brute-force formulas on the tiny GPT-2 and Llama.

``final_norm`` must rank tokens exactly as the model's own ``lm_head(ln_f(v))`` does once the
norm's bias offset ``lm_head(ln_f(0))`` is taken away (zero for RMSNorm), and its scores must be
those scores times the positive scale sigma(v) that the convention drops.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvmem
from kvmem.conventions import CONVENTIONS, DEFAULT_CONVENTION, convention_vectors, get_convention, value_vectors
from kvmem.errors import KvmemError


@pytest.fixture(scope="module")
def gpt2_norm_model(gpt2_dir):
    """A private tiny GPT-2 whose final LayerNorm has non-trivial gain and bias (random init has 1 and 0)."""
    model = kvmem.load_model(gpt2_dir, device="cpu")
    norm = model._module(model.spec.final_norm)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=generator) + 0.5)
        norm.bias.copy_(torch.randn(norm.bias.shape, generator=generator))
    return model


@pytest.fixture(params=["gpt2", "llama"])
def model(request, gpt2_norm_model, llama_model):
    return {"gpt2": gpt2_norm_model, "llama": llama_model}[request.param]


def _brute_force(model, vectors, name):
    """The formula of each convention written out by hand from the raw HF modules: [n, d_model]."""
    vectors = vectors.double()
    if name == "raw":
        return vectors
    norm = model._module(model.spec.final_norm)
    gain = norm.weight.detach().double() + model.spec.norm_gain_offset
    if model.spec.norm_kind == "layernorm":
        vectors = vectors - vectors.mean(dim=1, keepdim=True)
    return vectors * gain


def test_registry_is_consistent():
    assert DEFAULT_CONVENTION in CONVENTIONS
    assert list(CONVENTIONS) == ["raw", "final_norm"]
    for name, convention in CONVENTIONS.items():
        assert convention.name == name and convention.formula and callable(convention.apply)
        assert get_convention(name) is convention
        assert name in repr(convention)


def test_unknown_convention_names_the_allowed_ones(gpt2_model):
    with pytest.raises(KvmemError, match="unknown projection convention 'folded'; choose one of raw, final_norm"):
        get_convention("folded")
    with pytest.raises(KvmemError, match="choose one of raw, final_norm"):
        value_vectors(gpt2_model, 0, "logit")


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_each_convention_equals_its_formula(model, name):
    for layer in range(model.n_layers):
        values = model.values(layer)  # [d_ff, d_model]
        got = value_vectors(model, layer, name)  # [d_ff, d_model]
        assert got.dtype == torch.float32 and got.shape == (model.d_ff, model.d_model)
        torch.testing.assert_close(got.double(), _brute_force(model, values, name), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(convention_vectors(model, values[:5], name), got[:5])


def test_final_norm_ranks_tokens_as_the_model_does(model):
    hf = model.hf_model
    norm = model._module(model.spec.final_norm)
    values = model.values(1)[:16]  # [16, d_model]
    with torch.no_grad():
        offset = hf.get_output_embeddings()(norm(torch.zeros_like(values[:1])))  # [1, vocab]: the bias's share
        model_scores = hf.get_output_embeddings()(norm(values)) - offset  # [16, vocab]
    scores = convention_vectors(model, values, "final_norm") @ model.unembedding().float()  # [16, vocab]
    centred = values - values.mean(1, keepdim=True) if model.spec.norm_kind == "layernorm" else values
    sigma = torch.sqrt(centred.pow(2).mean(1, keepdim=True) + model.final_norm().eps)  # [16, 1]
    torch.testing.assert_close(scores / sigma, model_scores, atol=1e-4, rtol=1e-4)
    assert torch.equal(scores.topk(20, dim=1).indices, model_scores.topk(20, dim=1).indices)
    assert torch.equal(scores.topk(20, dim=1, largest=False).indices,
                       model_scores.topk(20, dim=1, largest=False).indices)


def test_raw_is_the_plain_unembedding(model):
    values = model.values(0)[:8]
    scores = convention_vectors(model, values, "raw") @ model.unembedding().float()  # [8, vocab]
    with torch.no_grad():
        expected = model.hf_model.get_output_embeddings()(values)  # no bias in these heads
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)


def test_importing_the_registry_loads_no_torch():
    code = "import sys, kvmem.conventions; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
