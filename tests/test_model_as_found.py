"""kvmem leaves the user's model exactly as it found it: every function that reads or edits activations
(trace, intervene, capture, greedy generation, the experiments, the TransformerLens bridge it offers) is
checked against the HF model itself: the same state_dict keys and attention implementation, no hook
left on any module (also after an exception inside a ``with`` block), logits equal to the bit, and a
``save_pretrained`` -> ``from_pretrained`` round trip that works and gives the same logits."""

from __future__ import annotations

import pytest
import torch

import kvmem
from kvmem.capture import capture
from kvmem.intervention import greedy_continuation, intervene

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _snapshot(hf_model, ids):
    """What a user would compare: keys, attention implementation, hooks, modules, logits."""
    with torch.no_grad():
        logits = hf_model(ids).logits.clone()
    hooks = sum(len(getattr(m, name, {}) or {}) for m in hf_model.modules() for name in _HOOK_DICTS)
    return {"keys": list(hf_model.state_dict().keys()), "attention": hf_model.config._attn_implementation,
            "hooks": hooks, "modules": [(name, type(m).__name__) for name, m in hf_model.named_modules()],
            "logits": logits}


def _same(before, after):
    assert after["keys"] == before["keys"]
    assert after["attention"] == before["attention"]
    assert after["hooks"] == before["hooks"] == 0
    assert after["modules"] == before["modules"]
    assert torch.equal(after["logits"], before["logits"])  # to the bit


def _operations(model):
    """Every kvmem call that runs the model, each as a zero-argument function."""
    from kvmem.experiments.forward import read_positions

    layer, neuron = model.n_layers - 1, 3
    names = [model.hook_name(0, "post"), model.hook_name(model.n_layers - 1, "resid_post")]

    def edited_generation():
        with intervene(model, {(layer, neuron): 25.0}):
            greedy_continuation(model, "The cat sat on the", max_new_tokens=3)
            kvmem.trace(model, "The cat sat on the", top=2)

    def raising_block():
        with pytest.raises(RuntimeError, match="inside the block"), intervene(model, {(layer, neuron): 5.0}):
            model.hf_model(torch.tensor([[5, 6, 7]]))
            raise RuntimeError("an error inside the block")

    def stopped_capture():
        capture(model, torch.tensor([[5, 6, 7, 8]]), names[:1], stop_early=True)

    def experiment_reads():
        read_positions(model, [[5, 6, 7, 8], [9, 10]], [[1, 3], [0]], names, lambda index, got: None)

    return {"trace": lambda: kvmem.trace(model, "The cat sat on the", top=3),
            "greedy": lambda: greedy_continuation(model, "The cat sat", max_new_tokens=3),
            "intervene+generate+trace": edited_generation, "exception in intervene": raising_block,
            "capture (early stop)": stopped_capture, "capture (to the logits)": lambda: capture(
                model, torch.tensor([[5, 6, 7]]), names, stop_early=False,
                logits_at=(torch.tensor([0]), torch.tensor([2]))),
            "experiment reads": experiment_reads, "bridge": lambda: model.bridge(torch.tensor([[5, 6, 7]]))}


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_every_reading_leaves_the_model_as_found(which, gpt2_dir, llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = kvmem.load_model(gpt2_dir if which == "gpt2" else llama_dir, device="cpu")
    ids = torch.tensor([[11, 22, 33, 44, 55]])
    before = _snapshot(model.hf_model, ids)
    assert before["attention"] == "sdpa"
    for name, operation in _operations(model).items():
        operation()
        after = _snapshot(model.hf_model, ids)
        try:
            _same(before, after)
        except AssertionError as error:
            raise AssertionError(f"{name} changed the model: {error}") from None
    model.hf_model.save_pretrained(tmp_path / "saved")  # refused before: shared tensors of the bridge's copies
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    _same(before, _snapshot(reloaded.eval(), ids))


def test_intervene_edits_the_models_own_forward_and_only_inside(llama_dir):
    """Inside the block the HF model's own forward is edited at the down projection's input (checked with a
    plain torch pre-hook of the test's own); outside, it is the model as before."""
    model = kvmem.load_model(llama_dir, device="cpu")
    ids = torch.tensor([[11, 22, 33, 44, 55]])
    block = model.hf_model.model.layers[1]  # the last block
    seen, mids = [], []
    handles = [block.mlp.down_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone())),
               block.post_attention_layernorm.register_forward_pre_hook(lambda module, args: mids.append(args[0].clone()))]
    try:
        with torch.no_grad():
            plain = model.hf_model(ids).logits
            with intervene(model, {(1, 7): 3.5, (1, 9): -2.0}, positions=[2, -1]):
                edited = model.hf_model(ids).logits
            after = model.hf_model(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    # the test's hook was registered first, so it saw the model's own m each time; the edit came after it
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[0])
    assert not torch.equal(edited, plain) and torch.equal(after, plain)
    expected = seen[0].clone()  # [1, pos, d_ff]
    expected[0, [2, 4], 7] = 3.5
    expected[0, [2, 4], 9] = -2.0
    with torch.no_grad():  # the last block's output from the edited m, then HF's final norm and lm_head
        want = model.hf_model.lm_head(model.hf_model.model.norm(mids[1] + block.mlp.down_proj(expected)))
    assert torch.allclose(edited, want, atol=1e-5), float((edited - want).abs().max())


def test_trace_reads_bos_as_the_scan_does_and_ends_in_the_models_logits(gpt2_model):
    """trace reads [BOS] + prompt as a scan reads a window; its last layer's top token is the HF model's own
    argmax on those ids, and its coefficients are those of a plain pre-hook on the HF down projection."""
    text = "Feed-forward layers hold two thirds of the parameters"
    result = kvmem.trace(gpt2_model, text, top=None, n_tokens=0)
    ids = [gpt2_model.tokenizer.bos_token_id, *gpt2_model.tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert result.attrs["token_ids"] == ids and result.attrs["bos"] is True
    assert result.attrs["position"] == len(ids) - 1
    m = {}
    handles = [gpt2_model.hf_model.transformer.h[layer].mlp.c_proj.register_forward_pre_hook(
        lambda mod, args, layer=layer: m.__setitem__(layer, args[0][0, -1].clone())) for layer in range(2)]
    try:
        with torch.no_grad():
            logits = gpt2_model.hf_model(torch.tensor([ids])).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    assert result.attrs["final_token_id"] == int(logits.argmax())
    last = result.layers.iloc[-1]
    assert last["top_after_id"] == int(logits.argmax())
    for layer in range(2):
        rows = result.sub_updates[result.sub_updates.layer == layer].sort_values("neuron")
        assert torch.equal(torch.tensor(rows["coefficient"].to_numpy(), dtype=torch.float32), m[layer])
    alone = kvmem.trace(gpt2_model, text, top=1, prepend_bos=False)
    assert alone.attrs["token_ids"] == ids[1:] and alone.attrs["bos"] is False
