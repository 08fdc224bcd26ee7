"""The scores' metrics against hand-computed cases from the papers' definitions, and their nulls by simulation.

Oracles: arithmetic done by hand here (Delphi's compute_classification_metrics, neuron-explainer's
correlation / rsquared / absolute_dev_explained, Fisher's exact test and the sign test enumerated by
hand), scikit-learn's roc_auc_score, numpy's corrcoef, and seeded simulations with a known truth.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from kvmem.autointerp.evidence import Example, SideEvidence, WrittenToken
from kvmem.autointerp.judges import TokensJudge
from kvmem.autointerp.scorers import detection, fuzzing, output, simulation
from kvmem.autointerp.scorers.base import Query, Task
from kvmem.autointerp.scorers.intervals import classification_metrics, rank_auc
from kvmem.autointerp.scorers.nulls import (
    _label_orders,
    _swaps,
    classification_null,
    classification_nulls,
    hypergeometric_p,
    record_permutation,
    record_permutations,
    sign_test_p,
    swap_p,
)
from kvmem.autointerp.scorers.protocols import (
    N_NON_ACTIVATING,
    PER_QUANTILE,
    delphi_detection,
    delphi_fuzzing,
    neuron_explainer_records,
)
from kvmem.autointerp.token_rules import Rule


def _task(truth, scorer="detection", protocol="kvmem", undefined=float("nan")):
    return Task(scorer=scorer, queries=tuple(Query(tokens=("x",), index=0) for _ in truth), truth=tuple(truth),
                group=tuple(range(len(truth))), codes=tuple(range(len(truth))), protocol=protocol, undefined=undefined)


def test_classification_metrics_by_hand():
    # 3 positives, 5 negatives; answers: yes on 2 positives and 1 negative
    truth = [True, True, True, False, False, False, False, False]
    answers = [True, True, False, True, False, False, False, False]
    result = detection.evaluate(_task(truth), answers, n_boot=200)
    # TP 2, FN 1, TN 4, FP 1: recall 2/3, TNR 4/5, BA (2/3 + 4/5) / 2; precision 2/3; F1 = 2PR/(P+R) = 2/3
    assert result.score == pytest.approx((2 / 3 + 4 / 5) / 2)
    assert result.metrics["precision"] == pytest.approx(2 / 3) and result.metrics["recall"] == pytest.approx(2 / 3)
    assert result.metrics["f1"] == pytest.approx(2 / 3)
    assert result.metrics["auc"] == pytest.approx(result.score)  # yes / no answers: AUC = balanced accuracy
    assert result.n_quiet == 5 and result.n == 8
    # Fisher's exact test by hand: 8 examples, 3 positive, 3 "yes"; P(TP >= 2) = [C(3,2)C(5,1) + C(3,3)C(5,0)] / C(8,3)
    assert result.p == pytest.approx((3 * 5 + 1) / 56)
    assert hypergeometric_p([2, 1, 4, 1]) == pytest.approx(16 / 56)
    # a judge that never says yes: precision undefined -> NaN (kvmem) or 0 (Delphi's compute_classification_metrics)
    never = [False] * 8
    assert math.isnan(classification_metrics([0, 3, 5, 0])["precision"])
    assert classification_metrics([0, 3, 5, 0], undefined=0.0) == {"precision": 0.0, "recall": 0.0, "f1": 0.0,
                                                                   "balanced_accuracy": 0.5}
    delphi = detection.evaluate(_task(truth, protocol="delphi", undefined=0.0), never, n_boot=50)
    assert delphi.score == 0.5 and delphi.metrics["f1"] == 0.0 and delphi.metrics["precision"] == 0.0


def test_auc_against_scikit_learn_and_by_hand():
    from sklearn.metrics import roc_auc_score

    # positives 0.9, 0.4, 0.4; negatives 0.4, 0.1: pairs won 2 + 1 + 0.5 + 0.5 + 1 + 1 = ... by hand:
    # 0.9 beats both (2); each 0.4 ties 0.4 (0.5) and beats 0.1 (1): 1.5 each -> 5 of 6
    scores, truth = [0.9, 0.4, 0.4, 0.4, 0.1], [True, True, True, False, False]
    assert rank_auc(scores, truth) == pytest.approx(5 / 6)
    rng = np.random.default_rng(0)
    for _ in range(20):
        s, t = rng.integers(0, 5, size=30).astype(float), rng.random(30) < 0.4
        assert rank_auc(s, t) == pytest.approx(roc_auc_score(t, s))
    assert math.isnan(rank_auc([1.0, 2.0], [True, True]))


def test_sign_test_and_fuzzing_swap_null_by_hand():
    assert sign_test_p(3, 3) == pytest.approx(1 / 8) and sign_test_p(0, 0) == 1.0
    assert sign_test_p(2, 3) == pytest.approx(4 / 8)
    # per example (tp, fn, tn, fp): two examples right at both positions, one wrong at both, one answered alike
    sums = np.array([[1, 0, 1, 0], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 1]])
    assert swap_p(sums) == pytest.approx(sign_test_p(2, 3))


def test_simulation_correlation_as_neuron_explainer_scores_it():
    truth = [np.array([0.0, 1.0, 4.0]), np.array([2.0, 0.0, 0.0]), np.array([0.0, 0.0, 3.0])]
    answers = [[0.0, 2.0, 10.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    task = Task(scorer="simulation", queries=tuple(Query(tokens=("a",) * 3, index=-1) for _ in truth),
                truth=tuple(truth), group=(0, 1, 2), codes=(0, 1, 2))
    result = simulation.evaluate(task, answers, n_boot=200)
    y, x = np.concatenate(truth), np.concatenate(answers).astype(float)
    assert result.score == pytest.approx(np.corrcoef(y, x)[0, 1])  # all tokens pooled (ev_correlation_score)
    assert result.metrics["rsquared"] == pytest.approx(1 - np.mean((y - x) ** 2) / np.mean(y ** 2))
    assert result.metrics["absolute_dev_explained"] == pytest.approx(1 - np.mean(np.abs(y - x)) / np.mean(np.abs(y)))
    flat = [[3.0] * 3] * 3  # a constant prediction: 0 in kvmem's protocol, NaN in neuron-explainer's (np.corrcoef)
    assert simulation.evaluate(task, flat, n_boot=50).score == 0.0
    assert simulation.evaluate(task, flat, n_boot=50).p == 1.0
    ne = Task(**{**task.__dict__, "protocol": "neuron-explainer"})
    with np.errstate(invalid="ignore", divide="ignore"):
        assert math.isnan(np.corrcoef(y, np.concatenate(flat))[0, 1])
    assert math.isnan(simulation.evaluate(ne, flat, n_boot=50).score)


def test_record_permutation_moves_records_among_equal_lengths():
    rng = np.random.default_rng(1)
    lengths = [4, 4, 4, 3, 3, 5]
    truth = [rng.normal(size=n) for n in lengths]
    predicted = [rng.integers(0, 2, size=n) * 10.0 for n in lengths]
    observed, null = record_permutation(predicted, truth, n_perm=300, seed=2)
    assert observed == pytest.approx(np.corrcoef(np.concatenate(predicted), np.concatenate(truth))[0, 1])
    # every null value is the pooled r of one re-pairing of records of equal length (enumerated here)
    possible = set()
    for a in itertools.permutations(range(3)):
        for b in itertools.permutations((3, 4)):
            order = list(a) + list(b) + [5]
            r = np.corrcoef(np.concatenate([predicted[j] for j in order]), np.concatenate(truth))[0, 1]
            possible.add(round(float(r), 9))
    assert {round(float(v), 9) for v in null} <= possible and len(set(np.round(null, 9))) > 3


def _null_sides(rng, count):
    """Synthetic detection tasks whose answers are drawn independently of the truth (true balanced accuracy 0.5)."""
    for _ in range(count):
        positives, negatives = int(rng.integers(8, 30)), int(rng.integers(20, 80))
        truth = [True] * positives + [False] * negatives
        rate = rng.uniform(0.02, 0.5)
        yield truth, list(rng.random(positives + negatives) < rate), list(rng.random(positives + negatives) < rate)


def test_detection_intervals_and_p_values_are_calibrated_under_an_exact_null():
    rng = np.random.default_rng(5)
    cover, diff_cover, small_p = [], [], []
    for truth, answers, other in _null_sides(rng, 300):
        task = _task(truth)
        result = detection.evaluate(task, answers, n_boot=300, seed=int(rng.integers(1000)))
        cover.append(result.low <= 0.5 <= result.high)
        small_p.append(result.p < 0.05)
        low, high = detection.paired(task, answers, other, n_boot=300, seed=3)
        diff_cover.append(low <= 0 <= high)
    # nominal 95%; the exact test is conservative (discrete), so p < 0.05 at most about 5% of the time
    assert np.mean(cover) >= 0.93 and np.mean(diff_cover) >= 0.93
    assert np.mean(small_p) <= 0.07


def test_simulation_intervals_cover_chance_under_an_exact_null():
    """Heavy-tailed activations in few records, sparse 0/10 predictions independent of them: the percentile
    bootstrap alone covers 0 too rarely; the interval with the record-permutation null does not."""
    rng = np.random.default_rng(7)
    cover, small_p = [], []
    for _ in range(200):
        records = int(rng.integers(12, 30))
        truth = [rng.pareto(1.5, size=17) * (5 if k < 6 else 1) for k in range(records)]
        answers = [np.where(rng.random(17) < 0.1, 10.0, 0.0) for _ in range(records)]
        task = Task(scorer="simulation", queries=tuple(Query(tokens=("a",) * 17, index=-1) for _ in truth),
                    truth=tuple(truth), group=tuple(range(records)), codes=tuple(range(records)))
        result = simulation.evaluate(task, answers, n_boot=300, seed=int(rng.integers(1000)))
        cover.append(result.low <= 0 <= result.high)
        small_p.append(result.p < 0.05)
    assert np.mean(cover) >= 0.93 and np.mean(small_p) <= 0.08


def test_classification_null_keeps_the_class_sizes():
    truth = [True, True, False, False, False]
    null = classification_null(truth, range(5), [[True, True, False, False, False]], swap=False, n_perm=500, seed=0)
    # 2 positives, 2 "yes": TP ~ hypergeometric(5, 2, 2); by hand, TP 2 -> (1 + 1) / 2 = 1,
    # TP 1 -> (1/2 + 2/3) / 2 = 7/12, TP 0 -> (0 + 1/3) / 2 = 1/6
    assert set(np.round(null[0], 9)) <= {1.0, round(7 / 12, 9), round(1 / 6, 9)}
    assert abs((null[0] == 1.0).mean() - 1 / 10) < 0.04  # C(2,2) / C(5,2)
    pairs = [True, False] * 3
    swapped = classification_null(pairs, [0, 0, 1, 1, 2, 2], [pairs], swap=True, n_perm=400, seed=1)
    assert set(np.round(swapped[0], 9)) <= {0.0, round(1 / 3, 9), round(2 / 3, 9), 1.0}


def test_many_record_permutations_equal_one_at_a_time():
    rng = np.random.default_rng(5)
    lengths = [4, 7, 7, 4, 7, 1]
    n = sum(lengths)
    predicted = np.where(rng.random((6, n)) < 0.3, 10.0, 0.0)
    truth = rng.gamma(0.5, size=(6, n)) * rng.choice([-1.0, 1.0], size=(6, n))
    predicted[1] = 0.0  # a constant prediction: 0 and a null of zeros
    truth[2] = 1.5  # a constant truth: NaN
    predicted[3], truth[3] = 10.0, 0.0  # both constant: NaN, as the one-at-a-time version checks the truth first
    observed, nulls = record_permutations(predicted, truth, lengths, n_perm=200, seed=9)
    cuts = np.cumsum([0] + lengths)
    for e in range(6):
        records = [predicted[e][a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        truths = [truth[e][a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        one, null = record_permutation(records, truths, n_perm=200, seed=9)
        np.testing.assert_array_equal([observed[e]], [one])
        np.testing.assert_array_equal(nulls[e], null)
    assert np.isnan(observed[[2, 3]]).all() and observed[1] == 0.0 and np.isfinite(observed[[0, 4, 5]]).all()


@pytest.mark.parametrize("queries", [6, 40, 62])  # the one-hot product up to 48 queries, a gather beyond
@pytest.mark.parametrize("swap", [False, True])
def test_many_sides_nulls_equal_a_loop_over_their_draws(queries, swap):
    rng = np.random.default_rng(queries)
    truth = rng.random((5, queries)) < 0.4
    truth[:, :2] = [True, False]  # both classes in every row
    if swap:  # fuzzing: each example asked twice, once where it fires and once where it does not
        queries -= queries % 2
        truth = np.repeat(rng.random((5, queries // 2)) < 0.5, 2, axis=1)
        truth[:, 1::2] = ~truth[:, ::2]
    answers = rng.random((5, queries)) < 0.5
    group = np.repeat(np.arange(queries // 2), 2) if swap else np.arange(queries)
    many = classification_nulls(truth, answers, group, swap=swap, n_perm=300, seed=4)
    draws = _swaps(int(group.max()) + 1, 300, 4) if swap else _label_orders(queries, 300, 4)
    for r in range(5):
        np.testing.assert_array_equal(many[r], classification_null(truth[r], group, [answers[r]], swap=swap,
                                                                   n_perm=300, seed=4)[0])
        positives, negatives = truth[r].sum(), (~truth[r]).sum()
        for p in range(0, 300, 37):  # balanced accuracy against the re-paired labels, counted one query at a time
            labels = [truth[r][q] ^ draws[p][group[q]] for q in range(queries)] if swap else \
                [truth[r][draws[p][q]] for q in range(queries)]
            tp = sum(1 for q in range(queries) if labels[q] and answers[r][q])
            tn = sum(1 for q in range(queries) if not labels[q] and not answers[r][q])
            assert many[r][p] == (tp / positives + tn / negatives) / 2


def _side(examples, *, held_writes=(), held_opposes=(), threshold=1.0):
    return SideEvidence(layer=0, neuron=0, side="positive", examples=tuple(examples), writes=(), opposes=(),
                        threshold=threshold, convention="raw", held_writes=held_writes, held_opposes=held_opposes)


def test_output_scorer_by_hand():
    side = _side([], held_writes=(WrittenToken(5, " count", 1), WrittenToken(6, "Counts", 3), WrittenToken(7, " x", 4)),
                 held_opposes=(WrittenToken(8, " the", 0), WrittenToken(9, " count", 2)))
    task = output.build(side)
    assert [q.tokens[0] for q in task.queries] == [" count", "Counts", " x", " the", " count"]
    assert task.truth == (True, True, True, False, False)
    rule = type("E", (), {"rule": Rule(kind="current_token", tokens=(), writes=("count", "counts")).to_json()})
    answers = TokensJudge().answer([(rule, "output", q) for q in task.queries])
    # yes for ' count', 'Counts' and the opposed ' count' (same normalised form): TPR 2/3, TNR 1/2
    assert answers == [True, True, False, False, True]
    result = output.evaluate(task, answers, n_boot=100)
    assert result.score == pytest.approx((2 / 3 + 1 / 2) / 2) and task.codes == (5, 6, 7, 8, 9)


def _window(code, values, band="random", index=12):
    tokens = tuple(f"t{code}_{i}" for i in range(len(values)))
    return Example(code, band, tokens, index, float(values[index]), tuple(values), max(values) >= 1.0, True)


def test_delphi_protocol_windows_deciles_and_negatives():
    rng = np.random.default_rng(3)
    examples = [Example(10_000 + k, "q0.99", ("a",), 0, 2.0 + k / 10, None, True, False) for k in range(3)]
    for code in range(200):  # activating windows (a token >= 2.0, the lowest q0.99 sample) and quiet ones
        values = rng.random(17) * 1.5
        if code % 3 == 0:
            values[int(rng.integers(17))] = 2.0 + rng.random() * 8
        examples.append(_window(code, values, band="top" if code % 6 == 0 else "random"))
    side = _side(examples)
    task = delphi_detection(side, seed=0)
    positives = [c for c, t in zip(task.codes, task.truth) if t]
    negatives = [c for c, t in zip(task.codes, task.truth) if not t]
    by_code = {e.code: e for e in examples}
    assert all(max(by_code[c].activations) >= 2.0 for c in positives)
    assert all(max(by_code[c].activations) < 2.0 for c in negatives) and len(negatives) == N_NON_ACTIVATING
    active = sorted((e for e in examples if e.activations is not None and max(e.activations) >= 2.0),
                    key=lambda e: -max(e.activations))
    size = len(active) // 10
    for q in range(10):  # at most 5 from each decile of the activating windows sorted by their maximum
        decile = {e.code for e in active[q * size:(q + 1) * size]}
        assert len(decile & set(positives)) == min(PER_QUANTILE, len(decile))
    assert all(q.whole for q in task.queries) and task.undefined == 0.0
    fuzz = delphi_fuzzing(side, seed=0)
    marked = [q.highlights for q, t in zip(fuzz.queries, fuzz.truth) if t]
    for code, highlights in zip(positives, marked):  # every token at or above 0.3 of the window's maximum
        values = by_code[code].activations
        assert highlights == tuple(i for i, v in enumerate(values) if v >= 0.3 * max(values))
    wrong = [q.highlights for q, t in zip(fuzz.queries, fuzz.truth) if not t]
    assert {len(h) for h in wrong} == {math.ceil(np.mean([len(h) for h in marked]))}


def test_neuron_explainer_records_one_to_one():
    examples = [_window(c, np.full(17, 0.1), band="top") for c in range(7)] + \
        [_window(100 + c, np.full(17, 0.1)) for c in range(30)]
    task = neuron_explainer_records(_side(examples), per_band=5)
    bands = [("top" if c < 100 else "random") for c in task.codes]
    assert bands.count("top") == bands.count("random") == 5 and task.protocol == "neuron-explainer"


def test_fuzzing_and_detection_tokens_judge_on_windows():
    rule = type("E", (), {"rule": Rule(kind="current_token", tokens=("cat",)).to_json()})
    tokens = ("the", " cat", " sat", " cat")
    answers = TokensJudge().answer([(rule, "detection", Query(tokens=tokens, index=-1, whole=True)),
                                    (rule, "detection", Query(tokens=("a", "b"), index=-1, whole=True)),
                                    (rule, "fuzzing", Query(tokens=tokens, index=-1, highlights=(1, 3))),
                                    (rule, "fuzzing", Query(tokens=tokens, index=-1, highlights=(0, 2, 3)))])
    assert answers == [True, False, True, False]
    assert fuzzing.NAME == "fuzzing"
