"""Scores and their percentile bootstrap intervals, vectorised over replicates (numpy alone).

Balanced accuracy and a pooled Pearson correlation are not means of per-example numbers, so
:func:`kvmem.experiments.stats.bootstrap_ci` (means and quantiles) does not fit; this module uses the
same scheme: each replicate draws multinomial counts over groups (an example, with every query or
token it owns), and the statistic is computed with those counts as weights.
"""

from __future__ import annotations

import numpy as np

__all__ = ["balanced_accuracy", "pearson", "bootstrap", "N_BOOT", "LEVEL"]

N_BOOT = 1000
LEVEL = 0.95


def balanced_accuracy(predicted, truth, weights=None) -> np.ndarray:
    """(TPR + TNR) / 2 of bool ``predicted`` vs ``truth`` [N]; ``weights`` [N] or [B, N] -> scalar or [B].
    NaN when one class has no weight."""
    p, t = np.asarray(predicted, bool), np.asarray(truth, bool)
    w = np.ones(len(t)) if weights is None else np.asarray(weights, np.float64)
    positives, negatives = w @ t, w @ ~t
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((w @ (p & t)) / positives + (w @ (~p & ~t)) / negatives) / 2


def pearson(x, y, weights=None) -> np.ndarray:
    """Weighted Pearson correlation of ``x`` (predictions) and ``y`` (truth) [N]; weights [N] or [B, N].
    0 where ``x`` is constant (a prediction that says nothing), NaN where ``y`` is."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    w = np.ones(len(x)) if weights is None else np.asarray(weights, np.float64)
    total = w.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mx, my = (w @ x) / total, (w @ y) / total
        vx = (w @ (x * x)) / total - mx * mx
        vy = (w @ (y * y)) / total - my * my
        cov = (w @ (x * y)) / total - mx * my
        r = cov / np.sqrt(np.maximum(vx, 0) * np.maximum(vy, 0))
    scale = np.maximum(np.abs(mx) + np.abs(my), 1.0) ** 2 * 1e-12
    r = np.where(np.maximum(vx, 0) <= scale, 0.0, r)
    return np.where(np.maximum(vy, 0) <= scale, np.nan, np.clip(r, -1, 1))


def bootstrap(statistic, groups, *, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``statistic(weights [B, N]) -> [B]``, resampling whole ``groups`` [N] (ints).
    NaN replicates (a class drawn empty) are dropped; (NaN, NaN) when none is left."""
    groups = np.unique(np.asarray(groups), return_inverse=True)[1]
    if len(groups) == 0:
        return float("nan"), float("nan")
    n = int(groups.max()) + 1
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot)  # [B, groups]
    values = np.asarray(statistic(counts[:, groups].astype(np.float64)), np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan"), float("nan")
    tail = (1 - level) / 2
    low, high = np.quantile(values, [tail, 1 - tail])
    return float(low), float(high)
