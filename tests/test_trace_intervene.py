"""kvmem.tracing, kvmem.intervention and ``kvmem trace`` / ``kvmem generate`` on tiny random models.

Exact identities: an added delta on m_i moves the FFN output by delta * v_i; all sub-updates plus b2
sum to the FFN output; the logit lens after the last FFN is the model's own prediction. The oracle is
the HF model itself, read with this file's own torch hooks on its modules.
"""

from __future__ import annotations

import pytest
import torch

import kvmem
from kvmem.cli import main
from kvmem.errors import KvmemError
from kvmem.intervention import greedy_continuation, intervene
from kvmem.tracing import plot_prediction_formation, project, trace

PROMPT = "The quick brown fox jumps over the lazy dog because"


# ---- fixtures: the tiny random GPT-2 and Llama of conftest.py ----
@pytest.fixture
def gpt2(gpt2_model):
    return gpt2_model


@pytest.fixture
def llama(llama_model):
    return llama_model


@pytest.fixture(params=["gpt2", "llama"])
def model(request):
    return request.getfixturevalue(request.param)


def test_tiny_configs_are_tiny(gpt2, llama):
    assert (gpt2.n_layers, gpt2.d_model, gpt2.d_ff, gpt2.gated) == (2, 64, 256, False)
    assert (llama.n_layers, llama.d_model, llama.d_ff, llama.gated) == (2, 64, 96, True)
    for m in (gpt2, llama):
        for layer in range(m.n_layers):
            assert m.has_site(layer, "resid_mid") and m.has_site(layer, "resid_post")


# ---- helpers ----
def _ids(model, text=PROMPT):
    return torch.tensor([model.encode(text)])  # [1, pos]


def _mlp(model, layer):
    """The HF MLP module of ``layer`` (GPT-2 ``transformer.h.L.mlp``, Llama ``model.layers.L.mlp``)."""
    blocks = model.hf_model.transformer.h if model.model_type == "gpt2" else model.hf_model.model.layers
    return blocks[layer].mlp


def _raw_linear(model, layer):
    """The HF down projection W2 (c_proj / down_proj): its input is m."""
    mlp = _mlp(model, layer)
    return mlp.c_proj if model.model_type == "gpt2" else mlp.down_proj


def _capture(model, ids, layers):
    """One plain HF forward -> ({layer: FFN output [pos, d_model]}, logits [pos, vocab]), read by this
    file's own forward hooks on the MLP modules (after any active edits)."""
    got = {}
    handles = [_mlp(model, layer).register_forward_hook(
        lambda module, args, out, layer=layer: got.__setitem__(layer, out[0].detach().clone())) for layer in layers]
    try:
        with torch.no_grad():
            logits = model.hf_model(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return got, logits[0]


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_pre_hooks_with_kwargs)
               for m in model.hf_model.modules())


# ---- intervention ----
@pytest.mark.parametrize("positions", [None, [1, -2]])
def test_add_moves_ffn_output_by_delta_times_value(model, positions):
    layer, edits = 1, {(1, 3): 2.5, (1, 17): -1.25}
    ids = _ids(model)
    n = ids.shape[1]
    out = layer
    base, _ = _capture(model, ids, [out])
    with intervene(model, edits, positions=positions, mode="add"):
        edited, _ = _capture(model, ids, [out])
    values = model.values(layer)  # [d_ff, d_model]
    expected = 2.5 * values[3] + (-1.25) * values[17]  # [d_model]
    touched = set(range(n)) if positions is None else {1, n - 2}
    diff = edited[out] - base[out]  # [pos, d_model]
    for p in range(n):
        target = expected if p in touched else torch.zeros_like(expected)
        torch.testing.assert_close(diff[p], target, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode, value", [("set", 3.0), ("scale", 0.5), ("add", 1.0)])
def test_modes_at_down_proj_input(model, mode, value):
    layer, neuron = 0, 5
    ids = _ids(model)
    seen = []

    def observe():  # what W2 / down_proj receives; registered after any edit's hook, so it sees the edit
        return _raw_linear(model, layer).register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))

    with torch.no_grad():
        handle = observe()
        try:
            model.hf_model(ids)
        finally:
            handle.remove()
        with intervene(model, {(layer, neuron): value}, mode=mode, positions=[2]):
            handle = observe()
            try:
                model.hf_model(ids)
            finally:
                handle.remove()
    base, edited = seen[0][0], seen[1][0]  # [pos, d_ff]: the coefficients W2 / down_proj receives
    expected = {"set": torch.tensor(value), "scale": base[2, neuron] * value, "add": base[2, neuron] + value}[mode]
    torch.testing.assert_close(edited[2, neuron], expected.to(edited.dtype))
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[2, neuron] = False
    assert torch.equal(edited[untouched], base[untouched])


def test_hooks_removed_after_block_and_after_exception(model):
    before = _hook_count(model)
    assert before == 0
    with intervene(model, {(0, 1): 2.0, (1, 2): 3.0}):
        during = _hook_count(model)
    assert during > before
    assert _hook_count(model) == before
    with pytest.raises(RuntimeError, match="boom"), intervene(model, {(0, 1): 2.0}, positions=[0]):
        model.hf_model(_ids(model))
        raise RuntimeError("boom")
    assert _hook_count(model) == before
    with intervene(model, {}):
        assert _hook_count(model) == before


def test_positions_are_absolute_during_cached_generation(gpt2):
    """With and without the KV cache, position 7 (a generated token) is set once, nowhere else."""
    layer, neuron, value, target = 1, 4, 7.0, 7
    ids = _ids(gpt2, "Hello world, it is")  # 5 tokens
    for use_cache in (True, False):
        calls: list[torch.Tensor] = []

        def grab(module, args, calls=calls):
            calls.append(args[0][0, :, neuron].detach().clone())  # [pos]

        with intervene(gpt2, {(layer, neuron): value}, positions=[target]):
            # registered after the edit's hook, so it sees the edited m
            handle = _raw_linear(gpt2, layer).register_forward_pre_hook(grab)
            try:
                gpt2.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                                       use_cache=use_cache, pad_token_id=0)
            finally:
                handle.remove()
        sequence = torch.cat(calls) if use_cache else calls[-1]  # coefficient of neuron per absolute position
        assert sequence.shape[0] == ids.shape[1] + 4
        assert sequence[target] == value
        assert not torch.any(torch.cat([sequence[:target], sequence[target + 1:]]) == value)


def test_hf_generate_is_edited_too(gpt2):
    ids = _ids(gpt2, "Hello world")
    base = gpt2.hf_model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    direction = project(gpt2, gpt2.values(1)[[9]], convention="final_norm")[0]  # [vocab]
    with intervene(gpt2, {(1, 9): 1000.0}):
        edited = gpt2.hf_model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert edited[0, 2:].tolist() == [int(direction.argmax())] * 4
    assert edited[0, 2:].tolist() != base[0, 2:].tolist()


def test_generation_strong_edit_differs_empty_edit_equal(model):
    neuron = 11
    direction = project(model, model.values(1)[[neuron]], convention="final_norm")[0]  # [vocab]
    plain = greedy_continuation(model, "Hello world", max_new_tokens=6)
    with intervene(model, {}):
        assert greedy_continuation(model, "Hello world", max_new_tokens=6) == plain
    with intervene(model, {(1, neuron): 1000.0}):
        edited = greedy_continuation(model, "Hello world", max_new_tokens=6)
    assert edited != plain
    assert edited == model.token_str(int(direction.argmax())) * 6


def test_greedy_continuation_is_argmax_decoding(llama):
    ids = llama.encode("Hello world")
    with intervene(llama, {(0, 3): 5.0}):
        text = greedy_continuation(llama, ids, max_new_tokens=3)
        with torch.no_grad():
            for _ in range(3):
                ids = ids + [int(llama.hf_model(torch.tensor([[llama.bos_token_id, *ids]])).logits[0, -1].argmax())]
    assert text == llama.tokenizer.decode(ids[-3:])


def test_bridge_kv_cache_matches_full_forward(gpt2):
    """Guards the pin transformers<5.24: 5.24 renamed the cache argument transformer-lens 4.3 reads."""
    ids = _ids(gpt2)
    with torch.no_grad():
        full = gpt2.hf_model(ids).logits[0, -1]  # [vocab]
        cache = gpt2.hf_model(ids[:, :-1], use_cache=True).past_key_values
        step = gpt2.hf_model(ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1]  # [vocab]
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("edits, options, message", [
    ({(2, 0): 1.0}, {}, r"layer 2 is out of range; this model has layers 0\.\.1"),
    ({(0, 256): 1.0}, {}, r"neuron 256 .* neurons 0\.\.255"),
    ({(0, 0): float("nan")}, {}, "must be finite"),
    ({(0, 0): "3"}, {}, "real number"),
    ({0: 1.0}, {}, r"\(layer, neuron\) pair"),
    ([((0, 0), 1.0)], {}, "must be a dict"),
    ({(0, 0): 1.0}, {"mode": "multiply"}, "choose one of set, scale, add"),
    ({(0, 0): 1.0}, {"positions": ["a"]}, "position must be an int"),
    ({(0, 0): 1.0}, {"positions": [500]}, "outside the model's context"),
])
def test_intervene_validation(gpt2, edits, options, message):
    with pytest.raises(KvmemError, match=message), intervene(gpt2, edits, **options):
        pass
    assert _hook_count(gpt2) == 0


# ---- tracing ----
def test_all_sub_updates_sum_to_ffn_output(model):
    result = trace(model, PROMPT, position=-3, top=None, n_tokens=0, prepend_bos=False)
    ids = _ids(model)
    names = list(range(model.n_layers))
    got, _ = _capture(model, ids, names)
    subs = result.sub_updates
    assert len(subs) == model.n_layers * model.d_ff
    for layer in range(model.n_layers):
        rows = subs[subs.layer == layer].sort_values("neuron")
        assert rows.neuron.tolist() == list(range(model.d_ff))
        m = torch.tensor(rows.coefficient.to_numpy(), dtype=torch.float32)  # [d_ff]
        total = m @ model.values(layer)  # [d_model]
        if model.value_bias(layer) is not None:
            total = total + model.value_bias(layer)
        torch.testing.assert_close(total, got[names[layer]][ids.shape[1] - 3], atol=1e-4, rtol=1e-4)
        assert subs[subs.layer == layer]["rank"].tolist() == list(range(1, model.d_ff + 1))
        assert subs[subs.layer == layer].weight.is_monotonic_decreasing


def test_logit_lens_after_last_ffn_is_the_real_prediction(model):
    result = trace(model, PROMPT, top=4, convention="raw")
    _, logits = _capture(model, torch.tensor([[model.bos_token_id, *model.encode(PROMPT)]]), [])
    probs = logits[-1].softmax(-1)  # [vocab]
    last = result.layers.iloc[-1]
    assert last.top_after_id == int(probs.argmax()) == result.attrs["final_token_id"]
    assert last.final_rank_after == 1
    assert last.final_prob_after == pytest.approx(float(probs.max()), rel=1e-4)
    assert result.layers.changed.tolist() == (result.layers.top_before_id != result.layers.top_after_id).tolist()


def test_trace_frames_and_provenance(gpt2):
    result = trace(gpt2, PROMPT, position=2, top=3, n_tokens=2)
    subs, layers = result.sub_updates, result.layers
    assert len(subs) == 2 * 3 and len(layers) == 2
    assert subs["rank"].tolist() == [1, 2, 3, 1, 2, 3]
    assert all(len(t) == 2 for t in subs.update_tokens) and all(len(t) == 2 for t in subs.value_tokens)
    for frame in (subs, layers, result):
        attrs = frame.attrs
        assert attrs["model"] == gpt2.name and attrs["fingerprint"] == gpt2.fingerprint
        assert attrs["position"] == 3 and attrs["tokens"][3] == gpt2.token_str(gpt2.encode(PROMPT)[2])  # after BOS
        assert attrs["convention"] == "final_norm" and attrs["prompt"] == PROMPT
        assert attrs["kvmem_version"] == kvmem.__version__
    # update tokens of a negative coefficient are the value's most suppressed tokens
    values = gpt2.values(0)
    for row in subs[subs.layer == 0].itertuples():
        scores = project(gpt2, values[[row.neuron]])[0] * (1 if row.coefficient >= 0 else -1)
        assert row.update_tokens[0] == gpt2.token_str(int(scores.argmax()))
    assert "Trace of" in repr(result) and "<table" in result._repr_html_()


def test_trace_validation(gpt2):
    with pytest.raises(KvmemError, match="choose one of raw, final_norm"):
        trace(gpt2, PROMPT, convention="folded")
    with pytest.raises(KvmemError, match=r"position 99 is out of range"):
        trace(gpt2, "Hello", position=99)
    with pytest.raises(KvmemError, match="top must be"):
        trace(gpt2, "Hello", top=0)


def test_plot_prediction_formation(gpt2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = trace(gpt2, PROMPT, top=2, n_tokens=0)
    ax = plot_prediction_formation(result)
    assert len(ax.lines) == 1 and ax.get_ylabel() == "probability"
    plt.close(ax.figure)
    with pytest.raises(KvmemError, match="expects a Trace"):
        plot_prediction_formation(result.sub_updates)


# ---- command line ----
def test_cli_trace(gpt2_dir, capsys):
    assert main(["trace", "--model", str(gpt2_dir), "--top", "2", "--position", "-1", PROMPT]) == 0
    out = capsys.readouterr().out
    assert "final prediction" in out and "top_before" in out and "update_tokens" in out
    assert "final_norm" in out


def test_cli_generate(llama_dir, capsys):
    assert main(["generate", "--model", str(llama_dir), "--set", "1:11=1000", "--set", "0:2=-3",
                 "--max-new-tokens", "4", "Hello world"]) == 0
    out = capsys.readouterr().out
    assert "without:" in out and "with edits:" in out and "changed: True" in out
    assert "L1:11=1000" in out


@pytest.mark.parametrize("bad", ["1:11", "a:b=3", "1:2=x", "1-2=3"])
def test_cli_generate_bad_set(bad, capsys):
    assert main(["generate", "--model", "unused", "--set", bad, "Hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvmem: error: --set expects LAYER:NEURON=VALUE") and repr(bad) in err
    assert len(err.splitlines()) == 1


def test_cli_generate_out_of_range(gpt2_dir, capsys):
    assert main(["generate", "--model", str(gpt2_dir), "--set", "9:0=1", "Hello"]) == 2
    assert "layers 0..1" in capsys.readouterr().err


# ---- trained model ----
@pytest.mark.slow
def test_switching_on_a_value_raises_its_token_on_smollm2():
    model = kvmem.load_model("smollm2-135m", device="cpu")
    layer = model.n_layers - 2
    scores = project(model, model.values(layer))  # [d_ff, vocab]
    neuron = int(scores.max(dim=1).values.argmax())
    token = int(scores[neuron].argmax())
    ids = _ids(model, "The weather today is")
    with torch.no_grad():
        base = model.hf_model(ids).logits[0, -1].softmax(-1)[token]
        with intervene(model, {(layer, neuron): 10.0}, positions=[-1]):
            edited = model.hf_model(ids).logits[0, -1].softmax(-1)[token]
    assert edited > base * 2
