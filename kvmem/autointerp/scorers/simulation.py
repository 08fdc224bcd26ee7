"""Simulation (OpenAI's neuron-explainer): predict 0-10 per token, correlate with the true coefficients.

kvmem's protocol: held-out records with stored context coefficients: the side's triggers (band
``top``, at most 10) and the layer's random samples (at most 20). The judge predicts an activation
from 0 to 10 for every token of each context (parsed from its answer; no logprobs); the score is the
Pearson correlation of predictions and true side activations pooled over all tokens of all records
(neuron-explainer's all-at-once correlation). A constant prediction scores 0 (it says nothing).
The p-value comes from the side's record-permutation null
(:func:`kvmem.autointerp.scorers.nulls.record_permutation`); the interval is the hull of a bootstrap over
records and that null's shift interval (a percentile bootstrap alone over ~30 records of heavy-tailed
activations covers chance too rarely: benchmarks/score_calibration.py).

``protocol="neuron-explainer"`` builds its records 1:1 and scores NaN where the correlation is undefined
(:mod:`kvmem.autointerp.scorers.protocols`). ``metrics`` carry neuron-explainer's ``rsquared`` and
``absolute_dev_explained`` of the raw predictions.
"""

from __future__ import annotations

import numpy as np

from kvmem.autointerp.scorers.base import DEFAULT_PROTOCOL, PER_BAND, Query, Score, Task
from kvmem.autointerp.scorers.intervals import N_BOOT, bootstrap, moment_sums, paired_bootstrap, pearson_from
from kvmem.autointerp.scorers.nulls import hull, permutation_p, record_permutation, shifted_interval
from kvmem.autointerp.scorers.protocols import neuron_explainer_records

__all__ = ["build", "evaluate", "paired", "NAME", "ANSWER", "ASPECT", "MAX_TOP", "MAX_RANDOM"]

NAME = "simulation"
ANSWER = "values"
ASPECT = "input"
MAX_TOP = 10
MAX_RANDOM = 20


def build(side, *, per_band: int = PER_BAND, seed: int = 0, max_quiet: int | None = None,
          protocol: str = DEFAULT_PROTOCOL) -> Task:
    """At most ``min(per_band, MAX_TOP)`` top records and ``min(max_quiet, MAX_RANDOM)`` random ones, by code."""
    if protocol == "neuron-explainer":
        return neuron_explainer_records(side, per_band=per_band)
    held = sorted((e for e in side.part(held_out=True) if e.activations is not None), key=lambda e: e.code)
    top, random = min(per_band, MAX_TOP), MAX_RANDOM if max_quiet is None else min(max_quiet, MAX_RANDOM)
    chosen = [e for e in held if e.band == "top"][:top] + [e for e in held if e.band == "random"][:random]
    return Task(scorer=NAME, queries=tuple(Query(tokens=e.tokens, index=-1) for e in chosen),
                truth=tuple(np.asarray(e.activations, np.float64) for e in chosen),
                group=tuple(range(len(chosen))), codes=tuple(e.code for e in chosen))


def evaluate(task: Task, answers, *, seed: int = 0, n_boot: int = N_BOOT, judge: str = "", scores=None) -> Score:
    if not task.queries:
        return Score(scorer=NAME, score=float("nan"), low=float("nan"), high=float("nan"), n=0, judge=judge,
                     protocol=task.protocol)
    records = [np.asarray(a, np.float64) for a in answers]
    predicted, truth = np.concatenate(records), np.concatenate(task.truth)
    tokens_of = np.repeat(np.asarray(task.group), [len(t) for t in task.truth])
    sums = moment_sums(predicted, truth, tokens_of)
    score = float(pearson_from(sums.sum(axis=0)))
    observed, null = record_permutation(records, task.truth, n_perm=n_boot, seed=seed)
    low, high = hull(bootstrap(pearson_from, sums, n_boot=n_boot, seed=seed),
                     shifted_interval(score, null, chance=0.0, fisher=True), bounds=(-1.0, 1.0))
    p = permutation_p(observed, null)
    with np.errstate(invalid="ignore", divide="ignore"):
        metrics = {"rsquared": float(1 - np.mean((truth - predicted) ** 2) / np.mean(truth ** 2)),
                   "absolute_dev_explained": float(1 - np.mean(np.abs(truth - predicted)) / np.mean(np.abs(truth)))}
    if task.protocol == "neuron-explainer" and np.ptp(predicted) == 0:
        score = low = high = p = float("nan")  # np.corrcoef of a constant prediction, as neuron-explainer scores it
    return Score(scorer=NAME, score=score, low=low, high=high, n=len(task.codes), judge=judge, codes=task.codes, p=p,
                 metrics=metrics, protocol=task.protocol)


def paired(task: Task, answers, base_answers, *, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float]:
    """Interval of r minus the baseline's r on the same records: the hull of the paired bootstrap and the shift
    interval of the difference's null (both predictions moved by the same record permutations)."""
    if not task.queries:
        return float("nan"), float("nan")
    own_records = [np.asarray(a, np.float64) for a in answers]
    base_records = [np.asarray(a, np.float64) for a in base_answers]
    own, null_own = record_permutation(own_records, task.truth, n_perm=n_boot, seed=seed)
    base, null_base = record_permutation(base_records, task.truth, n_perm=n_boot, seed=seed)
    truth = np.concatenate(task.truth)
    tokens_of = np.repeat(np.asarray(task.group), [len(t) for t in task.truth])
    boot = paired_bootstrap(pearson_from, moment_sums(np.concatenate(own_records), truth, tokens_of),
                            moment_sums(np.concatenate(base_records), truth, tokens_of), n_boot=n_boot, seed=seed)
    return hull(boot, shifted_interval(own - base, null_own - null_base, chance=0.0), bounds=(-2.0, 2.0))
