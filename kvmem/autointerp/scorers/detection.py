"""Detection (Delphi): does the neuron side fire on the last token of this held-out context?

kvmem's protocol: the held-out activating examples (:func:`~kvmem.autointerp.scorers.base.select_active`)
and the side's own non-activating ones: held-out positions where this neuron side stays below its
threshold, from the layer's uniform random sample and from the side's bin samples below its 0.9
quantile level (``below``). Each context is shown up to its kept token (so the judge cannot peek at
what follows); the truth is whether the side fires there. Score: balanced accuracy (TPR + TNR) / 2,
chance 0.5; p: Fisher's exact test of the answers against the labels (:mod:`~kvmem.autointerp.scorers.nulls`).

``protocol="delphi"`` builds Delphi's sequence-level task instead (:mod:`kvmem.autointerp.scorers.protocols`).
"""

from __future__ import annotations

from kvmem.autointerp.scorers.base import (
    DEFAULT_PROTOCOL,
    PER_BAND,
    Query,
    Score,
    Task,
    classify,
    paired_classification,
    select_active,
)
from kvmem.autointerp.scorers.intervals import N_BOOT
from kvmem.autointerp.scorers.protocols import delphi_detection

__all__ = ["build", "evaluate", "paired", "quiet_examples", "NAME", "ANSWER", "ASPECT", "QUIET_BANDS"]

NAME = "detection"
ANSWER = "bool"
ASPECT = "input"
QUIET_BANDS = ("random", "below")


def quiet_examples(held) -> list:
    """The side's held-out non-activating examples (random samples and bin samples below the threshold), by code."""
    return sorted((e for e in held if e.band in QUIET_BANDS and not e.active), key=lambda e: e.code)


def build(side, *, per_band: int = PER_BAND, seed: int = 0, max_quiet: int | None = None,
          protocol: str = DEFAULT_PROTOCOL) -> Task:
    """``max_quiet``: at most this many non-activating examples (the first by code; None: all held-out ones)."""
    if protocol == "delphi":
        return delphi_detection(side, seed=seed)
    held = side.part(held_out=True)
    chosen = select_active(held, per_band) + quiet_examples(held)[:max_quiet]
    queries = tuple(Query(tokens=e.tokens[:e.index + 1], index=e.index) for e in chosen)
    return Task(scorer=NAME, queries=queries, truth=tuple(e.active for e in chosen), group=tuple(range(len(chosen))),
                codes=tuple(e.code for e in chosen))


def evaluate(task: Task, answers, *, seed: int = 0, n_boot: int = N_BOOT, judge: str = "", scores=None) -> Score:
    return classify(NAME, task, answers, seed=seed, n_boot=n_boot, judge=judge, scores=scores)


def paired(task: Task, answers, base_answers, *, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float]:
    return paired_classification(task, answers, base_answers, seed=seed, n_boot=n_boot)
