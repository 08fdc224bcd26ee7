"""The scan's reading of the FFN (:func:`kvmem.capture.capture_ffn` on ``Model.unbridged``), per row of
the architecture table.

Oracle: a second, separate HF model loaded from the same directory with the attention implementation HF
picks for it, no bridge anywhere, torch hooks on its own down projection (input: m) and gate / up
projections (outputs; halves of Phi-3's fused gate_up_proj, gate rows first). The view, and
:func:`kvmem.capture.capture` on the user's model, must give the same tensors to the bit on a
right-padded batch, and agree with the TransformerLens bridge's ``hook_post`` / ``hook_pre`` /
``hook_pre_linear`` to float32 rounding (the bridge runs eager attention on a module tree of its own).
"""

from __future__ import annotations

import pytest
import torch
from test_architectures import ROWS, _build, _first, _module

import kvmem
from kvmem.builtin import gpt2_tokenizer_dir
from kvmem.capture import capture, capture_ffn
from kvmem.errors import KvmemError
from kvmem.unbridged import unbridged

EAGER_ONLY = {"gemma2", "gpt_neo", "gptj", "opt", "phi", "gpt_neox", "gpt_neox-serial"}  # HF has no sdpa for some
TEXTS = ["The capital of France is Paris, and the key-value reading of a feed-forward layer",
         "Short one."]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import GPT2TokenizerFast

    return GPT2TokenizerFast.from_pretrained(gpt2_tokenizer_dir())


def _batch(model) -> torch.Tensor:
    """Two windows, right-padded with id 0 as the scan lays them out -> [2, pos]."""
    rows = [model.encode(text) for text in TEXTS]
    ids = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    return ids


def _oracle(row, path, attention: str, ids: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
    """A separate plain HF model's m, gate and up pre-activations, every layer -> {(layer, site): [batch, pos, d_ff]}."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).eval()
    assert hf.config._attn_implementation == attention
    seen: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for layer in range(len(_module(hf, row.layers))):
        block = _module(hf, f"{row.layers}.{layer}")
        handles.append(_module(block, row.down).register_forward_pre_hook(
            lambda module, args, layer=layer: seen.__setitem__((layer, "post"), args[0].detach().clone())))
        if row.fused:
            def halves(module, args, out, layer=layer):
                gate, up = _first(out).detach().chunk(2, dim=-1)
                seen[(layer, "pre")], seen[(layer, "pre_linear")] = gate.clone(), up.clone()
            handles.append(_module(block, row.fused).register_forward_hook(halves))
        elif row.gate:
            for site, part in (("pre", row.gate), ("pre_linear", row.up)):
                handles.append(_module(block, part).register_forward_hook(
                    lambda module, args, out, key=(layer, site): seen.__setitem__(key, _first(out).detach().clone())))
    try:
        with torch.no_grad():
            hf(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("row_name", list(ROWS))
def test_capture_ffn_equals_a_plain_hf_model(row_name, tokenizer, tmp_path):
    row = ROWS[row_name]
    _build(row_name, row, tmp_path, tokenizer)
    model = kvmem.load_model(tmp_path, device="cpu")
    ids = _batch(model)
    sites = [(layer, site) for layer in range(model.n_layers)
             for site in (("post", "pre", "pre_linear") if model.gated else ("post",))]
    # the bridge first: booting it must leave the model (and so the view) as they were
    names = {key: model.hook_name(*key) for key in sites}
    bridge: dict[str, torch.Tensor] = {}
    with torch.no_grad(), model.bridge.hooks(fwd_hooks=[(name, lambda t, hook, name=name: bridge.__setitem__(name, t.clone()))
                                                        for name in names.values()]):
        model.bridge(ids, return_type=None)
    assert model.hf_model.config._attn_implementation == model.attention == "sdpa" or row_name in EAGER_ONLY
    plain = capture(model, ids, list(names.values()), stop_early=False)  # the user's model itself
    got: dict[tuple[int, str], torch.Tensor] = {}
    capture_ffn(model, ids, sites, lambda layer, site, tensor: got.__setitem__((layer, site), tensor.clone()))
    assert model.unbridged.config._attn_implementation == model.attention

    want = _oracle(row, tmp_path, model.attention, ids)
    assert set(got) == set(sites) and set(want) >= set(sites)
    for key in sites:
        assert got[key].shape == (*ids.shape, model.d_ff), key
        assert torch.equal(got[key], want[key].reshape(got[key].shape)), key  # OPT flattens tokens inside
        assert torch.equal(plain[names[key]], got[key]), key

    # the bridge (its own eager attention) agrees to float32 rounding
    for key, name in names.items():
        torch.testing.assert_close(got[key], bridge[name], atol=1e-5, rtol=1e-4)


def test_the_view_shares_the_weights_and_leaves_the_bridge_alone(tmp_path, tokenizer):
    row = ROWS["llama"]
    _build("llama", row, tmp_path, tokenizer)
    model = kvmem.load_model(tmp_path, device="cpu")
    assert "bridge" not in vars(model)  # built on first use only
    view = model.unbridged
    assert model.attention == "sdpa" and view.config._attn_implementation == "sdpa"
    assert model.bridge is not None  # booted on a module tree of its own: the model and the view keep sdpa
    assert model.hf_model.config._attn_implementation == "sdpa"
    assert view.config._attn_implementation == "sdpa"
    assert not [type(m) for m in model.hf_model.modules() if type(m).__module__.startswith("transformer_lens")]
    assert not [type(m) for m in view.modules() if type(m).__module__.startswith("transformer_lens")]
    shared = {p.data_ptr() for p in model.hf_model.parameters()}
    assert all(p.data_ptr() in shared for p in view.parameters())
    assert model.describe()["attention"] == "sdpa"
    asked = unbridged(model.hf_model, "eager")  # a view asked for another attention has it; the model keeps its own
    assert asked.config._attn_implementation == "eager" and model.hf_model.config._attn_implementation == "sdpa"
    assert all(p.data_ptr() in shared for p in asked.parameters())

    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.hf_model.modules())
    after_last: list[int] = []
    norm = view.get_submodule("model.norm")
    handle = norm.register_forward_hook(lambda *args: after_last.append(1))
    try:
        capture_ffn(model, _batch(model), [(1, "post"), (0, "pre")], lambda *args: None)
    finally:
        handle.remove()
    assert after_last == []  # the forward stopped after the last site
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.hf_model.modules()) == hooks_before

    # a weight edit of the model shows in the view: the same tensors
    with torch.no_grad():
        model.hf_model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
    assert torch.equal(view.model.layers[0].mlp.down_proj.weight, model.hf_model.model.layers[0].mlp.down_proj.weight)

    # a failing callback leaves no hook behind in the view
    def fail(*args):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        capture_ffn(model, _batch(model), [(0, "post")], fail)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in view.modules()) == 0

    # a view built after the bridge booted: HF's modules, and HF's attention, not the bridge's eager
    booted = kvmem.load_model(tmp_path, device="cpu")
    assert booted.bridge is not None and booted.hf_model.config._attn_implementation == "sdpa"
    assert booted.unbridged.config._attn_implementation == "sdpa"
    assert not [type(m) for m in booted.unbridged.modules() if type(m).__module__.startswith("transformer_lens")]

    _build("gpt2", ROWS["gpt2"], tmp_path / "gpt2", tokenizer)
    plain_ffn = kvmem.load_model(tmp_path / "gpt2", device="cpu")
    with pytest.raises(KvmemError, match="pre_linear"):  # a plain FFN has no up pre-activation apart from W1 x
        plain_ffn.ffn_site(0, "pre_linear")


SCAN_WITHOUT_THE_BRIDGE = """
import sys, kvmem
model = kvmem.load_model(sys.argv[3], device="cpu")
atlas = kvmem.scan(model, sys.argv[1], out=sys.argv[2], max_tokens=200, progress=False, top_k=3)
assert atlas.manifest.tokens > 0
print(sorted(name for name in sys.modules if name.startswith("transformer_lens")))
print(atlas.manifest.environment["transformer_lens"])
"""


def test_a_scan_never_imports_transformer_lens(tmp_path, llama_dir):
    """Importing TransformerLens and booting its bridge take seconds; a scan needs neither."""
    import subprocess
    import sys
    from importlib.metadata import version

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The key-value reading of a feed-forward layer. " * 20)
    done = subprocess.run([sys.executable, "-c", SCAN_WITHOUT_THE_BRIDGE, str(corpus), str(tmp_path / "atlas"),
                           str(llama_dir)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    modules, recorded = done.stdout.strip().splitlines()[-2:]
    assert modules == "[]"
    assert recorded == version("transformer-lens")  # provenance without the import
