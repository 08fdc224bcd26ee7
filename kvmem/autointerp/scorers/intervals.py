"""Scores and their percentile bootstrap intervals, vectorised over replicates (numpy alone).

Balanced accuracy and a pooled Pearson correlation are not means of per-example numbers, so
:func:`kvmem.experiments.stats.bootstrap_ci` (means and quantiles) does not fit; this module uses the
same scheme: each replicate draws multinomial counts over groups (an example, with every query or
token it owns). Both statistics are functions of per-group sums (confusion counts; n, Σx, Σy, Σx²,
Σy², Σxy), so a replicate is the counts [B, G] times the group sums [G, k]: the cost does not grow
with the tokens in a group.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvmem.experiments.stats import average_ranks

__all__ = ["balanced_accuracy", "pearson", "bootstrap", "group_sums", "confusion_sums", "balanced_accuracy_from",
           "moment_sums", "pearson_from", "bootstrap_many", "paired_bootstrap", "classification_metrics",
           "rank_auc", "resample_counts", "row_quantiles", "percentile_interval", "paired_bootstrap_many", "N_BOOT", "LEVEL"]

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


def group_sums(groups, columns) -> np.ndarray:
    """[G, k]: the sum of each of ``columns`` ([N] arrays) over the items of each group (``groups`` [N] ints)."""
    groups = np.asarray(groups, np.int64)
    if len(groups) and (groups.min() != 0 or not np.bincount(groups).all()):  # not already 0..G-1
        groups = np.unique(groups, return_inverse=True)[1]
    n = int(groups.max()) + 1 if len(groups) else 0
    return np.stack([np.bincount(groups, weights=np.asarray(c, np.float64), minlength=n) for c in columns], axis=1)


def confusion_sums(predicted, truth, groups) -> np.ndarray:
    """[G, 4] per group: true positives, false negatives, true negatives, false positives."""
    p, t = np.asarray(predicted, bool), np.asarray(truth, bool)
    return group_sums(groups, [p & t, ~p & t, ~p & ~t, p & ~t])


def balanced_accuracy_from(sums) -> np.ndarray:
    """Balanced accuracy from confusion sums [..., 4] (summed over groups)."""
    tp, fn, tn, fp = np.moveaxis(np.asarray(sums, np.float64), -1, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (tp / (tp + fn) + tn / (tn + fp)) / 2


def moment_sums(x, y, groups) -> np.ndarray:
    """[G, 6] per group: n, Σx, Σy, Σx², Σy², Σxy."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return group_sums(groups, [np.ones_like(x), x, y, x * x, y * y, x * y])


def pearson_from(sums) -> np.ndarray:
    """Pearson r from moment sums [..., 6]; 0 where x is constant, NaN where y is (as :func:`pearson`)."""
    n, sx, sy, sxx, syy, sxy = np.moveaxis(np.asarray(sums, np.float64), -1, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mx, my = sx / n, sy / n
        vx, vy = np.maximum(sxx / n - mx * mx, 0), np.maximum(syy / n - my * my, 0)
        r = (sxy / n - mx * my) / np.sqrt(vx * vy)
    scale = np.maximum(np.abs(mx) + np.abs(my), 1.0) ** 2 * 1e-12
    r = np.where(vx <= scale, 0.0, r)
    return np.where(vy <= scale, np.nan, np.clip(r, -1, 1))


@lru_cache(maxsize=256)
def resample_counts(n: int, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n] multinomial counts of n groups drawn with replacement, seeded by (seed, n); read-only, shared."""
    rng = np.random.default_rng([seed, n])
    draws = rng.integers(0, n, size=(n_boot, n)) + (np.arange(n_boot) * n)[:, None]
    counts = np.bincount(draws.ravel(), minlength=n_boot * n).reshape(n_boot, n).astype(np.float64)
    counts.setflags(write=False)
    return counts


def bootstrap(statistic, sums, *, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``statistic(summed [B, k]) -> [B]`` where each replicate sums the per-group ``sums``
    [G, k] of G groups drawn with replacement (multinomial counts). The draws depend on (seed, G) only, so a
    score and its baseline on the same examples are resampled alike, and tasks of one size share one draw
    matrix. NaN replicates (a class drawn empty) are dropped; (NaN, NaN) when none is left."""
    sums = np.asarray(sums, np.float64)
    n = len(sums)
    if n == 0:
        return float("nan"), float("nan")
    values = np.asarray(statistic(resample_counts(n, n_boot, seed) @ sums), np.float64)
    return percentile_interval(values, level=level)


def percentile_interval(values, *, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of ``values``' finite entries: ``np.quantile`` at (1 - level) / 2 and its
    complement; (NaN, NaN) when none is finite."""
    values = np.asarray(values, np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan"), float("nan")
    tail = (1 - level) / 2
    low, high = np.quantile(values, [tail, 1 - tail])
    return float(low), float(high)


def row_quantiles(values, *, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """The percentile interval of each row of ``values`` [R, B] over its finite entries -> (low [R], high [R]),
    NaN where a row has none: row by row equal to ``np.quantile(row[np.isfinite(row)], [tail, 1 - tail])``
    (the rows without a NaN in one call along the axis, the others one at a time)."""
    values = np.asarray(values, np.float64)
    low, high = np.full(len(values), np.nan), np.full(len(values), np.nan)
    if not values.size:
        return low, high
    tail = (1 - level) / 2
    finite = np.isfinite(values)
    whole = finite.all(axis=1)
    if whole.any():
        low[whole], high[whole] = np.quantile(values[whole], [tail, 1 - tail], axis=1)
    for r in np.flatnonzero(~whole):
        kept = values[r][finite[r]]
        if len(kept):
            low[r], high[r] = np.quantile(kept, [tail, 1 - tail])
    return low, high


def bootstrap_many(statistic, sums_list, *, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0,
                   exact_sums: bool = False, batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """:func:`bootstrap` of many tasks at once: ``sums_list`` [R] of per-group sums [G_r, k] -> (low [R], high [R]),
    equal to R calls of :func:`bootstrap`. Tasks with the same G share one draw matrix; their replicate sums are
    one batched product when ``exact_sums`` (integer-valued sums, so the order of additions cannot matter), else
    one product per task as in :func:`bootstrap`; statistics and quantiles run for ``batch`` tasks at once."""
    low, high = np.full(len(sums_list), np.nan), np.full(len(sums_list), np.nan)
    by_size: dict[int, list[int]] = {}
    for i, sums in enumerate(sums_list):
        if len(sums):
            by_size.setdefault(len(sums), []).append(i)
    for n, all_members in by_size.items():
        counts = resample_counts(n, n_boot, seed)
        for begin in range(0, len(all_members), batch):
            members = all_members[begin:begin + batch]
            k = np.shape(sums_list[members[0]])[-1]
            replicates = np.empty((k, len(members), n_boot))  # contiguous per statistic column
            if exact_sums:
                stacked = np.stack([np.asarray(sums_list[i], np.float64) for i in members])  # [R, G, k]
                replicates[:] = np.moveaxis(counts @ stacked, -1, 0)
            else:
                for r, i in enumerate(members):
                    replicates[:, r, :] = (counts @ np.asarray(sums_list[i], np.float64)).T
            values = np.asarray(statistic(np.moveaxis(replicates, 0, -1)), np.float64)  # [R, B]
            low[members], high[members] = row_quantiles(values, level=level)
    return low, high


def paired_bootstrap_many(statistic, sums_a, sums_b, *, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0,
                          batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """:func:`paired_bootstrap` of many pairs of integer-valued per-group sums (``sums_a[r]``, ``sums_b[r]`` [G_r, k],
    confusion counts) at once -> (low [R], high [R]), equal pair by pair: pairs with the same G share one draw
    matrix and one batched product (integer sums: the order of additions cannot matter)."""
    low, high = np.full(len(sums_a), np.nan), np.full(len(sums_a), np.nan)
    by_size: dict[int, list[int]] = {}
    for i, (a, b) in enumerate(zip(sums_a, sums_b)):
        if len(a) and len(b) == len(a):
            by_size.setdefault(len(a), []).append(i)
    for n, all_members in by_size.items():
        counts = resample_counts(n, n_boot, seed)
        for begin in range(0, len(all_members), batch):
            members = all_members[begin:begin + batch]
            a = counts @ np.stack([np.asarray(sums_a[i], np.float64) for i in members])  # [R, B, k]
            b = counts @ np.stack([np.asarray(sums_b[i], np.float64) for i in members])
            values = np.asarray(statistic(a), np.float64) - np.asarray(statistic(b), np.float64)
            low[members], high[members] = row_quantiles(values, level=level)
    return low, high


def paired_bootstrap(statistic, sums_a, sums_b, *, n_boot: int = N_BOOT, level: float = LEVEL,
                     seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``statistic(a) - statistic(b)`` where a and b are per-group sums [G, k] of the SAME
    groups (a score and its baseline on the same examples): each replicate draws the groups once for both
    (the draws of :func:`bootstrap`, seeded by (seed, G)). (NaN, NaN) when no replicate is finite."""
    sums_a, sums_b = np.asarray(sums_a, np.float64), np.asarray(sums_b, np.float64)
    n = len(sums_a)
    if n == 0 or len(sums_b) != n:
        return float("nan"), float("nan")
    counts = resample_counts(n, n_boot, seed)
    values = np.asarray(statistic(counts @ sums_a), np.float64) - np.asarray(statistic(counts @ sums_b), np.float64)
    return percentile_interval(values, level=level)


def classification_metrics(totals, *, undefined: float = float("nan")) -> dict:
    """precision, recall, f1 and balanced accuracy of confusion totals (tp, fn, tn, fp); ``undefined`` where a
    ratio has no denominator (kvmem: NaN; Delphi's ``compute_classification_metrics``: 0)."""
    tp, fn, tn, fp = (float(v) for v in np.asarray(totals, np.float64))

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else undefined

    precision, recall, tnr = ratio(tp, tp + fp), ratio(tp, tp + fn), ratio(tn, tn + fp)
    f1 = ratio(2 * precision * recall, precision + recall) if np.isfinite(precision + recall) else undefined
    return {"precision": precision, "recall": recall, "f1": f1, "balanced_accuracy": (recall + tnr) / 2}


def rank_auc(score, truth) -> float:
    """Area under the ROC curve of ``score`` [N] for bool ``truth`` [N] (Mann-Whitney, ties count half); NaN when a
    class is empty. For 0/1 scores it equals the balanced accuracy."""
    score, truth = np.asarray(score, np.float64), np.asarray(truth, bool)
    positives, negatives = int(truth.sum()), int((~truth).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    ranks = average_ranks(score)
    return float((ranks[truth].sum() - positives * (positives + 1) / 2) / (positives * negatives))
