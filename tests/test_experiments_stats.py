"""The statistics of kvmem.experiments pinned on hand-built cases whose answers are known exactly.

Exact permutation null against brute force over every permutation of a tiny layer; bootstrap
intervals of data whose bootstrap distribution is known; Wilcoxon signed-rank and sign test
statistics computed by hand; pooled and top-1 ranks; signed memories (two per slot).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from experiment_fixtures import _fake_atlas

from kvmem import experiments as E
from kvmem.errors import KvmemError
from kvmem.experiments.signed_memories import memory_sides, trigger_kind
from kvmem.experiments.stats import average_ranks, bootstrap_ci, exact_permutation_null, sign_test, wilcoxon_signed_rank


# ---- exact permutation null ----
def _brute_force_null(target_sets, tokens):
    hits = [np.mean([tokens[p[i]] in target_sets[i] for i in range(len(tokens))])
            for p in itertools.permutations(range(len(tokens)))]
    return float(np.mean(hits))


def test_exact_null_of_a_three_neuron_layer_equals_all_six_permutations():
    # values' top tokens 7, 7, 9; next tokens {7}, {9}, {8}: sum_i #{j: t_j in S_i} = 2 + 1 + 0 = 3 -> 3/9
    sets, tokens = [{7}, {9}, {8}], [7, 7, 9]
    assert exact_permutation_null(sets, tokens) == pytest.approx(1 / 3)
    assert _brute_force_null(sets, tokens) == pytest.approx(1 / 3)


@pytest.mark.parametrize("seed", range(5))
def test_exact_null_with_top_k_sets_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4, size=5).tolist()
    sets = [set(rng.integers(0, 5, size=rng.integers(1, 4)).tolist()) for _ in range(5)]
    assert exact_permutation_null(sets, tokens) == pytest.approx(_brute_force_null(sets, tokens))


def test_exact_null_input_errors():
    assert math.isnan(exact_permutation_null([], []))
    with pytest.raises(KvmemError, match="one target set per value"):
        exact_permutation_null([{1}], [1, 2])


# ---- bootstrap ----
def test_bootstrap_of_a_constant_is_the_constant():
    assert bootstrap_ci([4.0] * 7, n_boot=50) == (4.0, 4.0)
    assert bootstrap_ci([4.0] * 7, statistic="median", n_boot=50) == (4.0, 4.0)


def test_bootstrap_of_two_points_spans_its_known_distribution():
    # resampling [0, 1]: the mean is 0, 1/2 or 1 with probabilities 1/4, 1/2, 1/4 -> the 95% interval is (0, 1)
    assert bootstrap_ci([0.0, 1.0], n_boot=4000, seed=1) == (0.0, 1.0)
    # whole groups: [0, 0 | 1, 1] resampled by group has the same distribution; NaN values are dropped
    assert bootstrap_ci([0.0, 0.0, 1.0, 1.0, np.nan], groups=[5, 5, 9, 9, 9], n_boot=4000, seed=1) == (0.0, 1.0)
    low, high = bootstrap_ci([0.0, 1.0], n_boot=4000, seed=1, level=0.4)  # the middle 40%: always 1/2
    assert (low, high) == (0.5, 0.5)


def test_bootstrap_draws_kept_for_the_next_call_give_numpys_own_replicates():
    """An experiment bootstraps many statistics over the same neurons with one seed; the draws are kept
    between calls. Each call still gives the percentiles of the replicates numpy's multinomial draws for
    that seed, whether the draws were kept (second call) or drawn now (a size over the cache's limit)."""
    values = np.random.default_rng(2).random(300)
    counts = np.random.default_rng(5).multinomial(300, np.full(300, 1 / 300), size=200).astype(np.float64)
    expected = tuple(np.quantile((counts @ values) / counts.sum(axis=1), [0.025, 0.975]).tolist())
    assert bootstrap_ci(values, n_boot=200, seed=5) == pytest.approx(expected, rel=1e-12, abs=0)
    assert bootstrap_ci(values, n_boot=200, seed=5) == bootstrap_ci(values, n_boot=200, seed=5)
    doubled = bootstrap_ci(2 * values, n_boot=200, seed=5)  # the kept draws, other values
    assert doubled == pytest.approx((2 * expected[0], 2 * expected[1]), rel=1e-12, abs=0)
    big = np.random.default_rng(3).random(5000)  # 5,000 groups x 1,000 replicates: drawn anew each call
    counts = np.random.default_rng(0).multinomial(5000, np.full(5000, 1 / 5000), size=800).astype(np.float64)
    means = (counts @ big) / counts.sum(axis=1)
    assert bootstrap_ci(big, n_boot=800, seed=0) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975]).tolist()),
                                                                  rel=1e-12, abs=0)


@pytest.mark.parametrize("statistic", ["median", 0.25, 0.9])
def test_grouped_quantile_bootstrap_is_the_quantile_of_each_resampled_sample(statistic):
    """Each replicate resamples whole groups (numpy's multinomial draws for the seed); its statistic is the quantile
    of the resampled values, every value repeated by its group's count times its integer weight (numpy's
    averaged inverted CDF: the median of an even sample is the mean of its middle two)."""
    rng = np.random.default_rng(11)
    values = rng.integers(1, 40, 900).astype(np.float64)  # many ties, as ranks have
    groups = rng.integers(0, 120, 900)
    weights = rng.integers(1, 4, 900).astype(np.float64)
    counts = np.random.default_rng(7).multinomial(120, np.full(120, 1 / 120), size=300)
    q = 0.5 if statistic == "median" else statistic
    for w in (None, weights):
        each = np.ones(900, np.int64) if w is None else w.astype(np.int64)
        replicates = [np.quantile(np.repeat(values, c[groups] * each), q, method="averaged_inverted_cdf")
                      for c in counts]
        expected = tuple(np.quantile(replicates, [0.025, 0.975]).tolist())
        got = bootstrap_ci(values, groups=groups, weights=w, statistic=statistic, n_boot=300, seed=7)
        assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_bootstrap_weighted_mean_and_median():
    # weights make it a ratio of sums; a single group is always drawn whole
    assert bootstrap_ci([0.5], weights=[10], n_boot=20) == (0.5, 0.5)
    assert bootstrap_ci([1.0, 2.0, 3.0], groups=[0, 0, 0], statistic="median", n_boot=20) == (2.0, 2.0)
    assert all(math.isnan(v) for v in bootstrap_ci([np.nan], n_boot=5))
    with pytest.raises(KvmemError, match="statistic"):
        bootstrap_ci([1.0], statistic="mode")


def test_bootstrap_weights_change_the_known_distribution():
    """lm_quality's accuracy: per-layer rates correct / predictions weighted by predictions, a ratio of sums.
    Rates [0, 1] with weights [1, 3]: the two draws give 0 (1/4), (0·1 + 1·3) / 4 = 3/4 (1/2) or 1 (1/4),
    so the middle 40% is exactly 3/4; unweighted it would be 1/2. The weighted median of the mixed draw is 1
    (the weight passes half at the second value); unweighted it is the midpoint 1/2."""
    correct, predictions = np.array([0.0, 3.0]), np.array([1.0, 3.0])
    rates = correct / predictions
    assert bootstrap_ci(rates, weights=predictions, n_boot=4000, seed=1, level=0.4) == (0.75, 0.75)
    assert bootstrap_ci(rates, n_boot=4000, seed=1, level=0.4) == (0.5, 0.5)
    assert bootstrap_ci(rates, weights=predictions, statistic="median", n_boot=4000, seed=1, level=0.4) == (1.0, 1.0)
    assert bootstrap_ci(rates, weights=predictions, n_boot=4000, seed=1) == (0.0, 1.0)
    # a zero weight drops its value: only the second rate is left
    assert bootstrap_ci(rates, weights=[0.0, 3.0], n_boot=50) == (1.0, 1.0)


# ---- paired tests ----
def test_average_ranks_share_ties():
    assert average_ranks([10, 20, 20, 30]).tolist() == [1, 2.5, 2.5, 4]


def test_wilcoxon_statistic_by_hand():
    got = wilcoxon_signed_rank([1, -2, 3, 4, -5])  # |d| ranks 1..5; positive: 1 + 3 + 4
    assert (got["n"], got["w_plus"], got["w_minus"]) == (5, 8.0, 7.0)
    assert got["z"] == pytest.approx(0.5 / math.sqrt(5 * 6 * 11 / 24))
    # ties and a zero: d = [1, 1, -1, 2, 0] -> zero dropped; |d| ranks 2, 2, 2, 4; W+ = 8; var = 7.5 - (27 - 3)/48 = 7
    x, y = np.array([3, 2, 1, 5, 4]), np.array([2, 1, 2, 3, 4])
    got = wilcoxon_signed_rank(x, y)
    assert (got["n"], got["w_plus"], got["w_minus"]) == (4, 8.0, 2.0)
    assert got["z"] == pytest.approx(3 / math.sqrt(7))
    assert got["p_value"] == pytest.approx(math.erfc(3 / math.sqrt(7) / math.sqrt(2)))
    assert math.isnan(wilcoxon_signed_rank([0, 0])["p_value"])


def test_sign_test_exact():
    got = sign_test([1, 1, 1, 1, 1, -1, 0])  # n = 6, k = 5: p = 2 (C(6,0) + C(6,1)) / 2^6 = 14/64
    assert (got["n"], got["positive"], got["p_value"]) == (6, 5, 14 / 64)
    assert sign_test([1, -1])["p_value"] == 1.0


@pytest.mark.parametrize("n, positive", [(301, 0), (301, 140), (301, 150), (1536, 700), (1536, 1536)])
def test_sign_test_exact_on_many_neurons_is_the_binomial_tail(n, positive):
    """The tail summed from the definition, C(n, k) for every k <= min(k, n - k), in exact rational arithmetic."""
    from fractions import Fraction
    from math import comb

    tail = sum(comb(n, k) for k in range(min(positive, n - positive) + 1))
    expected = float(min(Fraction(1), Fraction(2 * tail, 2 ** n)))
    got = sign_test([1.0] * positive + [-1.0] * (n - positive))
    assert (got["n"], got["positive"], got["p_value"]) == (n, positive, expected)


# ---- signed memories ----
def test_memory_sides():
    assert memory_sides(False) == ("positive",)
    assert memory_sides(True) == ("positive", "negative")
    assert memory_sides(True, "negative") == ("negative",)
    assert (trigger_kind("positive", "top_doc"), trigger_kind("negative", "top"), trigger_kind("negative", "top_doc")) == \
        ("top_doc", "bottom", "bottom_doc")
    with pytest.raises(KvmemError, match="positive, negative"):
        memory_sides(True, ["up"])


def test_pair_ranks_under_minus_v():
    basis = torch.eye(4)  # scores are the vector's own entries
    vectors = torch.tensor([[5.0, 3.0, 9.0, 1.0]])
    ranks = E.pair_ranks(vectors, basis, np.zeros(4, int), np.array([1, 3, 2, 1]), signs=np.array([-1, -1, -1, 1]))
    assert ranks.tolist() == [2, 1, 4, 3]  # -v scores -5, -3, -9, -1


# ---- pooled ranks and the paired test ----
def test_summarize_ranks_pooled_top1_and_paired_test():
    ranks = pd.DataFrame({
        "layer": [0] * 6, "neuron": [0, 0, 1, 1, 2, 2], "trigger": [0, 1, 0, 1, 0, 1],
        "token_rank": [1, 9, 2, 4, 3, 100], "shuffled_rank": [10, 12, 20, 30, 40, 40], "self_rank": [5] * 6})
    out = E.summarize_ranks(ranks, n_boot=50).iloc[0]
    assert (out["neurons"], out["triggers"], out["median"], out["median_top1"]) == (3, 6, 3.5, 2.0)
    assert (out["top1"], out["median_shuffled"], out["median_self"]) == (1 / 6, 25.0, 5.0)
    # per neuron: median shuffled - median own = 11 - 5, 25 - 3, 40 - 51.5 -> d = 6, 22, -11.5: W+ = 1 + 3
    assert (out["wilcoxon_n"], out["wilcoxon_w_plus"]) == (3, 4.0)
    assert out["wilcoxon_z"] == pytest.approx((4 - 3) / math.sqrt(3 * 4 * 7 / 24))
    assert out["sign_p"] == 1.0
    assert out["median_ci_low"] <= out["median"] <= out["median_ci_high"]


# ---- agreement with nulls, signed ----
def test_agreement_from_frames_null_and_self_alignment():
    triggers = pd.DataFrame({"layer": [0] * 3, "neuron": [0, 1, 2], "rank": [0, 0, 0],
                             "token_id": [7, 1, 1], "next_token_id": [7, 9, 8]})
    values = pd.DataFrame({"layer": [0] * 3, "neuron": [0, 1, 2], "token_id": [7, 7, 9]})
    row = E.agreement_from_frames(triggers, values, vocab_size=100, top_triggers=(1,), n_boot=50).iloc[0]
    assert (row["neurons"], row["agree_top1"], row["null_top1"], row["chance_top1"]) == (3, 1 / 3, 1 / 3, 0.01)
    assert (row["self_top1"], row["null_self_top1"]) == (1 / 3, 2 / 9)  # own tokens {7}, {1}, {1}


def test_agreement_reads_both_sides_of_a_signed_atlas(tmp_path):
    """A gated atlas: neuron 0's top trigger is followed by its value's top token (positive side agrees),
    neuron 1's bottom trigger by its value's most suppressed token (negative side agrees)."""
    triggers = pd.DataFrame({"layer": [0] * 4, "neuron": [0, 1, 0, 1], "kind": ["top", "top", "bottom", "bottom"],
                             "rank": [0] * 4, "token_id": [1] * 4, "next_token_id": [10, 50, 50, 21]})
    values = pd.DataFrame({"layer": [0] * 4, "neuron": [0, 1, 0, 1], "convention": ["final_norm"] * 4,
                           "kind": ["promote", "promote", "suppress", "suppress"], "rank": [0] * 4,
                           "token_id": [10, 11, 20, 21]})
    path = _fake_atlas(tmp_path / "signed", triggers, values, d_ff=2, vocab_size=100, top_k=1, gated=True)
    frame = E.agreement(path, n_boot=20)
    assert frame.side.tolist() == ["positive", "negative"] and frame.convention.tolist() == ["final_norm"] * 2
    assert frame.agree_top1.tolist() == [0.5, 0.5]
    assert frame.attrs["settings"]["sides"] == ["positive", "negative"]
    positive = E.agreement(path, sides="positive", n_boot=20)
    assert positive.side.tolist() == ["positive"]
