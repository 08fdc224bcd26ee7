"""Per-side nulls of the explanation scores: p-values and the intervals that stay calibrated under them.

Each scorer's p-value comes from a permutation null built for that side, on its own examples and the
judge's own answers: what the score would be if the answers carried no information about which
example is which. It is one-sided (a good explanation scores high) and exact where the null
distribution has a closed form:

- **detection, output** (one query per example, labels fire / quiet): permuting the labels over the
  examples keeps the number of positives P, negatives N and "yes" answers k, so the true positives
  follow a hypergeometric law (Fisher's exact test); balanced accuracy rises with TP for fixed P, N, k,
  so ``p = P(TP' >= TP)`` (:func:`hypergeometric_p`);
- **fuzzing** (each example asked twice, at its firing token and at a quiet one): the null swaps the
  two labels of an example; examples answered alike score the same either way, and each of the d
  others is right or wrong with probability 1/2: a sign test, ``p = P(Binomial(d, 1/2) >= right)``
  (:func:`swap_p`);
- **intervention** (which of two continuations was steered): the same sign test over the pairs the
  judge decided;
- **simulation** (pooled Pearson r over records): records are the unit (their tokens are
  correlated), so the null pairs each record's predictions with another record's activations, among
  records of the same length; n, Σx, Σy, Σx², Σy² stay fixed, only Σxy moves, so each permutation is a
  sum over a [G, G] matrix of record dot products (:func:`record_permutation`). The p-value counts
  the permutations reaching the observed r (Monte Carlo, ``(1 + hits) / (1 + n_perm)``).

The same nulls make the intervals honest at chance. A percentile bootstrap over the examples covers the
truth too rarely when the truth is chance (answers that carry nothing; about 0.88-0.90 for detection and
simulation in ``benchmarks/score_calibration.py``): with few "yes" answers, or a few records of
heavy-tailed activations, the resamples keep the observed pairing and vary too little. Each interval is
therefore the hull of the bootstrap interval and the null's shift interval (:func:`shifted_interval`:
the scores a shifted copy of the null would keep), which holds chance as often as the permutation test
keeps it; away from chance the bootstrap's part dominates. The paired interval of a score minus its
baseline does the same with the paired bootstrap and the null of the difference (both answer vectors
re-paired by the same draws).

The draws depend on (seed, number of examples) only, like the bootstrap's
(:mod:`kvmem.autointerp.scorers.intervals`), so every path that scores a side gets the same numbers.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from math import comb

import numpy as np

from kvmem.autointerp.scorers.intervals import row_quantiles

__all__ = ["hypergeometric_p", "label_permutation_p", "swap_p", "sign_test_p", "record_permutation",
           "record_permutations", "permutation_p",
           "permutation_ps", "shifted_interval", "shifted_intervals", "hull", "hulls", "classification_null",
           "classification_nulls", "N_PERM"]

N_PERM = 1000


def hypergeometric_p(totals) -> float:
    """One-sided p of a classification's confusion totals (tp, fn, tn, fp) under label permutation; NaN when a
    class is empty. Exact, in integers: sum over x >= tp of C(P, x) C(N, k - x) / C(P + N, k), k the "yes" answers."""
    return _hypergeometric_p(*(int(round(float(v))) for v in np.asarray(totals, np.float64)))


@lru_cache(maxsize=4096)
def _hypergeometric_p(tp: int, fn: int, tn: int, fp: int) -> float:
    positives, negatives = tp + fn, tn + fp
    if positives == 0 or negatives == 0:
        return float("nan")
    k = tp + fp
    tail = sum(comb(positives, x) * comb(negatives, k - x) for x in range(tp, min(positives, k) + 1))
    return float(Fraction(tail, comb(positives + negatives, k)))


def label_permutation_p(sums) -> float:
    """:func:`hypergeometric_p` of per-example confusion sums [G, 4] (summed)."""
    return hypergeometric_p(np.asarray(sums, np.float64).sum(axis=0))


def sign_test_p(right: int, decided: int) -> float:
    """P(Binomial(decided, 1/2) >= right), exact; 1.0 when nothing was decided."""
    return _sign_test_p(int(right), int(decided))


@lru_cache(maxsize=4096)
def _sign_test_p(right: int, decided: int) -> float:
    if decided <= 0:
        return 1.0
    return float(Fraction(sum(comb(decided, x) for x in range(right, decided + 1)), 2 ** decided))


def swap_p(sums) -> float:
    """Fuzzing's p from per-example confusion sums [G, 4] (each example: one firing and one quiet query)."""
    sums = np.asarray(sums, np.float64)
    if not len(sums):
        return float("nan")
    tp, fn, tn, fp = sums.T
    right = int(np.sum((tp == 1) & (tn == 1)))
    wrong = int(np.sum((fn == 1) & (fp == 1)))
    return sign_test_p(right, right + wrong)


@lru_cache(maxsize=64)
def _permutations(lengths: tuple[int, ...], n_perm: int, seed: int) -> np.ndarray:
    """[n_perm, G] permutations of G records that move each record only among records of its length."""
    g = len(lengths)
    rng = np.random.default_rng([seed, g, 7])
    keys = rng.random((n_perm, g)) + np.asarray(lengths, np.float64)[None, :] * 2.0  # sort within each length
    order = np.argsort(keys, axis=1, kind="stable")  # [P, G]: the slots of each length, in random order
    slots = np.argsort(np.asarray(lengths), kind="stable")  # the same slots in index order
    out = np.empty((n_perm, g), np.int64)
    out[:, slots] = order
    out.setflags(write=False)
    return out


def record_permutation(predicted, truth, *, n_perm: int = N_PERM, seed: int = 0) -> tuple[float, np.ndarray]:
    """(observed pooled r, [n_perm] r of the null) for records ``predicted[g]``, ``truth[g]`` (1-d arrays, equal
    lengths within a record). The null gives record g's activations the predictions of a record of the same
    length, drawn uniformly (:func:`_permutations`, seeded by (seed, G))."""
    lengths = np.asarray([len(t) for t in truth], np.int64)
    g = len(lengths)
    if g == 0:
        return float("nan"), np.zeros(0)
    width = int(lengths.max())
    x = np.zeros((g, width))
    y = np.zeros((g, width))
    for i, (p, t) in enumerate(zip(predicted, truth)):
        x[i, :len(p)] = p
        y[i, :len(t)] = t
    n = float(lengths.sum())
    mx, my = x.sum() / n, y.sum() / n
    vx, vy = max((x * x).sum() / n - mx * mx, 0.0), max((y * y).sum() / n - my * my, 0.0)
    scale = max(abs(mx) + abs(my), 1.0) ** 2 * 1e-12
    if vy <= scale:
        return float("nan"), np.full(n_perm, np.nan)
    if vx <= scale:
        return 0.0, np.zeros(n_perm)
    dots = x @ y.T  # [G, G]: dots[j, i] = <x_j, y_i> (only same-length pairs are used)
    perms = _permutations(tuple(lengths.tolist()), n_perm, seed)  # [P, G]: record i gets predictions perms[:, i]
    cross = dots[perms, np.arange(g)[None, :]].sum(axis=1)  # [P]
    denominator = np.sqrt(vx * vy)
    observed = float(np.clip((np.trace(dots) / n - mx * my) / denominator, -1, 1))
    return observed, np.clip((cross / n - mx * my) / denominator, -1, 1)


def record_permutations(predicted, truth, lengths, *, n_perm: int = N_PERM, seed: int = 0
                        ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`record_permutation` of E evaluations whose records have the same ``lengths`` [G] (their tokens laid
    end to end: ``predicted``, ``truth`` [E, sum(lengths)]) -> (observed [E], nulls [E, n_perm]), row by row the
    same numbers: the same padded arrays, products, sums and permutations, one batched call each."""
    predicted, truth = np.asarray(predicted, np.float64), np.asarray(truth, np.float64)
    lengths = np.asarray(lengths, np.int64)
    e, g = predicted.shape[0], len(lengths)
    observed, nulls = np.full(e, np.nan), np.full((e, n_perm), np.nan)
    if g == 0 or e == 0:
        return observed, nulls[:, :0] if g == 0 else nulls
    width = int(lengths.max())
    record = np.repeat(np.arange(g), lengths)
    offset = np.arange(len(record)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    x = np.zeros((e, g, width))
    y = np.zeros((e, g, width))
    x[:, record, offset] = predicted
    y[:, record, offset] = truth
    n = float(lengths.sum())
    mx, my = x.reshape(e, -1).sum(axis=1) / n, y.reshape(e, -1).sum(axis=1) / n
    vx = np.maximum((x * x).reshape(e, -1).sum(axis=1) / n - mx * mx, 0.0)
    vy = np.maximum((y * y).reshape(e, -1).sum(axis=1) / n - my * my, 0.0)
    scale = np.maximum(np.abs(mx) + np.abs(my), 1.0) ** 2 * 1e-12
    undefined = vy <= scale  # a constant truth: NaN
    flat = (vx <= scale) & ~undefined  # a constant prediction: 0
    observed[flat], nulls[flat] = 0.0, 0.0
    ok = ~undefined & ~flat
    if ok.any():
        x, y, mx, my = x[ok], y[ok], mx[ok], my[ok]
        dots = x @ y.transpose(0, 2, 1)  # [E, G, G]
        perms = _permutations(tuple(lengths.tolist()), n_perm, seed)
        cross = dots[:, perms, np.arange(g)[None, :]].sum(axis=2)  # [E, P]
        denominator = np.sqrt(vx[ok] * vy[ok])
        observed[ok] = np.clip((np.trace(dots, axis1=1, axis2=2) / n - mx * my) / denominator, -1, 1)
        nulls[ok] = np.clip((cross / n - (mx * my)[:, None]) / denominator[:, None], -1, 1)
    return observed, nulls


def permutation_p(observed: float, null: np.ndarray) -> float:
    """One-sided Monte Carlo p: (1 + #{null >= observed}) / (1 + n); NaN for a NaN observation."""
    if not np.isfinite(observed):
        return float("nan")
    null = np.asarray(null, np.float64)
    return float((1 + np.sum(null >= observed - 1e-12)) / (1 + len(null)))


def permutation_ps(observed, nulls) -> np.ndarray:
    """:func:`permutation_p` of many sides: ``observed`` [R], ``nulls`` [R, n] -> [R]."""
    observed, nulls = np.asarray(observed, np.float64), np.asarray(nulls, np.float64)
    hits = np.sum(nulls >= (observed - 1e-12)[:, None], axis=1)
    return np.where(np.isfinite(observed), (1 + hits) / (1 + nulls.shape[1]), np.nan)


def _scale(v, fisher: bool):
    """The scale a shift interval is taken on: Fisher's z of a correlation, or the score itself."""
    return np.arctanh(np.clip(v, -0.999999, 0.999999)) if fisher else np.asarray(v, np.float64)


def shifted_interval(observed: float, null: np.ndarray, *, chance: float, level: float = 0.95,
                     fisher: bool = False) -> tuple[float, float]:
    """The values a shift of the side's permutation null would keep: ``observed - (q - chance)`` for the null's
    quantiles q (on Fisher's z scale when ``fisher``, then mapped back). The null is the score's distribution
    when the answers say nothing, i.e. when the true score is ``chance``; so under the null the interval holds
    chance exactly when the two-sided permutation test keeps it: at ``level`` (or more, for a discrete null)."""
    null = np.asarray(null, np.float64)
    null = null[np.isfinite(null)]
    if not np.isfinite(observed) or not len(null):
        return float("nan"), float("nan")
    tail = (1 - level) / 2
    low_q, high_q = np.quantile(_scale(null, fisher), [tail, 1 - tail]) - _scale(chance, fisher)
    at = _scale(observed, fisher)
    low, high = at - high_q, at - low_q
    if fisher:
        low, high = np.tanh(low), np.tanh(high)
    return float(low), float(high)


def shifted_intervals(observed, nulls, *, chance: float, level: float = 0.95,
                      fisher: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """:func:`shifted_interval` of many sides: ``observed`` [R], ``nulls`` [R, n] -> (low [R], high [R]), row by row
    equal (each row's quantiles over its finite entries, :func:`~kvmem.autointerp.scorers.intervals.row_quantiles`)."""
    observed, nulls = np.asarray(observed, np.float64), np.asarray(nulls, np.float64)
    nulls = np.where(np.isfinite(nulls), nulls, np.nan)  # what the one-side version drops before mapping
    low_q, high_q = row_quantiles(_scale(nulls, fisher), level=level)
    at, centre = _scale(observed, fisher), _scale(chance, fisher)
    low, high = at - (high_q - centre), at - (low_q - centre)
    if fisher:
        low, high = np.tanh(low), np.tanh(high)
    bad = ~np.isfinite(observed)
    low[bad], high[bad] = np.nan, np.nan
    return low, high


def hull(*intervals, bounds: tuple[float, float] = (-np.inf, np.inf)) -> tuple[float, float]:
    """The smallest interval holding every finite one of ``intervals``, cut to ``bounds``."""
    finite = [(a, b) for a, b in intervals if np.isfinite(a) and np.isfinite(b)]
    if not finite:
        return float("nan"), float("nan")
    return float(max(min(a for a, _ in finite), bounds[0])), float(min(max(b for _, b in finite), bounds[1]))


def hulls(*intervals, bounds: tuple[float, float] = (-np.inf, np.inf)) -> tuple[np.ndarray, np.ndarray]:
    """:func:`hull` of many sides: each interval a pair (low [R], high [R]) -> (low [R], high [R])."""
    lows = np.stack([np.asarray(a, np.float64) for a, _ in intervals])
    highs = np.stack([np.asarray(b, np.float64) for _, b in intervals])
    ok = np.isfinite(lows) & np.isfinite(highs)
    low = np.maximum(np.where(ok, lows, np.inf).min(axis=0), bounds[0])
    high = np.minimum(np.where(ok, highs, -np.inf).max(axis=0), bounds[1])
    some = ok.any(axis=0)
    return np.where(some, low, np.nan), np.where(some, high, np.nan)


@lru_cache(maxsize=256)
def _label_orders(n: int, n_perm: int, seed: int) -> np.ndarray:
    """[n_perm, n] random permutations of n examples, seeded by (seed, n)."""
    rng = np.random.default_rng([seed, n, 11])
    out = np.argsort(rng.random((n_perm, n)), axis=1, kind="stable").astype(np.int32)
    out.setflags(write=False)
    return out


_MOST_CELLS = 48  # queries up to which the one-hot product beats a gather (its cost grows with their square)


@lru_cache(maxsize=8)
def _permutation_cells(n: int, n_perm: int, seed: int) -> np.ndarray:
    """[n * n, n_perm] float32 one-hot: cell (q, j) of permutation p is 1 when :func:`_label_orders` puts label j at
    query q (so an outer product's entries summed over a permutation's cells are a permuted dot product)."""
    orders = _label_orders(n, n_perm, seed)
    cells = np.zeros((n * n, n_perm), np.float32)
    cells[(np.arange(n)[None, :] * n + orders).ravel(), np.repeat(np.arange(n_perm), n)] = 1
    cells.setflags(write=False)
    return cells


@lru_cache(maxsize=256)
def _swaps(g: int, n_perm: int, seed: int) -> np.ndarray:
    """[n_perm, g] bool: which examples swap their two labels, seeded by (seed, g)."""
    rng = np.random.default_rng([seed, g, 13])
    out = rng.random((n_perm, g)) < 0.5
    out.setflags(write=False)
    return out


def classification_null(truth, group, answers, *, swap: bool, n_perm: int = N_PERM, seed: int = 0) -> np.ndarray:
    """[len(answers), n_perm] balanced accuracy of each answer vector (bool [Q]) against re-paired labels: the
    labels permuted over the queries (one per example), or with ``swap`` the two labels of each example (its
    ``group``) exchanged with probability 1/2. The same draws for every answer vector (paired differences).
    Either way the numbers of positive and negative labels stay, so only the true positives move."""
    truth = np.asarray(truth, bool)
    if swap:
        groups = np.unique(np.asarray(group), return_inverse=True)[1]
        labels = truth[None, :] ^ _swaps(int(groups.max()) + 1 if len(groups) else 0, n_perm, seed)[:, groups]
    else:
        labels = truth[_label_orders(len(truth), n_perm, seed)]  # [P, Q]
    positives, negatives = float(truth.sum()), float((~truth).sum())
    stacked = np.asarray([np.asarray(a, bool) for a in answers], np.float64)  # [A, Q]
    tp = stacked @ labels.T.astype(np.float64)  # [A, P]
    yes = stacked.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (tp / positives + (negatives - (yes - tp)) / negatives) / 2


def classification_nulls(truth, answers, group, *, swap: bool, n_perm: int = N_PERM, seed: int = 0) -> np.ndarray:
    """:func:`classification_null` of R tasks with the same number of queries and the same ``group`` layout at
    once: ``truth``, ``answers`` [R, Q] bool -> [R, n_perm] (row r equals ``classification_null(truth[r], group,
    [answers[r]])[0]``: the same draws, integer counts, the same arithmetic)."""
    truth, answers = np.asarray(truth, bool), np.asarray(answers, bool)
    # every product below is of 0 / ±1 values and every sum a count under 2^24: exact in float32, in any order
    yes, labels = answers.astype(np.float32), truth.astype(np.float32)
    if swap:  # tp = Σ_q a_q (t_q xor f_q) = Σ_q a_q t_q + Σ_q a_q (1 - 2 t_q) f_q
        groups = np.unique(np.asarray(group), return_inverse=True)[1]
        flips = _swaps(int(groups.max()) + 1 if len(groups) else 0, n_perm, seed)[:, groups]  # [P, Q]
        tp = (yes * labels).sum(axis=1, keepdims=True) + (yes * (1 - 2 * labels)) @ flips.T.astype(np.float32)
    elif truth.shape[1] <= _MOST_CELLS:  # tp[r, p] = Σ_q a[r, q] t[r, order[p, q]]: a t^T on the permutations' cells
        q = truth.shape[1]
        tp = (yes[:, :, None] * labels[:, None, :]).reshape(len(truth), q * q) @ _permutation_cells(q, n_perm, seed)
    else:
        tp = np.einsum("rpq,rq->rp", labels[:, _label_orders(truth.shape[1], n_perm, seed)], yes)
    tp = tp.astype(np.float64)
    positives = truth.sum(axis=1, keepdims=True).astype(np.float64)
    negatives = (~truth).sum(axis=1, keepdims=True).astype(np.float64)
    yes = answers.sum(axis=1, keepdims=True).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (tp / positives + (negatives - (yes - tp)) / negatives) / 2
