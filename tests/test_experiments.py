"""kvmem.experiments and ``kvmem experiment``: each metric pinned on cases whose answer is known exactly.

Pure cores on hand-built frames and tensors (agreement exactly 1/2, ranks of known scores, means of
known changes); end-to-end runs on tiny random GPT-2 / Llama models, some edited so the answer is
forced (a slot that is always on, a layer that sees only the current token, a value whose top token
is chosen); the recomputed coefficient equals the atlas's stored one; the CLI; the notebook's source.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch

import kvmem
from kvmem import experiments as E
from kvmem.cli import main
from kvmem.errors import KvmemError
from kvmem.experiments.common import FingerprintWarning, convention_vectors, single_cycle, value_top_tokens
from kvmem.experiments.forward import corpus_windows, read_positions, sample_positions
from kvmem.experiments.ranks import SUMMARY_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE_KEYS = {"experiment", "model", "fingerprint", "settings", "kvmem_version"}


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
                top_k: int) -> Path:
    """A minimal atlas directory (manifest + triggers + values) with hand-written rows."""
    import pyarrow as pa

    from kvmem.scanning.writer import write_tables
    from kvmem.schema import FORMAT_VERSION

    manifest = {
        "format_version": FORMAT_VERSION, "kvmem_version": kvmem.__version__,
        "model": {"name": "hand-built", "fingerprint": "sha256:none", "d_ff": d_ff, "vocab_size": vocab_size,
                  "gated": False},
        "corpus": {"spec": "list[0]", "unit": "document"}, "tokens": 0, "layers": sorted(values.layer.unique().tolist()),
        "tokenization": {"window": 8, "prepend_bos": False, "bos_token_id": None, "rule": "-"},
        "scan": {"top_k": top_k, "per_document": False, "conventions": ["final_norm"]},
    }
    tables = {"triggers": pa.Table.from_pandas(triggers, preserve_index=False),
              "values": pa.Table.from_pandas(values, preserve_index=False)}
    write_tables(path, tables, manifest, overwrite=True)
    return path


# ---- agreement ----
def _frames_half():
    """Layer 0: 4 keys, values' top tokens 10, 11, 12, 13; keys 0 and 1 agree with their top trigger (1/2).
    Key 2's top trigger has no next token (-1), so its top-1 is its rank-1 trigger (next 99, no match);
    its rank-2 trigger is followed by 12, so top-2 agreement adds key 2 (3/4)."""
    triggers = pd.DataFrame({
        "layer": [0] * 9,
        "neuron": [0, 0, 1, 1, 2, 2, 2, 3, 3],
        "rank": [0, 1, 0, 1, 0, 1, 2, 0, 1],
        "next_token_id": [10, 5, 11, 11, -1, 99, 12, 7, 8],
    })
    values = pd.DataFrame({"layer": [0] * 4, "neuron": [0, 1, 2, 3], "token_id": [10, 11, 12, 13]})
    return triggers, values


def test_agreement_from_frames_is_exactly_one_half():
    triggers, values = _frames_half()
    frame = E.agreement_from_frames(triggers, values, vocab_size=1000, top_triggers=(1, 2))
    row = frame.iloc[0]
    assert list(frame.columns) == ["layer", "keys", "agree_top1", "shuffled_top1", "random_top1", "agree_top2",
                                   "shuffled_top2", "random_top2"]
    assert row["keys"] == 4
    assert row["agree_top1"] == 0.5
    assert row["agree_top2"] == 0.75
    assert row["random_top1"] == 1 / 1000
    # distinct next tokens among the top-2 valid triggers: key0 {10, 5}, key1 {11}, key2 {99, 12}, key3 {7, 8}
    assert row["random_top2"] == pytest.approx((2 + 1 + 2 + 2) / 4 / 1000)


def test_agreement_shuffled_baseline_pairs_keys_with_other_values():
    # two keys whose next tokens are each other's value tokens: own agreement 0, shuffled (a swap) 1
    triggers = pd.DataFrame({"layer": [3, 3], "neuron": [0, 1], "rank": [0, 0], "next_token_id": [21, 20]})
    values = pd.DataFrame({"layer": [3, 3], "neuron": [0, 1], "token_id": [20, 21]})
    row = E.agreement_from_frames(triggers, values, vocab_size=50, top_triggers=(1,)).iloc[0]
    assert (row["layer"], row["agree_top1"], row["shuffled_top1"]) == (3, 0.0, 1.0)


@pytest.mark.parametrize("n", [2, 3, 10, 257])
def test_single_cycle_moves_every_key(n):
    sigma = single_cycle(n, np.random.default_rng(n))
    assert sorted(sigma.tolist()) == list(range(n))
    assert (sigma != np.arange(n)).all()
    seen, i = set(), 0  # one cycle through every index
    while i not in seen:
        seen.add(i)
        i = int(sigma[i])
    assert len(seen) == n


def test_agreement_on_a_hand_built_atlas_directory(tmp_path):
    triggers, values = _frames_half()
    triggers = triggers.assign(kind="top")
    values = values.assign(convention="final_norm", kind="promote", rank=0)
    path = _fake_atlas(tmp_path / "fake", triggers, values, d_ff=4, vocab_size=1000, top_k=3)
    frame = E.agreement(path, top_triggers=(1, 2))
    assert frame.agree_top1.tolist() == [0.5]
    assert frame.agree_top2.tolist() == [0.75]
    assert frame.attrs["convention"] == "final_norm" and frame.attrs["model"] == "hand-built"
    assert PROVENANCE_KEYS <= set(frame.attrs)
    with pytest.raises(KvmemError, match="1..3"):
        E.agreement(path, top_triggers=(1, 4))
    with pytest.raises(KvmemError, match="per-document"):
        E.agreement(path, kind="top_doc")
    with pytest.raises(KvmemError, match="not in atlas"):
        E.agreement(path, convention="raw")


def test_agreement_on_a_scanned_atlas_matches_pandas(atlas):
    frame = E.agreement(atlas, top_triggers=(1, 3), kind="top_doc")
    triggers = atlas.table("triggers")
    values = atlas.table("values")
    tops = values[(values.convention == "final_norm") & (values.kind == "promote") & (values["rank"] == 0)]
    top_of = {(r.layer, r.neuron): r.token_id for r in tops.itertuples()}
    doc = triggers[(triggers.kind == "top_doc") & (triggers.next_token_id >= 0)].sort_values(["layer", "neuron", "rank"])
    for layer in atlas.layers:
        first = doc[doc.layer == layer].groupby("neuron").head(1)
        expected = np.mean([top_of[(layer, n)] == t for n, t in zip(first.neuron, first.next_token_id)])
        assert frame.loc[frame.layer == layer, "agree_top1"].item() == pytest.approx(expected)
    assert frame.attrs["settings"]["kind"] == "top_doc"
    assert frame.attrs["corpus"].endswith("pydoc6.txt")


def test_a_layer_result_does_not_depend_on_the_other_layers(atlas, gpt2_model):
    full = E.agreement(atlas, seed=5)
    alone = E.agreement(atlas, seed=5, layers=[1])
    pd.testing.assert_frame_equal(full[full.layer == 1].reset_index(drop=True), alone)
    both = E.token_removal_samples(atlas, gpt2_model, keys_per_layer=3, triggers=2, seed=2)
    one = E.token_removal_samples(atlas, gpt2_model, keys_per_layer=3, triggers=2, seed=2, layers=[1])
    pd.testing.assert_frame_equal(both[both.layer == 1].reset_index(drop=True), one)
    with pytest.raises(KvmemError, match="seed must be"):
        E.agreement(atlas, seed=-1)


# ---- next-token rank ----
def test_pair_ranks_counts_strictly_higher_scores():
    basis = torch.eye(4)  # scores are the vector's own entries
    vectors = torch.tensor([[5.0, 3.0, 9.0, 1.0], [2.0, 2.0, 2.0, 7.0]])
    ranks = E.pair_ranks(vectors, basis, np.array([0, 0, 0, 1, 1]), np.array([1, 2, 3, 0, 3]))
    assert ranks.tolist() == [3, 1, 4, 2, 1]  # ties (row 1: three 2.0s) share the better rank


def test_pair_ranks_in_blocks_equals_the_full_matrix():
    generator = torch.Generator().manual_seed(0)
    vectors, basis = torch.randn(37, 8, generator=generator), torch.randn(8, 101, generator=generator)
    slots = np.random.default_rng(0).integers(0, 37, 200)
    tokens = np.random.default_rng(1).integers(0, 101, 200)
    scores = vectors @ basis
    expected = (scores[slots] > scores[slots, tokens][:, None]).sum(1).numpy() + 1
    for block in (1, 5, 37, 64):
        assert E.pair_ranks(vectors, basis, slots, tokens, block=block).tolist() == expected.tolist()


def test_summarize_ranks_exact_quantiles():
    ranks = pd.DataFrame({"layer": [0] * 5 + [1] * 2, "token_rank": [1, 2, 3, 4, 100, 1, 1],
                          "shuffled_rank": [10, 20, 30, 40, 50, 7, 9]})
    out = E.summarize_ranks(ranks)
    assert out.loc[0, ["triggers", "median", "q1", "q3", "top1", "median_shuffled"]].tolist() == [5, 3, 2, 4, 0.2, 30]
    assert out.loc[1, ["median", "top1", "median_shuffled"]].tolist() == [1, 1.0, 8]


def test_value_with_a_chosen_top_token(gpt2_dir, tmp_path):
    """Value 7 of layer 1 points along e_0 and token 1234's unembedding is 100 * e_0: the value's top token is
    1234 under both conventions, its next-token rank is 1, and a token it scores lowest ranks last."""
    def edit(hf):
        hf.transformer.wte.weight[1234] = 0.0
        hf.transformer.wte.weight[1234, 0] = 100.0
        hf.transformer.wte.weight[4321] = 0.0
        hf.transformer.wte.weight[4321, 0] = -100.0
        hf.transformer.h[1].mlp.c_proj.weight[7] = 0.0
        hf.transformer.h[1].mlp.c_proj.weight[7, 0] = 1.0
        hf.transformer.ln_f.weight.fill_(1.0)

    model = kvmem.load_model(_edited_gpt2(gpt2_dir, tmp_path / "chosen", edit), device="cpu")
    assert model.vocab_size == 50257 and model.d_ff == 256
    for convention in ("raw", "final_norm"):
        top, bottom = value_top_tokens(model, 1, convention)
        assert (top[7], bottom[7]) == (1234, 4321)
        vectors = convention_vectors(model, model.values(1), convention)
        ranks = E.pair_ranks(vectors, model.unembedding(), np.array([7, 7]), np.array([1234, 4321]), block=3)
        assert ranks.tolist() == [1, model.vocab_size]


def test_next_token_rank_agrees_with_the_atlas_argmax(atlas, gpt2_model):
    """Rank 1 means the next token is the value's argmax: recomputed from the model in blocks, it reproduces the
    agreement read from the atlas's values table."""
    ranks = E.next_token_ranks(atlas, gpt2_model, triggers=1, kind="top_doc")
    summary = E.summarize_ranks(ranks)
    agree = E.agreement(atlas, top_triggers=(1,), kind="top_doc")
    assert summary.top1.tolist() == pytest.approx(agree.agree_top1.tolist())
    assert ranks.token_rank.between(1, gpt2_model.vocab_size).all()
    assert set(ranks.trigger) == {0}
    frame = E.next_token_rank(atlas, gpt2_model, kind="top_doc")
    assert list(frame.columns) == list(SUMMARY_COLUMNS)
    assert frame.attrs["random_median"] == (gpt2_model.vocab_size + 1) / 2
    assert frame.attrs["fingerprint_match"] is True


# ---- token removal ----
def test_relative_change_and_summary_are_exact():
    assert E.relative_change(np.array([2.0, -4.0, 0.0]), np.array([1.0, -2.0, 5.0])).tolist()[:2] == [-0.5, 0.5]
    assert np.isnan(E.relative_change(np.array([0.0]), np.array([1.0]))[0])
    samples = pd.DataFrame({"layer": [0, 0, 0, 1], "stored": [1.0, 2.0, 3.0, 1.0], "original": [1.0, 2.0, 3.5, 1.0],
                            "change_first": [0.0, -0.5, np.nan, 0.1], "change_last": [-1.0, -0.5, -0.75, 0.25],
                            "change_random": [np.nan, np.nan, np.nan, 0.3]})
    out = E.summarize_token_removal(samples)
    assert out.loc[0, ["samples", "change_first", "change_last", "median_last", "max_abs_error"]].tolist() == \
        [3, -0.25, -0.75, -0.75, 0.5]
    assert np.isnan(out.loc[0, "change_random"])
    assert out.loc[1, ["change_first", "change_last", "change_random"]].tolist() == [0.1, 0.25, 0.3]


def test_token_removal_recomputes_the_stored_activation(atlas, gpt2_model, corpus_file):
    samples = E.token_removal_samples(atlas, gpt2_model, keys_per_layer=6, triggers=3, seed=1)
    assert len(samples) == 2 * 6 * 3 and set(samples.layer) == {0, 1}
    scale = np.abs(samples.stored).max()
    np.testing.assert_allclose(samples.original, samples.stored, rtol=1e-5, atol=1e-5 * scale)
    assert samples.prefix_len.between(1, 32).all()
    long = samples.prefix_len >= 3
    assert long.any() and samples.loc[long, ["first", "last", "random"]].notna().all().all()
    assert samples.loc[long, "random_index"].between(1, samples.loc[long, "prefix_len"] - 2).all()
    assert samples.loc[samples.prefix_len == 1, ["first", "last", "random"]].isna().all().all()
    summary = E.summarize_token_removal(samples)
    assert (summary.max_abs_error <= 1e-5 * scale).all()
    again = E.token_removal_samples(atlas, gpt2_model, keys_per_layer=6, triggers=3, seed=1)
    pd.testing.assert_frame_equal(samples, again)  # seeded
    assert samples.attrs["fingerprint_match"] is True and PROVENANCE_KEYS <= set(samples.attrs)


def test_token_removal_changes_nothing_where_the_layer_sees_one_token(context_free, corpus_file, tmp_path):
    atlas = _scan(context_free, corpus_file, tmp_path / "atlas")
    samples = E.token_removal_samples(atlas, context_free, keys_per_layer=20, triggers=3, layers=[0])
    long = samples[samples.prefix_len >= 3]
    assert len(long) > 10
    np.testing.assert_allclose(long.change_first, 0.0, atol=1e-5)
    np.testing.assert_allclose(long.change_random, 0.0, atol=1e-5)
    # removing the last token reads the previous token instead: a different token, a different coefficient
    assert (long.change_last.abs() > 1e-3).mean() > 0.5


def test_token_removal_needs_the_corpus_of_an_in_memory_scan(gpt2_model, tmp_path):
    docs = ["The cat sat on the mat and looked at the dog.", "Numbers: 1, 2, 3, 5, 8, 13, 21, 34."]
    atlas = _scan(gpt2_model, docs, tmp_path / "atlas", unit="document", max_tokens=None)
    with pytest.raises(KvmemError, match="pass the same corpus"):
        E.token_removal(atlas, gpt2_model, keys_per_layer=2)
    frame = E.token_removal(atlas, gpt2_model, docs, keys_per_layer=2, triggers=2)
    assert frame.samples.tolist() == [4, 4]
    with pytest.raises(KvmemError, match="not the scanned corpus"):
        E.token_removal(atlas, gpt2_model, ["Other text entirely.", "And more.", "Third."], keys_per_layer=2)


# ---- active memories ----
def test_active_fractions_exact():
    m = torch.tensor([[1.0, -1.0, 0.0, 2.0], [0.5, 0.5, 0.5, 0.5]])
    out = E.active_fractions(m, threshold=0.0, abs_threshold=0.5)
    assert out["active"].tolist() == [0.5, 1.0]
    assert out["abs_active"].tolist() == [0.75, 0.0]
    # weights [1, 1, 0, 2] (norms 1): sorted cumulative 2, 3, 4 -> 3 slots reach 90% of 4
    assert out["mass90"].tolist() == [0.75, 1.0]
    out = E.active_fractions(m, value_norms=torch.tensor([10.0, 1.0, 1.0, 1.0]))
    assert out["mass90"].tolist()[0] == 0.5  # weights [10, 1, 0, 2]: 10 + 2 = 12 >= 11.7


def test_a_slot_that_is_always_on_is_the_only_active_one(always_on, corpus_file):
    frame = E.active_memories(always_on, corpus_file, positions=40, unit="paragraph", window=32, max_tokens=400)
    row = frame[frame.layer == 0].iloc[0]
    assert row["positions"] == 40
    assert row["active_mean"] == row["active_q1"] == row["active_q3"] == 1 / 256
    assert row["abs_active_mean"] == 1 / 256 and row["mass90_mean"] == 1 / 256
    assert 0.3 < frame.loc[frame.layer == 1, "active_mean"].item() < 0.7  # the untouched random layer
    assert frame.attrs["settings"]["positions"] == 40 and frame.attrs["corpus"].endswith("pydoc6.txt")


def test_sampled_positions_follow_the_tokenization_rule(gpt2_model, corpus_file):
    corpus = kvmem.corpus.open_corpus(corpus_file, unit="paragraph")
    windows = corpus_windows(gpt2_model, corpus, window=16, max_tokens=300)
    assert sum(len(w.tokens) for w in windows) == 300 and all(len(w.tokens) <= 16 for w in windows)
    sampled = sample_positions(gpt2_model, corpus, positions=50, seed=3, window=16, max_tokens=300)
    assert len(sampled.doc) == 50 and len(set(zip(sampled.doc, sampled.pos))) == 50
    tokens = {d.index: gpt2_model.encode(d.text) for d in corpus}
    bos = gpt2_model.bos_token_id
    read = 0
    for sequence, reads in zip(sampled.sequences, sampled.reads):
        assert sequence[0] == bos
        for at in reads:  # the read token is the sampled document token
            assert sequence[at] == tokens[int(sampled.doc[read])][int(sampled.pos[read])]
            read += 1
    again = sample_positions(gpt2_model, corpus, positions=50, seed=3, window=16, max_tokens=300)
    assert again.pos.tolist() == sampled.pos.tolist()


def test_read_positions_leaves_no_hooks_also_after_an_exception(gpt2_model):
    def boom(index, captured):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        read_positions(gpt2_model, [[1, 2, 3]], [[2]], [gpt2_model.hook_name(1, "post")], boom)
    assert sum(len(h.fwd_hooks) for h in gpt2_model.bridge.hook_dict.values()) == 0
    got = {}
    read_positions(gpt2_model, [[5, 6, 7, 8], [9]], [[0, 3], [0]], [gpt2_model.hook_name(0, "post")],
                   lambda index, captured: got.update(zip(index.tolist(), captured["blocks.0.mlp.hook_post"])))
    store = {}
    with torch.no_grad(), gpt2_model.bridge.hooks(fwd_hooks=[("blocks.0.mlp.hook_post", lambda t, hook: store.update(m=t))]):
        gpt2_model.bridge(torch.tensor([[5, 6, 7, 8]]), return_type=None)
    torch.testing.assert_close(got[1], store["m"][0, 3])
    assert sum(len(h.fwd_hooks) for h in gpt2_model.bridge.hook_dict.values()) == 0


# ---- layer vs memories ----
def test_memory_agreement_exact():
    m = torch.tensor([[2.0, -3.0, 0.0, 1.0], [0.0, 0.0, 5.0, 0.0]])  # [n=2, d_ff=4]
    value_top, value_bottom = torch.tensor([10, 11, 12, 13]), torch.tensor([20, 21, 22, 23])
    ffn_top = torch.tensor([21, 10])  # row 0: slot 1 (m < 0) predicts its bottom token 21; row 1: nobody
    active = m.abs() > 0.5
    out = E.memory_agreement(m, ffn_top, value_top, value_bottom, active=active, weight=m.abs(), top_memories=1)
    assert out["active"].tolist() == [3, 1]
    assert out["matches_active"].tolist() == [True, False]
    assert out["matches_heaviest"].tolist() == [True, False]  # slot 1 is the heaviest of row 0
    out = E.memory_agreement(m, torch.tensor([13, 12]), value_top, value_bottom, active=active, weight=m.abs(),
                             top_memories=2)
    assert out["matches_active"].tolist() == [True, True]
    assert out["matches_top"].tolist() == [False, True]  # slot 3 is third heaviest in row 0


def test_one_active_memory_is_the_whole_layer(always_on, corpus_file):
    frame = E.layer_vs_memories(always_on, corpus_file, positions=30, unit="paragraph", window=32, max_tokens=400)
    row = frame[frame.layer == 0].iloc[0]
    assert (row["active"], row["ffn_matches_active"], row["ffn_matches_heaviest"], row["ffn_matches_none"]) == \
        (1.0, 1.0, 1.0, 0.0)
    last = frame[frame.layer == always_on.n_layers - 1].iloc[0]
    assert last["after_is_final"] == 1.0  # the lens after the last FFN is the model's own prediction
    shares = frame.after_is_before + frame.after_is_ffn + frame.after_is_neither
    assert (shares >= 1.0 - 1e-12).all()  # each position is counted at least once (before and ffn may coincide)
    assert frame.attrs["settings"]["residual_before"] == "hook_resid_mid"
    assert frame.attrs["convention"] == "final_norm" and frame.attrs["settings"]["value_tops_from"] == "model"


def test_layer_vs_memories_on_a_gated_model_uses_signed_coefficients(llama_model, corpus_file):
    frame = E.layer_vs_memories(llama_model, corpus_file, positions=20, unit="paragraph", window=32, max_tokens=300,
                                abs_threshold=0.01, top_memories=5)
    assert list(frame.layer) == [0, 1] and "ffn_matches_top5" in frame
    assert frame.attrs["settings"]["active_rule"] == "|m_i| > 0.01 (gated FFN)"
    assert frame[["ffn_matches_active", "after_is_final"]].apply(lambda c: c.between(0, 1)).all().all()
    assert frame.after_is_final.iloc[-1] == 1.0
    active = E.active_memories(llama_model, corpus_file, positions=20, unit="paragraph", window=32, max_tokens=300)
    assert active.abs_active_mean.between(0, 1).all() and active.attrs["gated"] is True


def test_layer_vs_memories_reads_value_tops_from_the_atlas(atlas, gpt2_model):
    with_atlas = E.layer_vs_memories(gpt2_model, atlas=atlas, positions=25)
    assert with_atlas.attrs["settings"]["value_tops_from"] == "atlas values table"
    assert with_atlas.attrs["settings"]["window"] == 32
    without = E.layer_vs_memories(gpt2_model, atlas.manifest["corpus"]["spec"], positions=25, window=32,
                                  max_tokens=atlas.manifest["tokens"], unit="paragraph")
    cols = ["ffn_matches_active", "ffn_matches_top10", "after_is_final", "before_is_final"]
    pd.testing.assert_frame_equal(with_atlas[cols], without[cols])


# ---- provenance, fingerprints, plots ----
def test_fingerprint_mismatch_is_reported(atlas, always_on):
    with pytest.warns(FingerprintWarning, match="mix two models"):
        frame = E.agreement(atlas, model=always_on, top_triggers=(1,))
    assert frame.attrs["fingerprint_match"] is False
    assert frame.attrs["atlas_fingerprint"] != always_on.fingerprint
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert E.model_for_atlas(atlas) is not None  # the atlas's own model: no warning


def test_plots_return_axes(atlas, gpt2_model):
    import matplotlib.pyplot as plt

    frames = {
        "plot_agreement": E.agreement(atlas),
        "plot_next_token_rank": E.next_token_rank(atlas, gpt2_model),
        "plot_token_removal": E.token_removal(atlas, gpt2_model, keys_per_layer=2, triggers=1),
        "plot_active_memories": E.active_memories(gpt2_model, atlas=atlas, positions=10),
        "plot_layer_vs_memories": E.layer_vs_memories(gpt2_model, atlas=atlas, positions=10),
    }
    for name, frame in frames.items():
        assert PROVENANCE_KEYS <= set(frame.attrs), name
        json.dumps(frame.attrs)  # serialisable
        _, ax = plt.subplots()
        assert getattr(E, name)(frame, ax=ax) is ax
        assert getattr(E, name)(frame).has_data()
        plt.close("all")
    with pytest.raises(KvmemError):
        E.plot_agreement(pd.DataFrame({"x": [1]}))


# ---- command line ----
def test_cli_agreement_and_outputs(atlas, tmp_path, capsys):
    out = tmp_path / "agreement.json"
    assert main(["experiment", "agreement", "--atlas", str(atlas.path), "--top-triggers", "1,2", "--kind", "top_doc",
                 "--out", str(out), "--plot", str(tmp_path / "agreement.png")]) == 0
    printed = capsys.readouterr().out
    assert "agree_top1" in printed and "convention final_norm" in printed
    data = json.loads(out.read_text())
    assert data["provenance"]["settings"]["top_triggers"] == [1, 2] and len(data["rows"]) == 2
    assert (tmp_path / "agreement.png").stat().st_size > 0


def test_cli_runs_every_experiment_with_the_atlas_model(atlas, tmp_path, capsys):
    for name, extra in (("next-token-rank", []), ("token-removal", ["--keys-per-layer", "2", "--triggers", "1"]),
                        ("active-memories", ["--positions", "15"]),
                        ("layer-vs-memories", ["--positions", "15", "--layers", "1"])):
        csv = tmp_path / f"{name}.csv"
        assert main(["experiment", name, "--atlas", str(atlas.path), "--out", str(csv), *extra]) == 0, name
        captured = capsys.readouterr()
        assert "model fingerprint matches the atlas" in captured.out
        assert "warning" not in captured.err
        assert len(pd.read_csv(csv)) == (1 if name == "layer-vs-memories" else 2)


def test_cli_reports_a_fingerprint_mismatch_and_user_errors(atlas, always_on, capsys):
    assert main(["experiment", "active-memories", "--atlas", str(atlas.path), "--model", always_on.source,
                 "--positions", "5"]) == 0
    captured = capsys.readouterr()
    assert "kvmem: warning:" in captured.err and "fingerprint" in captured.err
    assert "DIFFERS" in captured.out
    assert main(["experiment", "agreement", "--atlas", str(atlas.path), "--layers", "0-x"]) == 2
    assert "--layers expects" in capsys.readouterr().err
    assert main(["experiment", "agreement", "--atlas", str(atlas.path), "--layers", "7"]) == 2
    assert "not in atlas" in capsys.readouterr().err
    assert main(["experiment", "agreement", "--atlas", str(atlas.path) + "-missing"]) == 2
    assert main(["experiment", "agreement", "--atlas", str(atlas.path), "--out", "x.txt"]) == 2


# ---- the notebook ----
def test_geva2021_notebook_is_generated_and_cleared():
    """The committed notebook is what notebooks/make_geva2021.py writes, outputs cleared (tests/test_notebooks.py
    executes every notebook with KVMEM_NOTEBOOK_TOKENS=800 and KVMEM_NOTEBOOK_FAST=1)."""
    import importlib.util

    import nbformat

    spec = importlib.util.spec_from_file_location("make_geva2021", ROOT / "notebooks" / "make_geva2021.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    committed = nbformat.read(ROOT / "notebooks" / "geva2021.ipynb", as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in generator.build().cells]
    assert not any(c.get("outputs") or c.get("execution_count") for c in committed.cells if c.cell_type == "code")
    source = "\n".join(c.source for c in committed.cells)
    for name in ("token_removal", "agreement", "next_token_rank", "active_memories", "layer_vs_memories",
                 "KVMEM_NOTEBOOK_TOKENS", "KVMEM_NOTEBOOK_FAST", 'MODEL = "smollm2-135m"',
                 "hf:wikitext:wikitext-103-raw-v1:train"):
        assert name in source
