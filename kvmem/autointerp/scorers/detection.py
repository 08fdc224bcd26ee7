"""Detection (Delphi, arXiv 2410.13928): does the neuron side fire on the last token of this context?

Held-out activating examples come from every band (:func:`~kvmem.autointerp.scorers.base.select_active`);
non-activating ones are the held-out random samples below the side's threshold. Each context is
shown up to and including the kept token (the prefix the coefficient depends on), and the judge
answers fires / does not fire about its last token. Score: balanced accuracy, chance 0.5.
"""

from __future__ import annotations

import numpy as np

from kvmem.autointerp.scorers.base import PER_BAND, Query, Score, Task, select_active
from kvmem.autointerp.scorers.statistics import N_BOOT, balanced_accuracy_from, bootstrap, confusion_sums

__all__ = ["build", "evaluate", "NAME", "ANSWER"]

NAME = "detection"
ANSWER = "bool"


def build(side, *, per_band: int = PER_BAND, seed: int = 0, max_quiet: int | None = None) -> Task:
    """``max_quiet``: at most this many non-activating examples (the first by code; None: all held-out ones)."""
    held = side.part(held_out=True)
    quiet = sorted((e for e in held if e.band == "random" and not e.active), key=lambda e: e.code)
    chosen = select_active(held, per_band) + quiet[:max_quiet]
    queries = tuple(Query(tokens=e.tokens[:e.index + 1], index=e.index) for e in chosen)
    return Task(scorer=NAME, queries=queries, truth=tuple(e.active for e in chosen), group=tuple(range(len(chosen))),
                codes=tuple(e.code for e in chosen))


def evaluate(task: Task, answers, *, seed: int = 0, n_boot: int = N_BOOT, judge: str = "") -> Score:
    predicted, truth = np.asarray(answers, bool), np.asarray(task.truth, bool)
    sums = confusion_sums(predicted, truth, task.group)  # [examples, 4]
    score = float(balanced_accuracy_from(sums.sum(axis=0))) if len(truth) else float("nan")
    low, high = bootstrap(balanced_accuracy_from, sums, n_boot=n_boot, seed=seed)
    return Score(scorer=NAME, score=score, low=low, high=high, n=len(set(task.group)), judge=judge, codes=task.codes)
