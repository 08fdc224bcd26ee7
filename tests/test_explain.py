"""The tokens explainer and every scorer against answers worked out by hand on synthetic activations."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.autointerp.evidence import Example, SideEvidence
from kvmem.autointerp.explainers.tokens import TokensExplainer, fit_rule
from kvmem.autointerp.judges import TokensJudge
from kvmem.autointerp.scorers import SCORERS, detection, fuzzing, get_scorers, simulation
from kvmem.autointerp.scorers.intervals import (
    balanced_accuracy,
    balanced_accuracy_from,
    bootstrap,
    confusion_sums,
    moment_sums,
    pearson,
    pearson_from,
)
from kvmem.autointerp.splits import held_out_mask
from kvmem.autointerp.token_rules import Rule, normalize
from kvmem.errors import KvmemError

WORDS = [" the", " a", " cat", " dog", " sat", " on", " mat", " ran", " to", " and", " fish", " bird"]


def _side(neuron: int, word: str, *, seed: int = 0, n_top: int = 40, n_random: int = 200, length: int = 9):
    """A neuron side that fires (side activation 5) exactly on ``word`` and is 0 elsewhere: top triggers kept at
    ``word``, a uniform random sample of positions, bin samples of the q0.9 band at ``word``."""
    rng = np.random.default_rng(seed + 1000 * neuron)
    examples, code = [], neuron << 20
    for band, count in (("top", n_top), ("q0.9", n_top // 2), ("random", n_random)):
        for _ in range(count):
            tokens = [WORDS[i] for i in rng.integers(0, len(WORDS), size=length)]
            index = int(rng.integers(0, length))
            if band != "random":
                tokens[index] = word
            values = [5.0 if t == word else 0.0 for t in tokens]
            code += 1
            examples.append(dict(code=code, band=band, tokens=tuple(tokens), index=index, activation=values[index],
                                 activations=None if band == "q0.9" else tuple(values), active=values[index] >= 5))
    held = held_out_mask([e["code"] for e in examples], seed=seed, window=1)
    return SideEvidence(layer=0, neuron=neuron, side="positive",
                        examples=tuple(Example(**e, held_out=bool(h)) for e, h in zip(examples, held)),
                        writes=(" meow",), opposes=(), threshold=5.0, convention="raw")


def _score(module, side, rule_json):
    task = module.build(side)
    expl = type("E", (), {"rule": rule_json, "text": "", "layer": side.layer, "neuron": side.neuron, "side": side.side})
    answers = TokensJudge().answer([(expl, module.NAME, q) for q in task.queries])
    return task, module.evaluate(task, answers, seed=1, n_boot=400)


def test_split_is_seeded_hash_of_the_read_window_and_about_half():
    codes = np.arange(20000, dtype=np.int64) * 7919
    mask = held_out_mask(codes, seed=3, window=1)
    assert abs(mask.mean() - 0.5) < 0.02
    assert (held_out_mask(codes, seed=3, window=1) == mask).all() and (held_out_mask(codes, seed=4, window=1) != mask).any()
    assert held_out_mask(codes[::-1], seed=3, window=1)[::-1].tolist() == mask.tolist()  # per code, not per order
    # with 32-token windows: every position of a window (doc, pos // 32) in one set, about half of the windows held
    docs, pos = np.repeat(np.arange(200), 320), np.tile(np.arange(320), 200)
    codes = (docs.astype(np.int64) << 32) | pos
    mask = held_out_mask(codes, seed=3, window=32).reshape(200, 10, 32)
    assert (mask == mask[:, :, :1]).all()
    assert 0.45 < mask[:, :, 0].mean() < 0.55 and mask[:, :, 0].any(axis=1).all() and not mask[:, :, 0].all()
    with pytest.raises(KvmemError, match="held-out fraction"):
        held_out_mask(codes, held_out=1.5, window=32)
    with pytest.raises(KvmemError, match="split window must be an integer >= 1"):
        held_out_mask(codes, window=0)


def test_fit_rule_by_hand():
    # 4 activating examples: current tokens cat, cat, Cat, dog; 4 non-activating: the, dog, a, the.
    active = [(("x", " cat"), 1), (("y", " cat"), 1), (("z", "Cat "), 1), (("w", " dog"), 1)]
    inactive = [(("x", " the"), 1), (("y", " dog"), 1), (("z", " a"), 1), (("q", " the"), 1)]
    rule, score = fit_rule(active, inactive, min_support=2)
    # current token: gains cat 3/4, dog 1/4 - 1/4 = 0 (dropped); BA = 0.5 + 0.75 / 2 = 0.875.
    # previous token (x, y, z, w vs x, y, z, q): gains 1/4 - 1/4 = 0 each except w (1/4, support 1) -> 0.625.
    assert rule == Rule(kind="current_token", tokens=("cat",))
    assert score == pytest.approx(0.875)
    assert rule.fires(("a", " CAT"), 1) and not rule.fires(("a", " dog"), 1)
    assert Rule.from_json(rule.to_json()) == rule
    assert normalize("\n") == "\n" and normalize(" The ") == "the"


def test_previous_token_and_bigram_rules_by_hand():
    # active: "new york" twice; inactive: "new jersey", "old york".
    # current token york: 2/2 - 1/2 -> BA 0.75; previous token new: 2/2 - 1/2 -> 0.75; bigram (new, york): 1.0
    active = [((" New", " York"), 1), (("new", "york"), 1)]
    inactive = [((" new", " jersey"), 1), ((" old", " york"), 1)]
    rule, score = fit_rule(active, inactive)
    assert rule == Rule(kind="bigram", tokens=(("new", "york"),)) and score == 1.0
    assert rule.text == 'the last two tokens are "new" "york" (ignoring case and surrounding spaces)'
    active = [(("of", "x"), 1), (("of", "y"), 1), (("of", "z"), 1)]
    inactive = [(("to", "x"), 1), (("in", "y"), 1), (("at", "z"), 1)]
    rule, score = fit_rule(active, inactive)
    assert rule == Rule(kind="previous_token", tokens=("of",)) and score == 1.0
    assert not rule.fires(("of",), 0)  # no previous token at the start


def test_tokens_explainer_finds_the_one_token():
    side = _side(0, " cat")
    [e] = TokensExplainer().explain([side])
    assert Rule.from_json(e.rule) == Rule(kind="current_token", tokens=("cat",), writes=("meow",))
    assert e.explain_score == 1.0 and "'cat'" not in e.text and '"cat"' in e.text and "' meow'" in e.text
    held = {x.code for x in side.examples if x.held_out}
    assert e.explain_codes and not held & set(e.explain_codes)  # the explainer never saw a held-out example


def test_one_token_neuron_scores_one_and_its_derangement_about_half():
    sides = [_side(n, w) for n, w in enumerate(WORDS[2:8])]
    rules = [TokensExplainer().explain_side(s).rule for s in sides]
    for module in (detection, fuzzing, simulation):
        for s, r in zip(sides, rules):
            task, result = _score(module, s, r)
            # the bootstrap alone says [1, 1]; the interval also holds what a shifted permutation null keeps (with
            # ~20 examples a perfect score cannot rule out a true score a little below 1, as a Wilson interval says)
            assert result.score == pytest.approx(1.0) and result.high == pytest.approx(1.0, abs=1e-5)
            assert 0.8 < result.low < 1.0
            assert result.p <= 1 / 401 + 1e-12  # a perfect explanation beats every permutation (n_boot 400)
            assert result.n >= 10 and not set(task.codes) - {x.code for x in s.examples if x.held_out}
    # derangement: neuron i judged with neuron i+1's rule (another token)
    baseline = [_score(detection, s, rules[(i + 1) % len(rules)])[1].score for i, s in enumerate(sides)]
    # active examples end with the own token: never predicted (TPR 0); non-activating random positions end with
    # the other neuron's token with probability about 1/12 (false positives): BA = (0 + 11/12) / 2 ~ 0.46
    assert all(0.38 <= b <= 0.55 for b in baseline), baseline
    fuzz = [_score(fuzzing, s, rules[(i + 1) % len(rules)])[1].score for i, s in enumerate(sides)]
    assert all(0.35 <= b <= 0.6 for b in fuzz), fuzz


def test_detection_task_by_hand():
    side = _side(0, " cat")
    task = detection.build(side)
    held = [x for x in side.examples if x.held_out]
    active = [x for x in held if x.active]
    expected_active = min(10, sum(x.band == "top" for x in active)) + min(10, sum(x.band == "q0.9" for x in active)) \
        + min(10, sum(x.band == "random" for x in active))
    assert sum(task.truth) == expected_active
    assert len(task.truth) - sum(task.truth) == sum(x.band == "random" and not x.active for x in held)
    by_code = {x.code: x for x in held}
    assert all(q.tokens == by_code[c].tokens[:by_code[c].index + 1] for q, c in zip(task.queries, task.codes))
    assert all(len(q.tokens) == q.index + 1 for q in task.queries)  # shown up to the kept token


def test_statistics_against_numpy_and_by_hand():
    predicted, truth = [1, 1, 0, 0, 1], [1, 0, 0, 0, 1]
    assert balanced_accuracy(predicted, truth) == pytest.approx((1 + 2 / 3) / 2)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50)
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert pearson(np.ones(5), np.arange(5.0)) == 0.0  # a constant prediction says nothing
    w = rng.integers(0, 3, size=50).astype(float)
    xr, yr = np.repeat(x, w.astype(int)), np.repeat(y, w.astype(int))
    assert pearson(x, y, w) == pytest.approx(np.corrcoef(xr, yr)[0, 1])
    sums = moment_sums(x + y, y, np.arange(50))
    assert pearson_from(sums.sum(axis=0)) == pytest.approx(np.corrcoef(x + y, y)[0, 1])
    low, high = bootstrap(pearson_from, sums, n_boot=500, seed=0)
    assert low < pearson(x + y, y) < high and high - low < 0.5
    # a replicate is a resample of whole groups: the group sums of a record of 3 tokens move together
    groups = np.repeat(np.arange(10), 3)
    conf = confusion_sums([1, 0, 1] * 10, [1, 1, 0] * 10, groups)
    assert conf.tolist() == [[1, 1, 0, 1]] * 10 and balanced_accuracy_from(conf.sum(axis=0)) == 0.25
    assert bootstrap(balanced_accuracy_from, conf, n_boot=200) == (0.25, 0.25)  # every replicate is the same


def test_simulation_by_hand():
    side = _side(0, " cat", n_top=6, n_random=10, length=4)
    task = simulation.build(side)
    truth = np.concatenate(task.truth)
    answers = [[1.0 if v > 0 else 0.0 for v in t] for t in task.truth]
    assert simulation.evaluate(task, answers).score == pytest.approx(1.0)
    flipped = [[0.0 if v > 0 else 1.0 for v in t] for t in task.truth]
    assert simulation.evaluate(task, flipped).score == pytest.approx(-1.0)
    assert len(truth) == 4 * len(task.queries)


def test_registry_and_errors():
    assert list(SCORERS) == ["detection", "fuzzing", "simulation", "output", "intervention", "embedding"]
    assert [m.NAME for m in get_scorers("simulation,detection")] == ["simulation", "detection"]
    with pytest.raises(KvmemError, match="unknown scorer.*choose from detection, fuzzing, simulation, output"):
        get_scorers("detect")
    expl = type("E", (), {"rule": "", "text": "cats", "layer": 1, "neuron": 2, "side": "positive"})
    with pytest.raises(KvmemError, match="L1/2 positive has no rule"):
        TokensJudge().answer([(expl, "detection", detection.build(_side(0, " cat")).queries[0])])
