"""Output: does the explanation say what the memory writes?

The output side of a memory is its value projected through the unembedding (Geva et al. 2022,
arXiv 2203.14680): the tokens it makes more likely and the ones it pushes down. Gur-Arieh et al. 2025
("Enhancing Automated Interpretability with Output-Centric Feature Descriptions", arXiv 2501.08319)
describe features by these tokens; this scorer asks whether an explanation predicts them. The
value's promoted and suppressed tokens (the atlas's ``values`` table, its default convention) are split
by token id (:func:`~kvmem.autointerp.splits.held_out_tokens`): explainers see one half, the judge is
asked about each token of the other half whether the memory makes it more likely (truth: yes for the
side's held-out written tokens, no for its held-out opposed ones). Score: balanced accuracy, chance
0.5; p: Fisher's exact test; the bootstrap resamples tokens.

With the ``tokens`` judge a token counts as written when the rule's ``writes`` list holds it after
normalisation (case and surrounding spaces), so the score measures how far the explain half's tokens
carry over to the held-out half (``' count'`` and ``'Count'`` are different tokens of one word).
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
)
from kvmem.autointerp.scorers.intervals import N_BOOT

__all__ = ["build", "evaluate", "paired", "NAME", "ANSWER", "ASPECT"]

NAME = "output"
ANSWER = "bool"
ASPECT = "output"


def build(side, *, per_band: int = PER_BAND, seed: int = 0, max_quiet: int | None = None,
          protocol: str = DEFAULT_PROTOCOL) -> Task:
    """The side's held-out written tokens (truth: written) and opposed tokens (truth: not), strongest first;
    ``codes`` are their token ids. (``per_band`` and ``max_quiet`` are unused.)"""
    tokens = [(t, True) for t in side.held_writes] + [(t, False) for t in side.held_opposes]
    return Task(scorer=NAME, queries=tuple(Query(tokens=(t.token,), index=0) for t, _ in tokens),
                truth=tuple(w for _, w in tokens), group=tuple(range(len(tokens))),
                codes=tuple(t.id for t, _ in tokens), protocol=protocol)


def evaluate(task: Task, answers, *, seed: int = 0, n_boot: int = N_BOOT, judge: str = "", scores=None) -> Score:
    return classify(NAME, task, answers, seed=seed, n_boot=n_boot, judge=judge, scores=scores)


def paired(task: Task, answers, base_answers, *, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float]:
    return paired_classification(task, answers, base_answers, seed=seed, n_boot=n_boot)
