"""The ``tokens`` judge's scores over a whole layer at once, as numpy array operations.

The per-side path (the scorers' ``build`` / ``evaluate`` and :class:`~kvmem.autointerp.judges.TokensJudge`)
builds one task and answers one query at a time. Here, on :class:`~kvmem.autointerp.layertable.LayerExamples`:

- the scorers' tasks pick and order the held-out examples with sorts over all sides (the output scorer's
  are each side's held-out written and opposed tokens);
- a rule is applied to every query at once through :class:`~kvmem.autointerp.vectorised.KeyTables`;
- every side's answers are counted with one ``np.bincount`` per column, and the intervals, nulls and
  p-values of all sides come from the batched forms in :mod:`kvmem.autointerp.scorers.nulls` and
  :mod:`kvmem.autointerp.scorers.intervals`, each equal row by row to the one-side form.

The results equal the per-side path's exactly (a test compares both on real atlases).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmem.autointerp.layertable import BAND_CODE
from kvmem.autointerp.scorers.base import PER_BAND
from kvmem.autointerp.scorers.intervals import (
    N_BOOT,
    balanced_accuracy_from,
    bootstrap_many,
    classification_metrics,
    paired_bootstrap_many,
    pearson_from,
    resample_counts,
    row_quantiles,
)
from kvmem.autointerp.scorers.nulls import (
    classification_nulls,
    hulls,
    hypergeometric_p,
    permutation_ps,
    record_permutations,
    shifted_intervals,
    swap_p,
)
from kvmem.autointerp.scorers.simulation import MAX_RANDOM, MAX_TOP
from kvmem.autointerp.splits import splitmix64
from kvmem.autointerp.vectorised import KeyTables, segment_rank
from kvmem.errors import KvmemError

__all__ = ["score_layer", "ScoredRows", "FAST_SCORERS"]

FAST_SCORERS = ("detection", "fuzzing", "simulation", "output")

@dataclass(frozen=True, eq=False)
class _Tasks:
    """One scorer's tasks of all sides: queries [Q] (example, token position, truth), grouped by side."""

    example: np.ndarray   # [Q] example row of each query (simulation: each token's example)
    position: np.ndarray  # [Q] token position the judge is asked about
    truth: np.ndarray     # [Q] bool (detection, fuzzing) or float side activations (simulation)
    group: np.ndarray     # [Q] the example's index within its side's task (what the bootstrap resamples)
    start: np.ndarray     # [S + 1] queries of side s: start[s]:start[s + 1]
    codes: list           # [S] tuple of the task's example codes
    n: np.ndarray         # [S] examples in the task
    tokens: list | None = None  # [Q] output: the vocabulary token each query asks about


def _held_sorted(table, mask) -> np.ndarray:
    rows = np.flatnonzero(table.held & mask)
    return rows[np.lexsort((table.code[rows], table.owner[rows]))]


def _selected_active(table, per_band: int) -> np.ndarray:
    """Rows of :func:`~kvmem.autointerp.scorers.base.select_active` for every side, in its order."""
    rows = _held_sorted(table, np.ones(len(table.code), bool))
    position = np.arange(len(rows))
    rows, position = rows[table.active[rows]], position[table.active[rows]]
    owner, band = table.owner[rows], table.band[rows].astype(np.int64)
    by_band = np.lexsort((position, band, owner))
    rank = np.empty(len(rows), np.int64)
    rank[by_band] = segment_rank(owner[by_band] * 16 + band[by_band])
    first_seen = np.empty(len(rows), np.int64)  # where the band first appears in the side's code order
    first_seen[by_band] = position[by_band][np.arange(len(rows)) - rank[by_band]]
    keep = rank < per_band
    rows, owner, first_seen, position = rows[keep], owner[keep], first_seen[keep], position[keep]
    return rows[np.lexsort((position, first_seen, owner))]


def _tasks(table, scorer: str, *, per_band: int, seed: int, max_quiet: int | None) -> _Tasks:
    n_sides = len(table.side)
    length = table.contexts.length[table.ctx]
    if scorer == "detection":
        active = _selected_active(table, per_band)
        quiet_band = (table.band == BAND_CODE["random"]) | (table.band == BAND_CODE["below"])
        quiet = _held_sorted(table, quiet_band & ~table.active)
        if max_quiet is not None:
            quiet = quiet[segment_rank(table.owner[quiet]) < max_quiet]
        rows = np.concatenate([active, quiet])
        rows = rows[np.argsort(table.owner[rows], kind="stable")]
        example, position, truth = rows, table.index[rows], table.active[rows]
        repeats = 1
    elif scorer == "fuzzing":
        rows = _selected_active(table, per_band)
        width = table.contexts.width
        j = np.arange(width)[None, :]
        kept = table.contexts.raw[table.ctx[rows], table.index[rows]][:, None]
        raw = table.contexts.raw[table.ctx[rows]]
        stored = table.has_acts[rows][:, None]
        quiet = np.where(stored, table.side_acts(rows) < table.threshold[table.owner[rows]][:, None], raw != kept)
        others = quiet & (j < length[rows][:, None]) & (j != table.index[rows][:, None])
        count = others.sum(axis=1)
        rows, others, count = rows[count > 0], others[count > 0], count[count > 0]
        mixed = splitmix64(table.code[rows].astype(np.uint64) ^ splitmix64(np.uint64(seed + 1)))
        pick = (mixed % count.astype(np.uint64)).astype(np.int64)
        wrong = np.argmax(np.cumsum(others, axis=1) > pick[:, None], axis=1)
        example = np.repeat(rows, 2)
        position = np.stack([table.index[rows], wrong], axis=1).ravel()
        truth = np.tile([True, False], len(rows))
        repeats = 2
    else:
        rows = _held_sorted(table, table.has_acts)
        owner, band = table.owner[rows], table.band[rows]
        top, rand = band == BAND_CODE["top"], band == BAND_CODE["random"]
        rank = np.zeros(len(rows), np.int64)
        for mask in (top, rand):
            rank[mask] = segment_rank(owner[mask])
        most_random = MAX_RANDOM if max_quiet is None else min(max_quiet, MAX_RANDOM)
        keep = (top & (rank < min(per_band, MAX_TOP))) | (rand & (rank < most_random))
        rows = rows[keep]
        rows = rows[np.lexsort((table.code[rows], ~top[keep], table.owner[rows]))]
        lengths = length[rows]
        example = np.repeat(rows, lengths)
        position = np.arange(len(example)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        truth = table.side_acts(example, position)
        repeats = lengths
    start = np.searchsorted(table.owner[example], np.arange(n_sides + 1))
    ex_start = np.searchsorted(table.owner[rows], np.arange(n_sides + 1))
    per_example = np.arange(len(rows)) - ex_start[table.owner[rows]]  # the example's index in its side's task
    group = np.repeat(per_example, repeats)
    codes_all = table.code[rows].tolist()
    codes = [tuple(codes_all[ex_start[s]:ex_start[s + 1]]) for s in range(n_sides)]
    return _Tasks(example=example, position=position, truth=truth, group=group, start=start, codes=codes,
                  n=np.diff(ex_start))


@dataclass(frozen=True, eq=False)
class ScoredRows:
    """One scorer's results for R rows: score, low, high, p [R]; n, n_quiet [R]; metrics [R] dicts; codes [R]
    tuples; baseline, baseline_low, baseline_high, diff_low, diff_high [R] (NaN where no baseline)."""

    score: np.ndarray
    low: np.ndarray
    high: np.ndarray
    p: np.ndarray
    n: np.ndarray
    n_quiet: np.ndarray
    metrics: list
    codes: list
    baseline: np.ndarray
    baseline_low: np.ndarray
    baseline_high: np.ndarray
    diff_low: np.ndarray
    diff_high: np.ndarray


def _fires(table, keys: KeyTables, tasks: _Tasks, evaluations, rules) -> np.ndarray:
    """Whether the rule fires at each query, for each (side, rule) evaluation in turn (its side's queries)."""
    pair_side = np.asarray([s for s, _ in evaluations], np.int64)
    pair_rule = np.asarray([r for _, r in evaluations], np.int64)
    lengths = tasks.start[pair_side + 1] - tasks.start[pair_side]
    which = np.repeat(np.arange(len(evaluations)), lengths)
    query = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths) + \
        np.repeat(tasks.start[pair_side], lengths)
    kind = np.asarray([rules[r][0] for r in range(len(rules))], np.int64)[pair_rule][which]
    ex = tasks.example[query]
    key = keys.keys[kind, table.ctx[ex], tasks.position[query]]
    space = max(len(keys.kind), 1)
    members = np.concatenate([r * space + rules[r][1] for r in range(len(rules))]) if rules else np.zeros(0, np.int64)
    members.sort()
    wanted = pair_rule[which] * space + key
    at = np.minimum(np.searchsorted(members, wanted), max(len(members) - 1, 0))
    return (key >= 0) & (members[at] == wanted) if len(members) else np.zeros(len(wanted), bool)


def _evaluate(scorer: str, tasks: _Tasks, evaluations, fired, *, seed: int, n_boot: int):
    """Per (side, rule) evaluation: score, low, high, p [E], metrics [E], and what the paired intervals need
    (a dict of [E] arrays: per-example sums and nulls; simulation: observed r, nulls and bootstrap replicates)."""
    statistic = pearson_from if scorer == "simulation" else balanced_accuracy_from
    sides = np.asarray([s for s, _ in evaluations], np.int64)
    lengths = tasks.start[sides + 1] - tasks.start[sides]
    query = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths) + \
        np.repeat(tasks.start[sides], lengths)
    sizes = tasks.n[sides]
    offset = np.cumsum(sizes) - sizes
    # one bincount per column over all evaluations: each group's additions in the order of its own queries
    group = tasks.group[query] + np.repeat(offset, lengths)
    fires = fired
    if scorer == "simulation":
        x, y = np.where(fires, 10.0, 0.0), np.asarray(tasks.truth[query], np.float64)
        columns = [np.ones_like(x), x, y, x * x, y * y, x * y]
    else:
        t = np.asarray(tasks.truth[query], bool)
        columns = [fires & t, ~fires & t, ~fires & ~t, fires & ~t]
    total = int(sizes.sum())
    sums = np.stack([np.bincount(group, weights=np.asarray(c, np.float64), minlength=total) for c in columns], axis=1)
    sums_list = [sums[a:a + n] for a, n in zip(offset.tolist(), sizes.tolist())]  # each task's per-example sums
    totals = np.stack([part.sum(axis=0) for part in sums_list]) if sums_list else np.zeros((0, len(columns)))
    scores = np.where(sizes > 0, np.asarray(statistic(totals), np.float64), np.nan) if len(totals) else np.zeros(0)
    n_eval = len(evaluations)
    p, metrics = np.full(n_eval, np.nan), [{} for _ in range(n_eval)]
    nulls = np.full((n_eval, n_boot), np.nan)
    q_start = np.r_[0, np.cumsum(lengths)]
    if scorer == "simulation":
        # the simulation scorer's evaluate, its parts over all evaluations: the record-permutation null and the
        # bootstrap replicates per evaluation, their quantiles, intervals and p-values at once
        observed, replicates = np.full(n_eval, np.nan), np.full((n_eval, n_boot), np.nan)
        records_of = {}  # record lengths -> the evaluations whose records have them (nulls.record_permutations)
        for e in range(n_eval):
            if sizes[e]:
                groups = group[q_start[e]:q_start[e + 1]]
                cuts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1], True])
                records_of.setdefault(tuple(np.diff(cuts).tolist()), []).append(e)
        for record_lengths, every in records_of.items():
            for begin in range(0, len(every), 64):  # the null's gather holds members × n_boot × records floats
                members = every[begin:begin + 64]
                spans = [slice(q_start[e], q_start[e + 1]) for e in members]
                observed[members], nulls[members] = record_permutations(
                    np.stack([x[s] for s in spans]), np.stack([y[s] for s in spans]), record_lengths,
                    n_perm=n_boot, seed=seed)
        for e in np.flatnonzero(sizes > 0).tolist():
            part = slice(q_start[e], q_start[e + 1])
            replicates[e] = pearson_from(resample_counts(int(sizes[e]), n_boot, seed) @ sums_list[e])
            predicted, truth = x[part], y[part]
            with np.errstate(invalid="ignore", divide="ignore"):
                metrics[e] = {"rsquared": float(1 - np.mean((truth - predicted) ** 2) / np.mean(truth ** 2)),
                              "absolute_dev_explained": float(1 - np.mean(np.abs(truth - predicted))
                                                              / np.mean(np.abs(truth)))}
        low, high = hulls(row_quantiles(replicates), shifted_intervals(scores, nulls, chance=0.0, fisher=True),
                          bounds=(-1.0, 1.0))
        p = permutation_ps(observed, nulls)
        return scores, low, high, p, metrics, dict(observed=observed, nulls=nulls, replicates=replicates)
    # classification: the nulls of all tasks with the same number of queries in one product (equal, row by row,
    # to classification_null's), the bootstrap intervals by bootstrap_many, the rest per task from the totals
    low, high = bootstrap_many(balanced_accuracy_from, sums_list, n_boot=n_boot, seed=seed, exact_sums=True)
    swap = scorer == "fuzzing"
    by_size: dict[int, list[int]] = {}
    for e in range(n_eval):
        if sizes[e]:
            by_size.setdefault(int(lengths[e]), []).append(e)
    for members in by_size.values():
        for begin in range(0, len(members), 256):
            batch = members[begin:begin + 256]
            truth = np.stack([t[q_start[e]:q_start[e + 1]] for e in batch])
            answers = np.stack([fires[q_start[e]:q_start[e + 1]] for e in batch])
            group = tasks.group[query[q_start[batch[0]]:q_start[batch[0] + 1]]]
            nulls[batch] = classification_nulls(truth, answers, group, swap=swap, n_perm=n_boot, seed=seed)
    for e in range(n_eval):
        metrics_e = classification_metrics(totals[e])
        metrics[e] = {"precision": float(metrics_e["precision"]), "recall": float(metrics_e["recall"]),
                      "f1": float(metrics_e["f1"]), "auc": float(scores[e])}
        if sizes[e]:
            p[e] = swap_p(sums_list[e]) if swap else hypergeometric_p(totals[e])
    low, high = hulls((low, high), shifted_intervals(scores, nulls, chance=0.5), bounds=(0.0, 1.0))
    return scores, low, high, p, metrics, dict(sums=sums_list, nulls=nulls)


def _output_tasks(table) -> _Tasks:
    """The output scorer's tasks of all sides: each side's held-out written tokens (truth: written) then its
    held-out opposed ones (truth: not), one query and one example each; codes are their token ids."""
    tokens, truth, codes, n = [], [], [], []
    for written, opposed in zip(table.held_writes, table.held_opposes):
        held = [(t, True) for t in written] + [(t, False) for t in opposed]
        tokens.extend(t.token for t, _ in held)
        truth.extend(w for _, w in held)
        codes.append(tuple(t.id for t, _ in held))
        n.append(len(held))
    n = np.asarray(n, np.int64)
    start = np.r_[0, np.cumsum(n)]
    group = np.arange(int(start[-1])) - np.repeat(start[:-1], n)
    return _Tasks(example=np.repeat(np.arange(len(n)), n), position=group, truth=np.asarray(truth, bool),
                  group=group, start=start, codes=codes, n=n, tokens=tokens)


def _writes(tasks: _Tasks, evaluations, rules) -> np.ndarray:
    """Whether each rule's ``writes`` hold each queried token (the tokens judge's output answer), per evaluation."""
    out = []
    for s, r in evaluations:
        out.extend(rules[r].writes_token(t) for t in tasks.tokens[tasks.start[s]:tasks.start[s + 1]])
    return np.asarray(out, bool)


def score_layer(table, keys: KeyTables, scorer: str, rows_side: np.ndarray, rules_of_rows: list,
                borrowed_rules: list, *, per_band: int = PER_BAND, seed: int = 0, n_boot: int = N_BOOT,
                max_quiet: int | None = None) -> ScoredRows:
    """Score R rows of one layer with the tokens judge. ``rows_side`` [R]: each row's side in ``table``;
    ``rules_of_rows`` [R]: its :class:`Rule`; ``borrowed_rules`` [R]: the rule its derangement baseline applies
    (None: no baseline). Equal to the scorer module's ``build`` + ``TokensJudge`` + ``evaluate`` per row."""
    if scorer not in FAST_SCORERS:
        raise KvmemError(f"unknown scorer {scorer!r}; choose from {', '.join(FAST_SCORERS)}")
    if scorer == "output":
        tasks = _output_tasks(table)
    else:
        tasks = _tasks(table, scorer, per_band=per_band, seed=seed, max_quiet=max_quiet)
    compiled, index = [], {}
    for rule in list(rules_of_rows) + [r for r in borrowed_rules if r is not None]:
        if id(rule) not in index:
            index[id(rule)] = len(compiled)
            compiled.append(rule if scorer == "output" else keys.rule_keys(rule))
    evaluations = [(int(s), index[id(r)]) for s, r in zip(rows_side, rules_of_rows)]
    with_base = np.asarray([i for i, r in enumerate(borrowed_rules) if r is not None], np.int64)
    evaluations += [(int(rows_side[i]), index[id(borrowed_rules[i])]) for i in with_base]
    if scorer == "output":
        fired = _writes(tasks, evaluations, compiled)
    else:
        fired = _fires(table, keys, tasks, evaluations, compiled)
    score, low, high, p, metrics, kept = _evaluate(scorer, tasks, evaluations, fired, seed=seed, n_boot=n_boot)
    n_rows = len(rows_side)
    base, base_low, base_high, diff_low, diff_high = (np.full(n_rows, np.nan) for _ in range(5))
    base[with_base], base_low[with_base], base_high[with_base] = score[n_rows:], low[n_rows:], high[n_rows:]
    # each row's score minus its baseline's: the hull of the paired bootstrap (the same draws for both) and the
    # shift interval of the difference's null (both answer vectors re-paired by the same draws)
    lender = n_rows + np.arange(len(with_base))
    sized = tasks.n[np.asarray(rows_side, np.int64)[with_base]] > 0
    own, other = with_base[sized], lender[sized]
    observed = kept["observed"] if scorer == "simulation" else score
    shifted = shifted_intervals(observed[own] - observed[other], kept["nulls"][own] - kept["nulls"][other], chance=0.0)
    if scorer == "simulation":
        boot = row_quantiles(kept["replicates"][own] - kept["replicates"][other])
        diff_low[own], diff_high[own] = hulls(boot, shifted, bounds=(-2.0, 2.0))
    else:
        boot = paired_bootstrap_many(balanced_accuracy_from, [kept["sums"][i] for i in own],
                                     [kept["sums"][i] for i in other], n_boot=n_boot, seed=seed)
        diff_low[own], diff_high[own] = hulls(boot, shifted, bounds=(-1.0, 1.0))
    n_quiet = np.full(n_rows, -1, np.int64)
    if scorer == "detection":
        quiet = np.bincount(table.owner[tasks.example[~np.asarray(tasks.truth, bool)]], minlength=len(table.side))
        n_quiet = quiet[rows_side]
    return ScoredRows(score=score[:n_rows], low=low[:n_rows], high=high[:n_rows], p=p[:n_rows], n=tasks.n[rows_side],
                      n_quiet=n_quiet, metrics=metrics[:n_rows], codes=[tasks.codes[s] for s in rows_side],
                      baseline=base, baseline_low=base_low, baseline_high=base_high, diff_low=diff_low,
                      diff_high=diff_high)
