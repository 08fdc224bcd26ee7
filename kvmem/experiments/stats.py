"""Statistics for the experiments, in numpy alone: exact permutation null, single-cycle shuffles, bootstrap intervals,
paired tests.

All functions are pure (arrays in, numbers out) and pinned by tests on hand-built cases whose answers
are known exactly (a layer small enough to enumerate every permutation, differences whose Wilcoxon
statistic is computed by hand).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from kvmem.errors import KvmemError

__all__ = [
    "average_ranks",
    "bootstrap_ci",
    "exact_permutation_null",
    "exact_permutation_null_of_pairs",
    "sign_test",
    "single_cycle",
    "wilcoxon_signed_rank",
]


def exact_permutation_null(target_sets: Sequence[Iterable[int]], value_tokens: Sequence[int]) -> float:
    """Expected agreement when values are permuted uniformly at random within the layer.

    Neuron i agrees when the top token of the value it is paired with lies in ``target_sets[i]``
    (its trigger(s)' next tokens). Under a uniform random permutation π of the layer's n values,
    P(value_tokens[π(i)] ∈ S_i) = #{j : value_tokens[j] ∈ S_i} / n, so the expected fraction of
    agreeing neurons is Σ_i #{j : t_j ∈ S_i} / n². This keeps both the token frequencies of the
    values and those of the next tokens, which 1/|V| does not. Returns NaN for n = 0.
    """
    n = len(value_tokens)
    if len(target_sets) != n:
        raise KvmemError(f"need one target set per value: {len(target_sets)} sets for {n} values")
    sets = [np.fromiter(targets, np.int64) for targets in target_sets]
    owners = np.repeat(np.arange(n), [len(targets) for targets in sets])
    return exact_permutation_null_of_pairs(owners, np.concatenate(sets) if sets else np.zeros(0, np.int64),
                                           value_tokens)


def exact_permutation_null_of_pairs(owners: np.ndarray, targets: np.ndarray, value_tokens: Sequence[int]) -> float:
    """:func:`exact_permutation_null` with the sets given as pairs: token ``targets[p]`` is in the set of
    neuron ``owners[p]`` (0..n-1; a pair may repeat)."""
    tokens = np.asarray(value_tokens, np.int64)
    n = len(tokens)
    if n == 0:
        return float("nan")
    pairs = np.unique(np.stack([np.asarray(owners, np.int64), np.asarray(targets, np.int64)], axis=1), axis=0)
    unique, counts = np.unique(tokens, return_counts=True)
    at = np.searchsorted(unique, pairs[:, 1])
    hit = (at < len(unique)) & (unique[np.minimum(at, len(unique) - 1)] == pairs[:, 1])
    return int(counts[at[hit]].sum()) / (n * n)


def _statistic(values: np.ndarray, weights: np.ndarray, statistic: Any) -> np.ndarray:
    """Weighted statistic of ``values`` [N] (ascending, for a quantile) per row of ``weights`` [B, N] -> [B]."""
    if statistic == "mean":
        return (weights @ values) / weights.sum(axis=1)
    q = 0.5 if statistic == "median" else float(statistic)
    cumulative = np.cumsum(weights, axis=1)  # [B, N], non-decreasing along each row (weights >= 0)
    target = q * cumulative[:, -1]
    n = len(values)
    low, high = np.empty(len(weights), np.int64), np.empty(len(weights), np.int64)
    for b, (row, t) in enumerate(zip(cumulative, target)):
        # the first value whose cumulative weight reaches the quantile, and the first that passes it (the same
        # unless exactly on it); a binary search, as each row is sorted
        low[b] = np.searchsorted(row, t - 1e-9, side="left")
        high[b] = np.searchsorted(row, t + 1e-9, side="right")
    low[low == n], high[high == n] = 0, 0  # none reaches it (float rounding at the end): the first value
    return (values[low] + values[high]) / 2  # as np.median when the weight splits exactly in half


def _quantile_by_blocks(values: np.ndarray, weights: np.ndarray, group_ids: np.ndarray, counts: np.ndarray,
                        statistic: Any, block: int = 256) -> np.ndarray:
    """:func:`_statistic` of the replicates ``counts`` [B, groups] for integer-valued ``weights``, without the
    [B, N] cumulative weights: each block of ``block`` sorted values sums its weight per replicate in one
    product (counts @ the block's weight per group), a search over the block totals finds the block where the
    quantile's weight is reached, and only that block is summed value by value. The weights are integers,
    so every sum is exact in any order and the same positions are found."""
    n, n_groups = len(values), counts.shape[1]
    counts = np.asarray(counts, np.float64).copy()
    per_block = np.zeros((n_groups, -(-n // block)))
    np.add.at(per_block, (group_ids, np.arange(n) // block), weights)
    empty = (counts @ per_block).sum(axis=1) == 0
    counts[empty] = 1.0  # a replicate with no weight left: the sample itself (as _statistic's callers do)
    ends = np.cumsum(counts @ per_block, axis=1)  # [B, blocks]: cumulative weight at each block's end
    q = 0.5 if statistic == "median" else float(statistic)
    target = q * ends[:, -1]
    rows = np.arange(len(counts))

    def first(bound: np.ndarray, strict: bool) -> np.ndarray:
        """[B] the first position whose cumulative weight reaches ``bound`` (passes it, if ``strict``); n if none."""
        def reached(cumulative, at):
            return cumulative > at if strict else cumulative >= at

        in_block = np.argmax(reached(ends, bound[:, None]), axis=1)  # the first block that gets there
        found = reached(ends[rows, in_block], bound)
        before = np.where(in_block > 0, ends[rows, np.maximum(in_block - 1, 0)], 0.0)
        span = np.minimum(np.arange(block)[None, :] + (in_block * block)[:, None], n - 1)  # that block's positions
        step = counts[rows[:, None], group_ids[span]] * weights[span]
        step[span < np.arange(block)[None, :] + (in_block * block)[:, None]] = 0.0  # past the last value
        at = np.argmax(reached(before[:, None] + np.cumsum(step, axis=1), bound[:, None]), axis=1)
        return np.where(found, in_block * block + at, n)

    low, high = first(target - 1e-9, strict=False), first(target + 1e-9, strict=True)
    low[low == n], high[high == n] = 0, 0
    return (values[low] + values[high]) / 2


def bootstrap_ci(values: Sequence[float], *, groups: Sequence[Any] | None = None,
                 weights: Sequence[float] | None = None, statistic: str | float = "mean", n_boot: int = 1000,
                 level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of a statistic: (low, high).

    ``statistic``: ``"mean"`` (weighted by ``weights`` when given: a ratio of sums), ``"median"`` or a
    quantile in (0, 1) (weighted: the value where the cumulative weight reaches it, or the midpoint of
    the two values around it when the weight splits there exactly, as ``np.median`` does). ``groups``: resample whole groups (e.g. the triggers of one neuron together), else
    single values. NaN values are dropped. Each replicate draws counts from a multinomial, so no
    replicate exists as a copied array. Returns (NaN, NaN) when nothing is left.
    """
    if n_boot < 1 or not 0 < level < 1:
        raise KvmemError(f"need n_boot >= 1 and 0 < level < 1, got n_boot={n_boot}, level={level}")
    if statistic not in ("mean", "median") and not (isinstance(statistic, float) and 0 < statistic < 1):
        raise KvmemError(f"statistic must be 'mean', 'median' or a quantile in (0, 1), got {statistic!r}")
    values = np.asarray(values, np.float64)
    weights = np.ones(len(values)) if weights is None else np.asarray(weights, np.float64)
    group_ids = np.arange(len(values)) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
    keep = np.isfinite(values) & (weights > 0)
    values, weights, group_ids = values[keep], weights[keep], group_ids[keep]
    if len(values) == 0:
        return float("nan"), float("nan")
    group_ids = np.unique(group_ids, return_inverse=True)[1]
    n_groups = int(group_ids.max()) + 1
    if statistic != "mean":  # a quantile reads the values in ascending order: sort them once, not per replicate
        order = np.argsort(values, kind="stable")
        values, weights, group_ids = values[order], weights[order], group_ids[order]
    out = np.empty(n_boot)
    chunk = max(1, int(4e6 // len(values)))
    start = 0
    whole = statistic != "mean" and bool(np.all(weights == np.round(weights))) and weights.sum() < 2**40
    for counts in _resampled_counts(seed, n_groups, n_boot, chunk):  # [b, groups]
        if whole:  # integer weights: every cumulative weight is an exact integer, so blocks can sum them
            out[start:start + len(counts)] = _quantile_by_blocks(values, weights, group_ids, counts, statistic)
            start += len(counts)
            continue
        stop = start + len(counts)
        element = counts[:, group_ids] * weights[None]  # [b, N]
        empty = element.sum(axis=1) == 0
        element[empty] = weights  # a replicate with no weight left (all-zero groups): keep the sample itself
        out[start:stop] = _statistic(values, element, statistic)
        start = stop
    tail = (1 - level) / 2
    low, high = np.quantile(out, [tail, 1 - tail])
    return float(low), float(high)


@functools.lru_cache(maxsize=4)
def _cached_counts(seed: int, n_groups: int, n_boot: int, chunk: int) -> tuple[np.ndarray, ...]:
    return tuple(_draw_counts(seed, n_groups, n_boot, chunk))


def _draw_counts(seed: int, n_groups: int, n_boot: int, chunk: int):
    """The bootstrap's draws: how often each group is picked in each replicate, ``chunk`` replicates at a time."""
    rng = np.random.default_rng(seed)
    for start in range(0, n_boot, chunk):
        counts = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=min(start + chunk, n_boot) - start)
        counts.setflags(write=False)
        yield counts


def _resampled_counts(seed: int, n_groups: int, n_boot: int, chunk: int):
    """The draws of :func:`_draw_counts`, kept for the next call with the same arguments where they are small
    (an experiment bootstraps many statistics over the same neurons: drawing them is most of its time)."""
    if isinstance(seed, (int, np.integer)) and n_groups * n_boot <= 1 << 22:
        return _cached_counts(seed, n_groups, n_boot, chunk)
    return _draw_counts(seed, n_groups, n_boot, chunk)


def average_ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks 1..n of ``values``, ties sharing the average of the ranks they span (as scipy's rankdata)."""
    values = np.asarray(values, np.float64)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)
    return (upper - (counts - 1) / 2.0)[inverse]


def _differences(x: Sequence[float], y: Sequence[float] | None) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if y is not None:
        y = np.asarray(y, np.float64)
        if x.shape != y.shape:
            raise KvmemError(f"paired samples must have the same length, got {x.shape} and {y.shape}")
        x = x - y
    return x[np.isfinite(x)]


def wilcoxon_signed_rank(x: Sequence[float], y: Sequence[float] | None = None) -> dict[str, float]:
    """Two-sided Wilcoxon signed-rank test of d = x - y (or x) against a median of 0, normal approximation.

    Zero differences are dropped (Wilcoxon's rule); tied |d| share average ranks and the variance is
    corrected for them: var = n(n+1)(2n+1)/24 - Σ(t³ - t)/48 over tie groups of size t. No continuity
    correction. Returns {n, w_plus (sum of ranks of positive d), w_minus, z, p_value}; NaN z and p
    when no non-zero difference is left.
    """
    d = _differences(x, y)
    d = d[d != 0]
    n = len(d)
    if n == 0:
        return {"n": 0, "w_plus": 0.0, "w_minus": 0.0, "z": float("nan"), "p_value": float("nan")}
    ranks = average_ranks(np.abs(d))
    w_plus = float(ranks[d > 0].sum())
    w_minus = float(ranks[d < 0].sum())
    _, ties = np.unique(np.abs(d), return_counts=True)
    variance = n * (n + 1) * (2 * n + 1) / 24.0 - float(((ties ** 3) - ties).sum()) / 48.0
    if variance <= 0:
        return {"n": n, "w_plus": w_plus, "w_minus": w_minus, "z": float("nan"), "p_value": float("nan")}
    z = (w_plus - n * (n + 1) / 4.0) / math.sqrt(variance)
    return {"n": n, "w_plus": w_plus, "w_minus": w_minus, "z": z, "p_value": math.erfc(abs(z) / math.sqrt(2))}


def sign_test(x: Sequence[float], y: Sequence[float] | None = None) -> dict[str, float]:
    """Exact two-sided sign test of d = x - y (or x): zeros dropped, p = min(1, 2 P(Bin(n, 1/2) <= min(k, n-k))).

    Returns {n, positive (k), p_value} (p computed in exact rational arithmetic; NaN for n = 0).
    """
    d = _differences(x, y)
    d = d[d != 0]
    n, positive = len(d), int((d > 0).sum())
    if n == 0:
        return {"n": 0, "positive": 0, "p_value": float("nan")}
    tail = term = 1  # Σ_{j <= min(k, n-k)} C(n, j), each term from the last: C(n, j+1) = C(n, j) (n - j) / (j + 1)
    for k in range(min(positive, n - positive)):
        term = term * (n - k) // (k + 1)
        tail += term
    return {"n": n, "positive": positive, "p_value": float(min(Fraction(1), Fraction(2 * tail, 2 ** n)))}


def single_cycle(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random permutation sigma of range(n) with a single cycle, so sigma[i] != i for every i when n > 1."""
    order = rng.permutation(n)
    sigma = np.empty(n, np.int64)
    sigma[order] = np.roll(order, -1)
    return sigma
