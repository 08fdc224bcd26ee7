"""Embedding (Delphi): does the explanation sit closer, in a sentence-embedding space, to contexts where the side
fires than to contexts where it does not?

Delphi's embedding scorer (EleutherAI/delphi, ``scorers/embedding/embedding.py``) embeds the explanation and
every example and ranks the examples by similarity. Here the examples are detection's (held-out activating
examples, at most ``per_band`` per band, and the side's own non-activating ones, at most ``max_quiet``,
default ``MAX_QUIET``), each shown as its whole stored context; the model is a local sentence-transformers
model (:mod:`kvmem.autointerp.embedder`; the ``--judge`` plays no part). Delphi prefixes the explanation
with an instruction for instruction-tuned embedding models; all-MiniLM-L6-v2 is not one, so the
explanation is embedded as it is. Score: the AUC of the similarity for activating against
non-activating examples (chance 0.5); p: a one-sided Mann-Whitney test; the bootstrap resamples examples.
"""

from __future__ import annotations

import numpy as np

from kvmem.autointerp.scorers.base import DEFAULT_PROTOCOL, PER_BAND, Query, Score, Task, select_active
from kvmem.autointerp.scorers.detection import quiet_examples
from kvmem.autointerp.scorers.intervals import N_BOOT, percentile_interval, rank_auc, resample_counts

__all__ = ["build", "evaluate", "paired", "answer", "NAME", "ANSWER", "ASPECT", "NEEDS", "MAX_QUIET"]

NAME = "embedding"
ANSWER = "similarity"
ASPECT = "input"
NEEDS = "embedder"
MAX_QUIET = 50


def build(side, *, per_band: int = PER_BAND, seed: int = 0, max_quiet: int | None = None,
          protocol: str = DEFAULT_PROTOCOL, embedder=None) -> Task:
    held = side.part(held_out=True)
    chosen = select_active(held, per_band) + quiet_examples(held)[:MAX_QUIET if max_quiet is None else max_quiet]
    return Task(scorer=NAME, queries=tuple(Query(tokens=e.tokens, index=e.index) for e in chosen),
                truth=tuple(e.active for e in chosen), group=tuple(range(len(chosen))),
                codes=tuple(e.code for e in chosen), protocol=protocol)


def answer(jobs, *, embedder, **_) -> list[float]:
    """The cosine similarity of each job's explanation text with its query's context."""
    out = [0.0] * len(jobs)
    by_text: dict[str, list[int]] = {}
    for i, (explanation, _, _) in enumerate(jobs):
        by_text.setdefault(explanation.text, []).append(i)
    for text, index in by_text.items():
        similarity = embedder.similarity(text, ["".join(jobs[i][2].tokens) for i in index])
        for i, s in zip(index, similarity.tolist()):
            out[i] = float(s)
    return out


def _replicates(similarity, truth, *, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot] AUC of the examples drawn with replacement (the bootstrap's draws): weighted Mann-Whitney."""
    s, t = np.asarray(similarity, np.float64), np.asarray(truth, bool)
    wins = (s[t][:, None] > s[~t][None, :]) + 0.5 * (s[t][:, None] == s[~t][None, :])  # [P, N]
    counts = resample_counts(len(s), n_boot, seed)  # [B, G]
    wp, wn = counts[:, t], counts[:, ~t]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.einsum("bp,pn,bn->b", wp, wins, wn) / (wp.sum(axis=1) * wn.sum(axis=1))


def evaluate(task: Task, answers, *, seed: int = 0, n_boot: int = N_BOOT, judge: str = "", scores=None) -> Score:
    from scipy.stats import mannwhitneyu

    truth = np.asarray(task.truth, bool)
    similarity = np.asarray(answers, np.float64)
    score = rank_auc(similarity, truth)
    if not np.isfinite(score):
        return Score(scorer=NAME, score=score, low=float("nan"), high=float("nan"), n=len(task.codes), judge=judge,
                     codes=task.codes, n_quiet=int((~truth).sum()), protocol=task.protocol)
    low, high = percentile_interval(_replicates(similarity, truth, n_boot=n_boot, seed=seed))
    p = float(mannwhitneyu(similarity[truth], similarity[~truth], alternative="greater").pvalue)
    return Score(scorer=NAME, score=score, low=low, high=high, n=len(task.codes), judge=judge, codes=task.codes, p=p,
                 n_quiet=int((~truth).sum()), protocol=task.protocol)


def paired(task: Task, answers, base_answers, *, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float]:
    truth = np.asarray(task.truth, bool)
    if truth.all() or not truth.any():
        return float("nan"), float("nan")
    return percentile_interval(_replicates(answers, truth, n_boot=n_boot, seed=seed)
                               - _replicates(base_answers, truth, n_boot=n_boot, seed=seed))
