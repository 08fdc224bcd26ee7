"""What every scorer shares: the task it builds from held-out examples, and its result.

A scorer turns a side's held-out examples into a :class:`Task` (queries a judge answers, the truth,
and the example each query belongs to), then turns the judge's answers into a :class:`Score`
with an interval and a p-value from a null built for that side (:mod:`kvmem.autointerp.scorers.nulls`).
Queries are plain data, so one judge call can answer the tasks of many neurons at once
(concurrently for LLM judges).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvmem.autointerp.scorers.intervals import (
    balanced_accuracy_from,
    bootstrap,
    classification_metrics,
    confusion_sums,
    paired_bootstrap,
    rank_auc,
)
from kvmem.autointerp.scorers.nulls import classification_null, hull, label_permutation_p, shifted_interval

__all__ = ["Query", "Task", "Score", "select_active", "classify", "summarise", "paired_classification", "PER_BAND",
           "PROTOCOLS", "DEFAULT_PROTOCOL"]

PER_BAND = 10  # activating examples per band, as Delphi's 10 per decile
# how examples are built and metrics computed: kvmem's own, or as the anchor projects' code does (docs/explanations.md)
PROTOCOLS = ("kvmem", "delphi", "neuron-explainer")
DEFAULT_PROTOCOL = "kvmem"


@dataclass(frozen=True, kw_only=True)
class Query:
    """tokens: [T] the context shown;  index: the token asked about (detection: the last token shown;
    fuzzing: the highlighted token; simulation: -1, every token);  highlights: tokens highlighted (Delphi's
    fuzzing: every one of them);  whole: the judge answers about the whole text (Delphi's detection);
    options: for a choice between texts (intervention), the texts."""

    tokens: tuple[str, ...]
    index: int
    highlights: tuple[int, ...] = ()
    whole: bool = False
    options: tuple = ()


@dataclass(frozen=True, kw_only=True)
class Task:
    """queries [Q]; truth [Q] (bool, or a [T] float array per query for simulation); group [Q]: the example
    each query came from (the bootstrap resamples examples); codes: their position codes (output: token ids);
    protocol: how the task was built; undefined: the value of a metric without a denominator (NaN, Delphi 0)."""

    scorer: str
    queries: tuple[Query, ...]
    truth: tuple
    group: tuple[int, ...]
    codes: tuple[int, ...]
    protocol: str = DEFAULT_PROTOCOL
    undefined: float = float("nan")


@dataclass(frozen=True, kw_only=True)
class Score:
    """score with its 95% interval (low, high); n: examples; judge: who answered; codes: held-out examples used;
    p: one-sided p-value under the side's permutation null; n_quiet: non-activating examples (-1: not counted);
    metrics: other numbers of the protocol (f1, auc, ...); protocol: how the task was built."""

    scorer: str
    score: float
    low: float
    high: float
    n: int
    judge: str = ""
    codes: tuple[int, ...] = field(default=())
    p: float = float("nan")
    n_quiet: int = -1
    metrics: dict = field(default_factory=dict)
    protocol: str = DEFAULT_PROTOCOL


def select_active(examples, per_band: int = PER_BAND) -> list:
    """Held-out activating examples, at most ``per_band`` from each band (top, q0.999, q0.99, q0.9, random),
    in code order (the split's hash already made the held-out set a seeded sample)."""
    by_band: dict[str, list] = {}
    for e in sorted(examples, key=lambda e: e.code):
        if e.active:
            by_band.setdefault(e.band, []).append(e)
    return [e for band in by_band.values() for e in band[:per_band]]


def summarise(name: str, task: Task, answers, *, p_value=label_permutation_p, scores=None) -> tuple:
    """(per-example confusion sums [G, 4], score, p, metrics, n_quiet) of a classification scorer's answers:
    balanced accuracy over the queries, ``p_value(per-example sums)``, precision / recall / F1 and the AUC of
    ``scores`` (the judge's confidence; its answers when it gives none: then AUC = balanced accuracy)."""
    predicted, truth = np.asarray(answers, bool), np.asarray(task.truth, bool)
    sums = confusion_sums(predicted, truth, task.group)  # [examples, 4]
    totals = sums.sum(axis=0) if len(sums) else np.zeros(4)
    metrics = classification_metrics(totals, undefined=task.undefined)
    score = float(balanced_accuracy_from(totals)) if len(truth) else float("nan")
    if task.protocol == "delphi":
        score = metrics["balanced_accuracy"]
    p = p_value(sums) if len(sums) else float("nan")
    # yes / no answers rank the examples in two groups, so their AUC (ties counting half) is the balanced accuracy
    metrics["auc"] = score if scores is None else rank_auc(scores, truth)
    metrics = {k: float(v) for k, v in metrics.items() if k != "balanced_accuracy"}
    return sums, score, p, metrics, int((~truth).sum()) if name == "detection" else -1


def classify(name: str, task: Task, answers, *, seed: int, n_boot: int, judge: str, p_value=label_permutation_p,
             swap: bool = False, n: int | None = None, scores=None) -> Score:
    """A classification scorer's :class:`Score`: :func:`summarise`, and the hull of a bootstrap interval over
    examples and the shift interval of the side's label-permutation null (``swap``: the two labels of an example
    exchanged instead; :mod:`kvmem.autointerp.scorers.nulls`)."""
    sums, score, p, metrics, n_quiet = summarise(name, task, answers, p_value=p_value, scores=scores)
    low, high = float("nan"), float("nan")
    if len(sums):
        null = classification_null(task.truth, task.group, [answers], swap=swap, n_perm=n_boot, seed=seed)[0]
        low, high = hull(bootstrap(balanced_accuracy_from, sums, n_boot=n_boot, seed=seed),
                         shifted_interval(score, null, chance=0.5), bounds=(0.0, 1.0))
    return Score(scorer=name, score=score, low=low, high=high, n=len(set(task.group)) if n is None else n,
                 judge=judge, codes=task.codes, p=p, n_quiet=n_quiet, metrics=metrics, protocol=task.protocol)


def paired_classification(task: Task, answers, base_answers, *, seed: int, n_boot: int,
                          swap: bool = False) -> tuple[float, float]:
    """Interval of balanced accuracy minus its baseline's, both on ``task``'s examples: the hull of the paired
    bootstrap and the shift interval of the difference's null (both answer vectors re-paired by the same draws)."""
    truth = np.asarray(task.truth, bool)
    if not len(truth):
        return float("nan"), float("nan")
    own = confusion_sums(np.asarray(answers, bool), truth, task.group)
    base = confusion_sums(np.asarray(base_answers, bool), truth, task.group)
    observed = float(balanced_accuracy_from(own.sum(axis=0)) - balanced_accuracy_from(base.sum(axis=0)))
    nulls = classification_null(truth, task.group, [answers, base_answers], swap=swap, n_perm=n_boot, seed=seed)
    return hull(paired_bootstrap(balanced_accuracy_from, own, base, n_boot=n_boot, seed=seed),
                shifted_interval(observed, nulls[0] - nulls[1], chance=0.0), bounds=(-1.0, 1.0))
