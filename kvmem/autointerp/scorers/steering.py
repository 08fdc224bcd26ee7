"""The ``intervention`` scorer, by steering: switch the memory on, generate, and ask whether the change follows
the explanation.

Delphi's intervention scoring (Paulo et al. 2024, arXiv 2410.13928) judges an explanation by the effect
of steering a latent on what the model writes. Here, for each of ``PROMPTS`` held-out contexts of the
side (the layer's random samples, cut after their kept token, by code), the scanned model continues the
text greedily for ``NEW_TOKENS`` tokens twice: as it is, and with the neuron's coefficient set to the
side's strongest kept activation (``sign * a_max``, the largest side activation among its triggers) at
every position (:func:`kvmem.intervention.intervene`). The judge sees the explanation and both
continuations in a seeded order and names the steered one. Score: the share it names right, a tie
(the judge cannot decide, or both continuations are the same) counting one half; chance 0.5; p: a sign
test over the decided pairs; the bootstrap resamples prompts.
"""

from __future__ import annotations

import numpy as np

from kvmem.autointerp.scorers.base import DEFAULT_PROTOCOL, PER_BAND, Query, Score, Task
from kvmem.autointerp.scorers.intervals import N_BOOT, bootstrap, group_sums, paired_bootstrap
from kvmem.autointerp.scorers.nulls import sign_test_p
from kvmem.autointerp.splits import splitmix64
from kvmem.experiments.signed_memories import SIDES

__all__ = ["build", "evaluate", "paired", "NAME", "ANSWER", "ASPECT", "NEEDS", "PROMPTS", "NEW_TOKENS"]

NAME = "intervention"
ANSWER = "choice"
ASPECT = "output"
NEEDS = "model"
PROMPTS = 8
NEW_TOKENS = 8


def _pieces(model, text: str) -> tuple[str, ...]:
    return tuple(model.tokenizer.decode([i]) for i in model.encode(text)) if text else ()


def build(side, *, per_band: int = PER_BAND, seed: int = 0, max_quiet: int | None = None,
          protocol: str = DEFAULT_PROTOCOL, model=None) -> Task:
    """Continuations of up to ``PROMPTS`` held-out contexts without and with the memory set; ``codes``: the
    contexts' position codes; truth: which option (0 or 1) is the steered one, -1 when both are the same."""
    from kvmem.intervention import greedy_continuation, intervene

    held = sorted((e for e in side.part(held_out=True) if e.band == "random"), key=lambda e: e.code)[:PROMPTS]
    strongest = max((e.activation for e in side.examples if e.band == "top"), default=0.0)
    value = SIDES[side.side][2] * strongest  # the coefficient m_i whose side activation is the strongest kept one
    queries, truth, codes = [], [], []
    for e in held:
        prompt = "".join(e.tokens[:e.index + 1])
        clean = greedy_continuation(model, prompt, max_new_tokens=NEW_TOKENS, prepend_bos=True)
        with intervene(model, {(side.layer, side.neuron): value}):
            steered = greedy_continuation(model, prompt, max_new_tokens=NEW_TOKENS, prepend_bos=True)
        swap = int(splitmix64(np.uint64(e.code) ^ splitmix64(np.uint64(seed + 2))) % np.uint64(2))
        options = (_pieces(model, clean), _pieces(model, steered))
        queries.append(Query(tokens=e.tokens[:e.index + 1], index=-1, options=options[::-1] if swap else options))
        truth.append(-1 if clean == steered else 1 - swap)
        codes.append(e.code)
    return Task(scorer=NAME, queries=tuple(queries), truth=tuple(truth), group=tuple(range(len(queries))),
                codes=tuple(codes), protocol=protocol)


def _credit(task: Task, answers) -> np.ndarray:
    """[G, 2] per prompt: credit (1 right, 0 wrong, 1/2 a tie), 1."""
    credit = [0.5 if a is None or t < 0 else float(a == t) for a, t in zip(answers, task.truth)]
    return group_sums(task.group, [credit, np.ones(len(credit))]) if credit else np.zeros((0, 2))


def _share(sums) -> np.ndarray:
    sums = np.asarray(sums, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums[..., 0] / sums[..., 1]


def evaluate(task: Task, answers, *, seed: int = 0, n_boot: int = N_BOOT, judge: str = "", scores=None) -> Score:
    sums = _credit(task, answers)
    if not len(sums):
        return Score(scorer=NAME, score=float("nan"), low=float("nan"), high=float("nan"), n=0, judge=judge,
                     protocol=task.protocol)
    low, high = bootstrap(_share, sums, n_boot=n_boot, seed=seed)
    decided = [(a, t) for a, t in zip(answers, task.truth) if a is not None and t >= 0]
    right = sum(a == t for a, t in decided)
    changed = sum(t >= 0 for t in task.truth)
    return Score(scorer=NAME, score=float(_share(sums.sum(axis=0))), low=low, high=high, n=len(task.codes),
                 judge=judge, codes=task.codes, p=sign_test_p(right, len(decided)),
                 metrics={"decided": float(len(decided)), "changed": float(changed)}, protocol=task.protocol)


def paired(task: Task, answers, base_answers, *, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float]:
    return paired_bootstrap(_share, _credit(task, answers), _credit(task, base_answers), n_boot=n_boot, seed=seed)
