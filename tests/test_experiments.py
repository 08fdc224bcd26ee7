"""kvmem.experiments and ``kvmem experiment``: each metric pinned on cases whose answer is known exactly.

Pure cores on hand-built frames and tensors (agreement exactly 1/2, ranks of known scores, means of
known changes); end-to-end runs on tiny random GPT-2 / Llama models, some edited so the answer is
forced (a slot that is always on, a layer that sees only the current token, a value whose top token
is chosen); the recomputed coefficient equals the atlas's stored one; the CLI; the notebook's source.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch
from experiment_fixtures import _edited_gpt2, _fake_atlas, _scan

import kvmem
from kvmem import experiments as E
from kvmem.conventions import convention_vectors
from kvmem.errors import KvmemError
from kvmem.experiments import ranks as ranks_module
from kvmem.experiments.atlas_inputs import value_top_tokens
from kvmem.experiments.ranks import SUMMARY_COLUMNS
from kvmem.experiments.stats import single_cycle

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE_KEYS = {"experiment", "model", "fingerprint", "settings", "kvmem_version"}



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
    frame = E.agreement_from_frames(triggers, values, vocab_size=1000, top_triggers=(1, 2), n_boot=50)
    row = frame.iloc[0]
    assert list(frame.columns) == ["layer", "neurons"] + [
        f"{p}_top{k}{q}" for k in (1, 2) for p, q in (("agree", ""), ("agree", "_ci_low"), ("agree", "_ci_high"),
                                                      ("null", ""), ("chance", ""))]
    assert row["neurons"] == 4
    assert row["agree_top1"] == 0.5
    assert row["agree_top2"] == 0.75
    assert row["chance_top1"] == 1 / 1000
    # distinct next tokens among the top-2 valid triggers: neuron0 {10, 5}, neuron1 {11}, neuron2 {99, 12}, neuron3 {7, 8}
    assert row["chance_top2"] == pytest.approx((2 + 1 + 2 + 2) / 4 / 1000)
    # exact null: the value tokens are distinct, so it counts (neuron, value) hits / n^2: top-1 sets {10}, {11}, {99},
    # {7} hold 2 value tokens; top-2 sets {10, 5}, {11}, {99, 12}, {7, 8} hold 3
    assert row["null_top1"] == 2 / 16 and row["null_top2"] == 3 / 16
    assert row["agree_top1_ci_low"] <= 0.5 <= row["agree_top1_ci_high"]


def test_agreement_null_pairs_neurons_with_other_values():
    # two neurons whose next tokens are each other's value tokens: own agreement 0, null 1/2 (swap or not)
    triggers = pd.DataFrame({"layer": [3, 3], "neuron": [0, 1], "rank": [0, 0], "next_token_id": [21, 20]})
    values = pd.DataFrame({"layer": [3, 3], "neuron": [0, 1], "token_id": [20, 21]})
    row = E.agreement_from_frames(triggers, values, vocab_size=50, top_triggers=(1,), n_boot=20).iloc[0]
    assert (row["layer"], row["agree_top1"], row["null_top1"]) == (3, 0.0, 0.5)


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
    triggers = triggers.assign(kind="top", token_id=1)
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
    assert frame.side.tolist() == ["positive"]  # a ReLU/GELU atlas: the paper's positive side only


def test_agreement_on_a_scanned_atlas_matches_pandas(atlas):
    frame = E.agreement(atlas, top_triggers=(1, 3), kind="top_doc", convention="final_norm")
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
    full = E.agreement(atlas, seed=5, n_boot=50)
    alone = E.agreement(atlas, seed=5, layers=[1], n_boot=50)
    pd.testing.assert_frame_equal(full[full.layer == 1].reset_index(drop=True), alone)
    both = E.token_removal_samples(atlas, gpt2_model, neurons_per_layer=3, triggers=2, seed=2)
    one = E.token_removal_samples(atlas, gpt2_model, neurons_per_layer=3, triggers=2, seed=2, layers=[1])
    pd.testing.assert_frame_equal(both[both.layer == 1].reset_index(drop=True), one)
    with pytest.raises(KvmemError, match="seed must be"):
        E.agreement(atlas, seed=-1)


# ---- next-token rank ----
def test_pair_ranks_counts_strictly_higher_scores():
    basis = torch.eye(4)  # scores are the vector's own entries
    vectors = torch.tensor([[5.0, 3.0, 9.0, 1.0], [2.0, 2.0, 2.0, 7.0]])
    ranks = E.pair_ranks(vectors, basis, np.array([0, 0, 0, 1, 1]), np.array([1, 2, 3, 0, 3]))
    assert ranks.tolist() == [3, 1, 4, 2, 1]  # ties (row 1: three 2.0s) share the better rank


def test_pair_ranks_in_blocks_equals_the_full_matrix(monkeypatch):
    """Blocks counted from one product of many rows, from products capped at a few blocks (rows without pairs
    between them), and one product per block: the same ranks as numpy's count over the rows of one product."""
    generator = torch.Generator().manual_seed(0)
    vectors, basis = torch.randn(37, 8, generator=generator), torch.randn(8, 101, generator=generator)
    slots = np.random.default_rng(0).integers(0, 37, 200)
    slots = slots[(slots < 9) | (slots > 22)]  # blocks without pairs
    tokens = np.random.default_rng(1).integers(0, 101, len(slots))
    scores = vectors @ basis
    expected = (scores[slots] > scores[slots, tokens][:, None]).sum(1).numpy() + 1
    for cap in (1 << 29, 101 * 4 * 11, 1):  # products of every row, of 11 rows at most, of one block
        monkeypatch.setattr(ranks_module, "_GEMM_BYTES", cap)
        for block in (1, 5, 37, 64):
            assert E.pair_ranks(vectors, basis, slots, tokens, block=block).tolist() == expected.tolist()


def test_pair_ranks_by_counting_equal_the_ranks_of_a_full_argsort_ties_included():
    """Integer scores (exact in float32, so numpy and the GEMM agree to the bit) with many ties, both signs
    mixed on one row and repeated pairs: each rank is the first position, in a full descending argsort of
    the row (ascending under -v), of the tokens tied with the pair's token, plus one."""
    rng = np.random.default_rng(3)
    vectors = torch.from_numpy(rng.integers(-3, 4, (29, 6)).astype(np.float32))
    basis = torch.from_numpy(rng.integers(-2, 3, (6, 997)).astype(np.float32))
    slots = rng.integers(0, 29, 600)
    tokens = rng.integers(0, 997, 600)
    signs = rng.choice([-1, 1], 600)
    slots[:50], tokens[:50] = 4, tokens[0]  # one pair repeated, both signs
    scores = vectors.numpy().astype(np.int64) @ basis.numpy().astype(np.int64)  # [29, 997] exact
    expected = []
    for slot, token, sign in zip(slots, tokens, signs):
        row = scores[slot] * sign
        order = np.argsort(-row, kind="stable")
        position = np.empty(len(row), np.int64)
        position[order] = np.arange(len(row))
        expected.append(position[row == row[token]].min() + 1)
    assert len(np.unique(scores[0])) < 60  # ties everywhere: 997 scores, under 60 values
    for block in (1, 7, 29, 256):
        assert E.pair_ranks(vectors, basis, slots, tokens, signs=signs, block=block).tolist() == expected


def test_pair_ranks_with_nan_signed_zeros_and_infinities_follow_the_counting_definition():
    """Scores with NaN, -0.0 beside 0.0 and ±inf (d_model 1: each score is one product, scale × special
    value, so a 0 scale turns ±inf and NaN into NaN and -1.5 into -0.0): each rank is
    1 + np.count_nonzero(row > score) (+v) or (row < score) (-v), NaN never counted, a NaN token score
    ranked 1."""
    special = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf, 1.5, -1.5, 0.0, np.nan, 2.0, 1.5, -0.0], np.float32)
    scales = np.array([1.0, -1.0, 0.0, 2.0, -0.5], np.float32)
    with np.errstate(invalid="ignore"):  # 0 × inf is NaN, as wanted
        scores = scales[:, None] * special[None, :]  # [5, 12], one product each
    slots = np.repeat(np.arange(5), 24)
    tokens = np.tile(np.arange(12), 10)
    signs = np.tile(np.repeat([1, -1], 12), 5)
    expected = [1 + (np.count_nonzero(scores[s] > scores[s, t]) if g > 0 else np.count_nonzero(scores[s] < scores[s, t]))
                for s, t, g in zip(slots, tokens, signs)]
    assert len(set(expected)) > 5 and np.isnan(scores).sum() > 5
    for block in (1, 2, 5):
        got = E.pair_ranks(torch.from_numpy(scales[:, None]), torch.from_numpy(special[None, :]), slots, tokens,
                           signs=signs, block=block)
        assert got.tolist() == expected


def test_pair_ranks_on_a_wide_vocabulary_equal_the_count_over_the_row():
    """Continuous scores over a vocabulary wider than the counting's bins (most scores counted a bin at a time),
    repeated tokens, both signs, a row of one value, a row spanning 1e-30..1e30 and rows without pairs: each
    rank is 1 + np.count_nonzero(row > score) (+v) or (row < score) (-v)."""
    rng = np.random.default_rng(7)
    scores = rng.standard_normal((40, 30_000)).astype(np.float32)
    scores[3] = 0.25
    scores[5] = (rng.choice([-1, 1], 30_000) * 10.0 ** rng.uniform(-30, 30, 30_000)).astype(np.float32)
    slots = rng.choice([0, 1, 2, 3, 5, 8, 13, 21, 34, 39], 4_000)
    tokens = rng.integers(0, 30_000, 4_000)
    tokens[::4] = tokens[0]  # one token needed by many pairs of a row
    signs = rng.choice([-1, 1], 4_000)
    expected = [1 + (np.count_nonzero(scores[s] > scores[s, t]) if g > 0 else np.count_nonzero(scores[s] < scores[s, t]))
                for s, t, g in zip(slots, tokens, signs)]
    for block in (16, 64):  # identity vectors: the scores are the basis's rows, exactly
        got = E.pair_ranks(torch.eye(40), torch.from_numpy(scores), slots, tokens, signs=signs, block=block)
        assert got.tolist() == expected


def test_summarize_ranks_exact_quantiles():
    ranks = pd.DataFrame({"layer": [0] * 5 + [1] * 2, "token_rank": [1, 2, 3, 4, 100, 1, 1],
                          "shuffled_rank": [10, 20, 30, 40, 50, 7, 9]})
    out = E.summarize_ranks(ranks, n_boot=20)
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


def test_value_top_tokens_of_a_lazy_atlas_are_the_argmax_and_read_from_rows_kept_by_an_earlier_command(
        atlas, gpt2_model, tmp_path, monkeypatch):
    """An atlas without a values table: with nothing kept, the tokens are numpy's argmax / argmin of the brute-force
    scores and nothing is written to the cache; once a command has kept the layer's rows (a whole-layer query, as
    explain makes), a fresh reader takes the tokens from those rows (an edited rank-0 token shows through)."""
    import pyarrow.parquet as pq

    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    assert not atlas.holds("values")
    unembedding = gpt2_model.unembedding().float().numpy()
    for convention in ("raw", "final_norm"):
        top, bottom = value_top_tokens(None, 1, convention, atlas=kvmem.open(atlas.path, model=gpt2_model))
        scores = convention_vectors(gpt2_model, gpt2_model.values(1), convention).float().numpy() @ unembedding
        assert top.tolist() == scores.argmax(axis=1).tolist() and bottom.tolist() == scores.argmin(axis=1).tolist()
        assert not list((tmp_path / "cache").glob(f"projections/layers/*-values-{convention}"))
        kvmem.open(atlas.path, model=gpt2_model).projection_rows("values", 1, range(atlas.d_ff), labels=[convention])
        kept = list((tmp_path / "cache").glob(f"projections/layers/*-values-{convention}/values.parquet"))
        assert len(kept) == 1
        rows = pq.read_table(kept[0]).to_pandas()
        first = (rows["rank"] == 0) & (rows.kind == "promote") & (rows.neuron == 0)
        assert rows.loc[first, "token_id"].tolist() == [top[0]]
        rows.loc[first, "token_id"] = (top[0] + 1) % gpt2_model.vocab_size
        rows.to_parquet(kept[0], index=False)
        again = value_top_tokens(None, 1, convention, atlas=kvmem.open(atlas.path, model=gpt2_model))
        assert again[0].tolist() == [(top[0] + 1) % gpt2_model.vocab_size] + top[1:].tolist()
        assert again[1].tolist() == bottom.tolist()


def test_next_token_rank_agrees_with_the_atlas_argmax(atlas, gpt2_model):
    """Rank 1 means the next token is the value's argmax: recomputed from the model in blocks, it reproduces the
    agreement read from the atlas's values table."""
    ranks = E.next_token_ranks(atlas, gpt2_model, triggers=1, kind="top_doc")
    summary = E.summarize_ranks(ranks, n_boot=20)
    agree = E.agreement(atlas, top_triggers=(1,), kind="top_doc", n_boot=20)
    assert summary.convention.tolist() == agree.convention.tolist()  # raw and final_norm, per layer
    assert summary.top1.tolist() == pytest.approx(agree.agree_top1.tolist())
    assert ranks.token_rank.between(1, gpt2_model.vocab_size).all()
    assert set(ranks.trigger) == {0} and set(ranks.side) == {"positive"}
    # the self-token diagnostic: rank 1 exactly where the value's top token is the trigger's own token
    self_top = ranks.groupby(["convention", "layer"], sort=False).self_rank.apply(lambda r: (r == 1).mean())
    assert self_top.tolist() == pytest.approx(agree.self_top1.tolist())
    frame = E.next_token_rank(atlas, gpt2_model, kind="top_doc", n_boot=20)
    assert list(frame.columns) == list(SUMMARY_COLUMNS)
    pooled = E.next_token_ranks(atlas, gpt2_model, kind="top_doc", convention="raw")
    assert pooled.trigger.max() >= 1 and len(pooled) > len(ranks) / 2  # every kept trigger, pooled
    assert frame.attrs["random_median"] == (gpt2_model.vocab_size + 1) / 2
    assert frame.attrs["fingerprint_match"] is True


# ---- token removal ----
def test_relative_change_and_summary_are_exact():
    assert E.relative_change(np.array([2.0, -4.0, 0.0]), np.array([1.0, -2.0, 5.0])).tolist()[:2] == [-0.5, 0.5]
    assert np.isnan(E.relative_change(np.array([0.0]), np.array([1.0]))[0])
    samples = pd.DataFrame({"layer": [0, 0, 0, 1], "stored": [1.0, 2.0, 3.0, 1.0], "original": [1.0, 2.0, 3.5, 1.0],
                            "change_first": [0.0, -0.5, np.nan, 0.1], "change_last": [-1.0, -0.5, -0.75, 0.25],
                            "change_random": [np.nan, np.nan, np.nan, 0.3]})
    out = E.summarize_token_removal(samples, n_boot=20)
    assert out.loc[0, ["samples", "change_first", "change_last", "median_last", "max_abs_error"]].tolist() == \
        [3, -0.25, -0.75, -0.75, 0.5]
    assert np.isnan(out.loc[0, "change_random"])
    assert out.loc[1, ["change_first", "change_last", "change_random"]].tolist() == [0.1, 0.25, 0.3]


def test_token_removal_recomputes_the_stored_activation(atlas, gpt2_model, corpus_file):
    samples = E.token_removal_samples(atlas, gpt2_model, neurons_per_layer=6, triggers=3, seed=1)
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
    again = E.token_removal_samples(atlas, gpt2_model, neurons_per_layer=6, triggers=3, seed=1)
    pd.testing.assert_frame_equal(samples, again)  # seeded
    assert samples.attrs["fingerprint_match"] is True and PROVENANCE_KEYS <= set(samples.attrs)


def test_token_removal_changes_nothing_where_the_layer_sees_one_token(context_free, corpus_file, tmp_path):
    atlas = _scan(context_free, corpus_file, tmp_path / "atlas")
    samples = E.token_removal_samples(atlas, context_free, neurons_per_layer=20, triggers=3, layers=[0])
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
        E.token_removal(atlas, gpt2_model, neurons_per_layer=2)
    frame = E.token_removal(atlas, gpt2_model, docs, neurons_per_layer=2, triggers=2)
    assert frame.samples.tolist() == [4, 4]
    with pytest.raises(KvmemError, match="not the scanned corpus"):
        E.token_removal(atlas, gpt2_model, ["Other text entirely.", "And more.", "Third."], neurons_per_layer=2)


def test_token_removal_values_are_plain_hf_forwards_of_each_modified_prefix(gpt2_model, tmp_path):
    """Every coefficient against the paper's definition, one plain HF forward per modified prefix with a torch
    pre-hook on the layer's c_proj: the original prefix (window start .. trigger), without its first token,
    without its last (read at the new last token) and without the random interior token the sample names.
    Several triggers share a window here, so the shared reads are checked where they are shared."""
    from pydoc_data.topics import topics

    docs = [topics[key][:600] for key in sorted(topics)[:4]]
    atlas = _scan(gpt2_model, docs, tmp_path / "atlas", unit="document", window=24)
    samples = E.token_removal_samples(atlas, gpt2_model, docs, neurons_per_layer=12, triggers=4, seed=3)
    assert samples.groupby(["doc", samples.pos // 24]).size().max() > 1  # windows shared by several samples
    hf = gpt2_model.hf_model
    captured = {}
    handles = [getattr(block.mlp.c_proj, "original_component", block.mlp.c_proj).register_forward_pre_hook(
        lambda module, args, layer=layer: captured.__setitem__(layer, args[0][0].detach().clone()))
        for layer, block in enumerate(hf.transformer.h)]

    def at_last(ids: list[int], layer: int, neuron: int) -> float:
        with torch.no_grad():
            hf(torch.tensor([[gpt2_model.bos_token_id] + ids]))
        return float(captured[layer][-1, neuron])

    try:
        for row in samples.itertuples():
            ids = gpt2_model.tokenizer(docs[row.doc], add_special_tokens=False)["input_ids"]
            prefix = ids[row.pos // 24 * 24:row.pos + 1]
            assert len(prefix) == row.prefix_len
            expected = {"original": at_last(prefix, row.layer, row.neuron)}
            if len(prefix) >= 2:
                expected["first"] = at_last(prefix[1:], row.layer, row.neuron)
                expected["last"] = at_last(prefix[:-1], row.layer, row.neuron)
            if len(prefix) >= 3:
                r = row.random_index
                expected["random"] = at_last(prefix[:r] + prefix[r + 1:], row.layer, row.neuron)
            for column in ("original", "first", "last", "random"):
                got = getattr(row, column)
                if column in expected:
                    assert got == pytest.approx(expected[column], rel=1e-5, abs=1e-6), (row.Index, column)
                else:
                    assert np.isnan(got), (row.Index, column)
    finally:
        for handle in handles:
            handle.remove()
