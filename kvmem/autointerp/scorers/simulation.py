"""Simulation (OpenAI neuron-explainer): predict 0-10 per token, correlate with the true coefficients.

Held-out records with stored context coefficients: the side's triggers (band ``top``, at most 10)
and the random samples (at most 20), as neuron-explainer's "top and random" set. The judge predicts an activation from
0 to 10 for every token of each context (parsed from its answer; no logprobs); the score is the
Pearson correlation of predictions and true side activations pooled over all tokens of all records
(neuron-explainer's all-at-once correlation). A constant prediction scores 0. The bootstrap
resamples records with all their tokens.
"""

from __future__ import annotations

import numpy as np

from kvmem.autointerp.scorers.base import PER_BAND, Query, Score, Task
from kvmem.autointerp.scorers.statistics import N_BOOT, bootstrap, moment_sums, pearson_from

__all__ = ["build", "evaluate", "NAME", "ANSWER", "MAX_TOP", "MAX_RANDOM"]

NAME = "simulation"
ANSWER = "values"
MAX_TOP = 10
MAX_RANDOM = 20


def build(side, *, per_band: int = PER_BAND, seed: int = 0, max_quiet: int | None = None) -> Task:
    """At most ``min(per_band, MAX_TOP)`` top records and ``min(max_quiet, MAX_RANDOM)`` random ones, by code."""
    held = sorted((e for e in side.part(held_out=True) if e.activations is not None), key=lambda e: e.code)
    top, random = min(per_band, MAX_TOP), MAX_RANDOM if max_quiet is None else min(max_quiet, MAX_RANDOM)
    chosen = [e for e in held if e.band == "top"][:top] + [e for e in held if e.band == "random"][:random]
    return Task(scorer=NAME, queries=tuple(Query(tokens=e.tokens, index=-1) for e in chosen),
                truth=tuple(np.asarray(e.activations, np.float64) for e in chosen),
                group=tuple(range(len(chosen))), codes=tuple(e.code for e in chosen))


def evaluate(task: Task, answers, *, seed: int = 0, n_boot: int = N_BOOT, judge: str = "") -> Score:
    if not task.queries:
        return Score(scorer=NAME, score=float("nan"), low=float("nan"), high=float("nan"), n=0, judge=judge)
    predicted = np.concatenate([np.asarray(a, np.float64) for a in answers])
    truth = np.concatenate(task.truth)
    tokens_of = np.repeat(np.asarray(task.group), [len(t) for t in task.truth])
    sums = moment_sums(predicted, truth, tokens_of)  # [records, 6]
    score = float(pearson_from(sums.sum(axis=0)))
    low, high = bootstrap(pearson_from, sums, n_boot=n_boot, seed=seed)
    return Score(scorer=NAME, score=score, low=low, high=high, n=len(task.codes), judge=judge, codes=task.codes)
