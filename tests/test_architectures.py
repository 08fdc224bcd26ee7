"""Every row of the architecture table, validated against the HF modules themselves.

Per row: a tiny random-init model from a small config (sizes asserted), norm gains away from 1 and
random biases, the real GPT-2 tokenizer. The oracle is a plain HF forward with torch hooks on the HF
modules, and weights read from the modules by this file's own recipe (not kvmem's table):

(a) ``hook_post`` is d_ff wide and equals the input of the down projection;
(b) the coefficients follow from the keys (gate rows first in Phi-3's fused gate_up_proj), and
    FFN(x) = Σ_i m_i v_i + b2 equals the HF MLP's output;
(c) the residual update the HF block adds equals Σ_i m_i w_i (+ b2) with w = ``written_values``,
    divided by the post-FFN norm's rms where one sits (Gemma-2/3, OLMo-2), times Granite's
    residual multiplier; for parallel blocks the update is the block's output minus its input and
    attention's output;
(d) the projections kvmem ranks (``value_vectors @ unembedding``) equal lm_head(project_out(...))
    of the HF modules under both conventions, and ``Model.logits`` of the residual entering the
    final norm equals the model's own logits (OPT's project_out, Granite's logits_scaling, Gemma-2's
    soft-cap, GPT-J's and Phi's lm_head bias);
(e) ``embedding()`` is what a token adds to the residual entering block 0 (OPT's project_in,
    Gemma's sqrt(d) scale, Granite's embedding multiplier).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import kvmem
from kvmem.architectures import ARCHITECTURES
from kvmem.builtin import gpt2_tokenizer_dir
from kvmem.capture import capture
from kvmem.conventions import value_vectors

D_MODEL, D_FF, N_LAYERS = 32, 48, 2
SMALL_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@dataclass(frozen=True, kw_only=True)
class Row:
    """One architecture as this test reads it from the HF modules (paths inside block L or the model)."""

    config: str  # transformers config class
    kwargs: dict
    d_ff_field: str = "intermediate_size"
    ffn: str = "mlp"  # module whose output is the FFN output
    ffn_in: str = "mlp"  # module whose input is the FFN input
    down: str = "mlp.down_proj"  # W2; its input is the coefficient vector
    up: str | None = "mlp.up_proj"  # W1 / W_up
    gate: str | None = "mlp.gate_proj"
    fused: str | None = None  # fused gate/up module (gate rows first)
    conv1d: bool = False
    resid: str = "post_attention_layernorm"  # module whose input is the residual the FFN reads (serial)
    post_norm: str | None = None
    gain_offset: float = 0.0  # Gemma norms scale by 1 + w
    attention: str = "self_attn"  # parallel blocks: attention's output is taken away
    parallel: bool = False
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    project_out: str | None = None
    project_in: str | None = None
    positions: str | None = None  # learned position embedding module, subtracted from block 0's input
    embed_scale: float = 1.0
    layernorm: bool = False  # final norm is a LayerNorm (else RMSNorm)
    act: str = "hidden_act"
    extra: dict = field(default_factory=dict)


LLAMA_LIKE = dict(num_hidden_layers=N_LAYERS, hidden_size=D_MODEL, intermediate_size=D_FF, **SMALL_ATTN)
ROWS: dict[str, Row] = {
    "gpt2": Row(config="GPT2Config", kwargs=dict(n_layer=N_LAYERS, n_embd=D_MODEL, n_inner=D_FF, n_head=4,
                                                 n_positions=64),
                d_ff_field="n_inner", down="mlp.c_proj", up="mlp.c_fc", gate=None, conv1d=True, resid="ln_2",
                attention="attn", layers="transformer.h", final_norm="transformer.ln_f", positions="transformer.wpe",
                layernorm=True, act="activation_function"),
    "gpt_neo": Row(config="GPTNeoConfig", kwargs=dict(num_layers=N_LAYERS, hidden_size=D_MODEL, intermediate_size=D_FF,
                                                      num_heads=4, max_position_embeddings=64, window_size=8,
                                                      attention_types=[[["global", "local"], 1]]),
                   down="mlp.c_proj", up="mlp.c_fc", gate=None, resid="ln_2", attention="attn",
                   layers="transformer.h", final_norm="transformer.ln_f", positions="transformer.wpe", layernorm=True,
                   act="activation_function"),
    "gptj": Row(config="GPTJConfig", kwargs=dict(n_layer=N_LAYERS, n_embd=D_MODEL, n_inner=D_FF, n_head=4, rotary_dim=4,
                                                 n_positions=64),
                d_ff_field="n_inner", down="mlp.fc_out", up="mlp.fc_in", gate=None, attention="attn", parallel=True,
                layers="transformer.h", final_norm="transformer.ln_f", layernorm=True, act="activation_function"),
    "gpt_neox": Row(config="GPTNeoXConfig", kwargs=dict(num_hidden_layers=N_LAYERS, hidden_size=D_MODEL,
                                                        intermediate_size=D_FF, num_attention_heads=4,
                                                        max_position_embeddings=64, use_parallel_residual=True),
                    down="mlp.dense_4h_to_h", up="mlp.dense_h_to_4h", gate=None, attention="attention", parallel=True,
                    layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm", layernorm=True),
    "gpt_neox-serial": Row(config="GPTNeoXConfig", kwargs=dict(num_hidden_layers=N_LAYERS, hidden_size=D_MODEL,
                                                               intermediate_size=D_FF, num_attention_heads=4,
                                                               max_position_embeddings=64, use_parallel_residual=False),
                           down="mlp.dense_4h_to_h", up="mlp.dense_h_to_4h", gate=None, attention="attention",
                           layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm", layernorm=True),
    "opt": Row(config="OPTConfig", kwargs=dict(num_hidden_layers=N_LAYERS, hidden_size=D_MODEL, ffn_dim=D_FF,
                                               num_attention_heads=4, max_position_embeddings=64,
                                               word_embed_proj_dim=16, do_layer_norm_before=True),
               d_ff_field="ffn_dim", ffn="fc2", ffn_in="fc1", down="fc2", up="fc1", gate=None, resid="final_layer_norm",
               layers="model.decoder.layers", final_norm="model.decoder.final_layer_norm",
               project_out="model.decoder.project_out", project_in="model.decoder.project_in",
               positions="model.decoder.embed_positions", layernorm=True, act="activation_function"),
    "phi": Row(config="PhiConfig", kwargs=dict(LLAMA_LIKE, partial_rotary_factor=0.5),
               down="mlp.fc2", up="mlp.fc1", gate=None, parallel=True, final_norm="model.final_layernorm",
               layernorm=True),
    "phi3": Row(config="Phi3Config", kwargs=dict(LLAMA_LIKE, pad_token_id=0), up=None, gate=None,
                fused="mlp.gate_up_proj"),
    "llama": Row(config="LlamaConfig", kwargs=LLAMA_LIKE),
    "mistral": Row(config="MistralConfig", kwargs=LLAMA_LIKE),
    "qwen2": Row(config="Qwen2Config", kwargs=LLAMA_LIKE),
    "qwen3": Row(config="Qwen3Config", kwargs=dict(LLAMA_LIKE, head_dim=8)),
    "gemma": Row(config="GemmaConfig", kwargs=dict(LLAMA_LIKE, head_dim=8), gain_offset=1.0,
                 embed_scale=D_MODEL ** 0.5),
    "gemma2": Row(config="Gemma2Config", kwargs=dict(LLAMA_LIKE, head_dim=8, final_logit_softcapping=2.0),
                  resid="pre_feedforward_layernorm", post_norm="post_feedforward_layernorm", gain_offset=1.0,
                  embed_scale=D_MODEL ** 0.5),
    "gemma3_text": Row(config="Gemma3TextConfig", kwargs=dict(LLAMA_LIKE, head_dim=8),
                       resid="pre_feedforward_layernorm", post_norm="post_feedforward_layernorm", gain_offset=1.0,
                       embed_scale=D_MODEL ** 0.5),
    "olmo2": Row(config="Olmo2Config", kwargs=LLAMA_LIKE, resid="mlp", post_norm="post_feedforward_layernorm"),
    "granite": Row(config="GraniteConfig", kwargs=dict(LLAMA_LIKE, residual_multiplier=0.5, embedding_multiplier=3.0,
                                                       logits_scaling=4.0),
                   extra=dict(residual_multiplier=0.5, embedding_multiplier=3.0, logits_scaling=4.0)),
}

TEXT = "The capital of France is Paris, and the key-value reading of a feed-forward layer"


def _module(root, path: str):
    for part in path.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _build(row_name: str, row: Row, path, tokenizer):
    import transformers

    config = getattr(transformers, row.config)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id, **row.kwargs)
    torch.manual_seed(sorted(ROWS).index(row_name))
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in hf.named_parameters():
            leaf = name.rsplit(".", 2)
            if "norm" in name or leaf[-2].startswith("ln"):  # norm gains away from 1, biases random
                parameter.uniform_(0.5, 1.5) if leaf[-1] == "weight" else parameter.normal_(0.0, 0.3)
            elif leaf[-1] == "bias":
                parameter.normal_(0.0, 0.3)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import GPT2TokenizerFast

    return GPT2TokenizerFast.from_pretrained(gpt2_tokenizer_dir())


def test_every_table_row_has_a_validation_row():
    assert {name.split("-")[0] for name in ROWS} == set(ARCHITECTURES)


@pytest.mark.parametrize("row_name", list(ROWS))
def test_row_against_the_hf_modules(row_name, tokenizer, tmp_path):
    row = ROWS[row_name]
    _build(row_name, row, tmp_path, tokenizer)
    model = kvmem.load_model(tmp_path, device="cpu")
    hf = model.hf_model
    assert (model.n_layers, model.d_model, model.d_ff, model.vocab_size) == (N_LAYERS, D_MODEL, D_FF, len(tokenizer))
    assert getattr(hf.config, row.d_ff_field) == D_FF and model.model_type == row_name.split("-")[0]
    assert model.parallel_block == row.parallel and model.device == "cpu"
    ids = torch.tensor([model.encode(TEXT)])  # [1, pos]
    layer = 1
    block = _module(hf, f"{row.layers}.{layer}")

    # ---- the oracle: one plain HF forward, torch hooks on the HF modules ----
    seen: dict[str, torch.Tensor] = {}

    def keep_input(key):
        def hook(module, args, kwargs):
            seen[key] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return hook

    def keep_output(key):
        def hook(module, args, output):
            seen[key] = _first(output).detach().clone()
        return hook

    hooks = [(_module(block, row.down), "pre", "m"), (_module(block, row.ffn_in), "pre", "ffn_in"),
             (_module(block, row.ffn), "out", "ffn_out"), (block, "pre", "block_in"), (block, "out", "block_out"),
             (_module(hf, row.final_norm), "pre", "final_in"), (_module(hf, f"{row.layers}.0"), "pre", "block0_in")]
    if row.parallel:
        hooks.append((_module(block, row.attention), "out", "attn_out"))
    else:
        hooks.append((_module(block, row.resid), "pre", "resid"))
    if row.positions:
        hooks.append((_module(hf, row.positions), "out", "positions"))
    if row.post_norm:
        hooks.append((_module(block, row.post_norm), "out", "post_norm_out"))
    handles = [module.register_forward_pre_hook(keep_input(key), with_kwargs=True) if kind == "pre"
               else module.register_forward_hook(keep_output(key)) for module, kind, key in hooks]
    try:
        with torch.no_grad():
            hf_logits = hf(input_ids=ids).logits[0]  # [pos, vocab]
    finally:
        for handle in handles:
            handle.remove()
    n = ids.shape[1]
    flat = {k: v.reshape(n, -1) for k, v in seen.items()}  # OPT flattens tokens inside its layers

    # weights read by this file's own recipe
    def weight(path):  # [out, in]
        w = _module(block, path).weight.detach()
        return w.T if row.conv1d else w

    def bias(path):
        b = getattr(_module(block, path), "bias", None)
        return None if b is None else b.detach()

    v = weight(row.down).T  # [d_ff, d_model]
    b2 = bias(row.down)
    gain = (torch.ones(D_MODEL) if row.post_norm is None
            else _module(block, row.post_norm).weight.detach() + row.gain_offset)
    multiplier = row.extra.get("residual_multiplier", 1.0)
    written = v * gain * multiplier  # [d_ff, d_model]

    # (a) hook_post is d_ff wide and equals the input of the down projection
    got = capture(model, ids, [model.hook_name(layer, "post")], stop_early=True)[model.hook_name(layer, "post")]
    assert got.shape == (1, n, D_FF)
    m = flat["m"]  # [pos, d_ff]
    assert m.shape == (n, D_FF)
    torch.testing.assert_close(got[0], m, atol=1e-5, rtol=1e-5)
    # every block site kvmem.capture reads, against the HF module computing it (the model left hook-free)
    oracle = {"post": "m", "in": "ffn_in", "out": "ffn_out", "resid_pre": "block_in", "resid_post": "block_out",
              "resid_mid": None if row.parallel else "resid"}
    names = {site: model.hook_name(layer, site) for site, key in oracle.items() if key}
    assert model.has_site(layer, "resid_mid") == (not row.parallel)
    read = capture(model, ids, list(names.values()), stop_early=False)
    for site, name in names.items():
        assert torch.equal(read[name][0], flat[oracle[site]].float()), site
    assert sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) + len(mod._forward_pre_hooks_with_kwargs)
               for mod in hf.modules()) == 0

    # (b) coefficients from the keys, and FFN(x) = Σ m_i v_i + b2
    from transformers.activations import ACT2FN

    act = ACT2FN[getattr(hf.config, row.act if hasattr(hf.config, row.act) else "hidden_activation")]
    if row_name.startswith("gemma"):
        act = ACT2FN[getattr(hf.config, "hidden_activation", None) or hf.config.hidden_act]
    x = flat["ffn_in"]  # [pos, d_model]
    if row.fused:
        fused = _module(block, row.fused).weight.detach()  # [2 d_ff, d_model]: gate rows, then up rows
        expected_m = act(x @ fused[:D_FF].T) * (x @ fused[D_FF:].T)
        assert torch.equal(model.gate_keys(layer), fused[:D_FF]) and torch.equal(model.keys(layer), fused[D_FF:])
    elif row.gate:
        expected_m = act(x @ weight(row.gate).T) * (x @ weight(row.up).T)
    else:
        pre = x @ weight(row.up).T + (0 if bias(row.up) is None else bias(row.up))
        expected_m = act(pre)
    torch.testing.assert_close(expected_m, m, atol=1e-5, rtol=1e-5)
    assert torch.equal(model.values(layer), v)
    ffn_modules = {row.down, row.up, row.gate, row.fused} - {None}
    assert model.parameter_counts[layer][0] == sum(p.numel() for path in ffn_modules
                                                   for p in _module(block, path).parameters())
    ffn = m @ v + (0 if b2 is None else b2)  # [pos, d_model]
    torch.testing.assert_close(ffn, flat["ffn_out"], atol=1e-5, rtol=1e-5)

    # (c) what the block adds to the residual is Σ m_i w_i (+ b2), over the post-FFN norm's rms
    torch.testing.assert_close(model.written_values(layer), written, atol=1e-6, rtol=1e-6)
    if row.parallel:
        update = flat["block_out"] - flat["block_in"] - flat["attn_out"]
    else:
        update = flat["block_out"] - flat["resid"]
    if row.post_norm:
        post_norm = _module(block, row.post_norm)
        eps = float(getattr(post_norm, "eps", None) or post_norm.variance_epsilon)
        rms = torch.sqrt(flat["ffn_out"].pow(2).mean(-1, keepdim=True) + eps)  # [pos, 1], > 0
        expected = m @ model.written_values(layer) / rms
        torch.testing.assert_close(flat["post_norm_out"], expected, atol=1e-5, rtol=1e-4)
    else:
        expected = m @ model.written_values(layer) + (0 if b2 is None else b2 * multiplier)
    torch.testing.assert_close(update, expected, atol=1e-4, rtol=1e-4)

    # (d) projections: value_vectors @ unembedding against lm_head(project_out(...)) of the HF modules
    lm_head = hf.get_output_embeddings()
    project_out = None if row.project_out is None else _module(hf, row.project_out)
    scaling = row.extra.get("logits_scaling", 1.0)
    norm = _module(hf, row.final_norm)

    def head(h):  # the modules between the final norm's output and the logits, bias offset removed
        with torch.no_grad():
            def run(z):
                return lm_head(z if project_out is None else project_out(z)) / scaling
            return run(h) - run(torch.zeros_like(h[:1]))

    if project_out is not None:
        assert project_out.weight.shape == (16, D_MODEL) and lm_head.weight.shape[1] == 16
    unembedding = model.unembedding().float()  # [d_model, vocab]
    raw = value_vectors(model, layer, "raw") @ unembedding  # [d_ff, vocab]
    torch.testing.assert_close(raw, head(written), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        normed = head(norm(written)) - head(norm(torch.zeros_like(written[:1])))
    centred = written - written.mean(-1, keepdim=True) if row.layernorm else written
    sigma = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + float(getattr(norm, "eps", None)
                                                                       or norm.variance_epsilon))
    final = value_vectors(model, layer, "final_norm") @ unembedding  # [d_ff, vocab]
    torch.testing.assert_close(final / sigma, normed, atol=1e-4, rtol=1e-4)
    assert np.array_equal(final.topk(5, dim=1).indices.numpy(), normed.topk(5, dim=1).indices.numpy())
    if row.post_norm:  # the raw v_i would rank tokens differently: the semantics matter here
        bare = (model.values(layer).float() @ unembedding).topk(1, dim=1).indices
        assert (bare != raw.topk(1, dim=1).indices).any()
    # the model's logits from the residual entering the final norm
    torch.testing.assert_close(model.logits(flat["final_in"]), hf_logits, atol=1e-4, rtol=1e-4)

    # (e) the embedding kvmem projects keys against is what a token adds to the residual
    block0 = flat["block0_in"] - (flat["positions"] if row.positions else 0)
    torch.testing.assert_close(model.embedding()[ids[0]].float(), block0, atol=1e-5, rtol=1e-5)
    assert model.embedding().shape == (len(tokenizer), D_MODEL)

    # trace reads the residual the FFN reads, and what it writes
    result = kvmem.trace(model, ids[0].tolist(), top=3, n_tokens=0, prepend_bos=False)
    assert result.attrs["residual_before"].startswith("hook_resid_pre" if row.parallel else "hook_resid_mid")
    heavy = result.sub_updates[result.sub_updates.layer == layer]
    neurons = torch.tensor(heavy.neuron.tolist())
    oracle_weight = m[-1].abs() * written.norm(dim=1)  # [d_ff]: |m_i| ||w_i|| at the traced position
    assert torch.equal(neurons, oracle_weight.topk(3).indices)
    np.testing.assert_allclose(heavy.value_norm, written[neurons].norm(dim=1).numpy(), rtol=1e-5)
    ffn_norm = float(result.layers.loc[result.layers.layer == layer, "ffn_norm"].iloc[0])
    assert ffn_norm == pytest.approx(float(update[-1].norm()), rel=1e-4, abs=1e-5)
    if not row.parallel:  # after the last FFN of a serial model the lens reads the model's own prediction
        assert int(result.layers.top_after_id.iloc[-1]) == int(hf_logits[-1].argmax())
    assert result.attrs["final_token_id"] == int(hf_logits[-1].argmax())


@pytest.mark.parametrize("model_type,fields", [("mixtral", {"num_local_experts": 8}),
                                               ("qwen2_moe", {"num_experts": 4})])
def test_mixture_of_experts_is_one_line(model_type, fields, tmp_path):
    config = {"model_type": model_type, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
              "num_attention_heads": 4, "vocab_size": 100, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(kvmem.KvmemError, match=rf"unsupported architecture '{model_type}': its FFN layers are "
                                               r"mixtures of experts .*supported model types are .*gemma2"):
        kvmem.load_model(tmp_path, device="cpu")
    if model_type != "mixtral":  # the command line prints the same line once, without a traceback
        return
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "kvmem", "anatomy", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and model_type in lines[0] and "Traceback" not in result.stderr


def test_post_layernorm_opt_is_refused_in_one_line(tmp_path):
    config = {"model_type": "opt", "hidden_size": 32, "ffn_dim": 48, "num_hidden_layers": 1,
              "num_attention_heads": 4, "vocab_size": 100, "do_layer_norm_before": False, "word_embed_proj_dim": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(kvmem.KvmemError, match=r"unsupported 'opt' variant: .*do_layer_norm_before=False.*"
                                               r"supported model types are"):
        kvmem.load_model(tmp_path, device="cpu")
