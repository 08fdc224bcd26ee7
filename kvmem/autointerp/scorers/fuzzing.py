"""Fuzzing (Delphi): is the highlighted token the one where the neuron side fires?

kvmem's protocol (Delphi's ``active`` variant, one highlighted token): every held-out activating
example (:func:`~kvmem.autointerp.scorers.base.select_active`) is shown twice in full context: once
highlighted at its kept token (truth: fires) and once at a wrong position (truth: does not fire). The
wrong position is drawn, seeded by the example's code, among the other tokens whose stored side
activation is below the threshold; when the context coefficients are not stored (bin samples), among
the tokens that differ from the kept one (a repeat of the kept token would probably fire too, and its
truth is unknown). Score: balanced accuracy, chance 0.5; the bootstrap resamples examples with both
their queries; p: a sign test over the examples answered differently at the two positions.

``protocol="delphi"`` builds Delphi's default fuzzing instead (:mod:`kvmem.autointerp.scorers.protocols`).
"""

from __future__ import annotations

import numpy as np

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
from kvmem.autointerp.scorers.nulls import label_permutation_p, swap_p
from kvmem.autointerp.scorers.protocols import delphi_fuzzing
from kvmem.autointerp.splits import splitmix64

__all__ = ["build", "evaluate", "paired", "wrong_position", "NAME", "ANSWER", "ASPECT"]

NAME = "fuzzing"
ANSWER = "bool"
ASPECT = "input"


def wrong_position(example, threshold: float, seed: int) -> int | None:
    """A seeded position other than the kept one where the side does not fire (None if there is none)."""
    kept = example.tokens[example.index]
    others = [j for j in range(len(example.tokens)) if j != example.index
              and (example.tokens[j] != kept if example.activations is None else example.activations[j] < threshold)]
    if not others:
        return None
    pick = int(splitmix64(np.uint64(example.code) ^ splitmix64(np.uint64(seed + 1))) % np.uint64(len(others)))
    return others[pick]


def build(side, *, per_band: int = PER_BAND, seed: int = 0, max_quiet: int | None = None,
          protocol: str = DEFAULT_PROTOCOL) -> Task:
    """(``max_quiet`` is unused: every query comes from an activating example.)"""
    if protocol == "delphi":
        return delphi_fuzzing(side, seed=seed)
    queries, truth, group, codes = [], [], [], []
    for e in select_active(side.part(held_out=True), per_band):
        wrong = wrong_position(e, side.threshold, seed)
        if wrong is None:
            continue
        for index, fires in ((e.index, True), (wrong, False)):
            queries.append(Query(tokens=e.tokens, index=index))
            truth.append(fires)
            group.append(len(codes))
        codes.append(e.code)
    return Task(scorer=NAME, queries=tuple(queries), truth=tuple(truth), group=tuple(group), codes=tuple(codes))


def evaluate(task: Task, answers, *, seed: int = 0, n_boot: int = N_BOOT, judge: str = "", scores=None) -> Score:
    # Delphi's default pairs separate windows (one query each): the labels are permuted, not swapped
    p_value = label_permutation_p if task.protocol == "delphi" else swap_p
    return classify(NAME, task, answers, seed=seed, n_boot=n_boot, judge=judge, p_value=p_value, n=len(task.codes),
                    scores=scores, swap=task.protocol != "delphi")


def paired(task: Task, answers, base_answers, *, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float]:
    return paired_classification(task, answers, base_answers, seed=seed, n_boot=n_boot,
                                 swap=task.protocol != "delphi")
