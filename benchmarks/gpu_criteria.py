"""The criteria of ``gpu_check.py``: when two scans of one model agree (a device against the CPU), and
when a bfloat16 scan is close enough to a float32 one.

Agreement is judged where it is decidable. Two float32 scans on different devices round differently,
so two coefficients within the tolerance of each other may swap ranks, and a run of near-equal
coefficients (GELU's floor at about -0.17 ties most bottom triggers of a random-init GPT-2) may keep
different positions. Per kind of trigger (top, bottom, and the per-document top_doc, bottom_doc):

- a *tie group* is a run of kept entries, in rank order, each within twice the tolerance of the one
  before (on the reference);
- an entry alone in its group is compared by position at its rank;
- a group of several, entirely inside the kept list, is compared as a set of positions over its ranks;
- the group holding the last kept rank of a full list is not decidable by position (what came after
  it was not kept); its entries on the device must lie within the tolerance of the tied values;
- a kind is judged on its decidable entries, and the check passes only if at least one kind has at
  least MIN_DECIDED of its entries decidable (else it would pass vacuously).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

# a device against the CPU, float32: |device - cpu| <= ATOL + RTOL * |cpu| for statistics, kept activations, scores
RTOL, ATOL = 1e-4, 1e-5
HIST_MOVED = 1e-3  # at most this fraction of histogram counts in another bin (a value on a bin edge may flip)
MIN_DECIDED = 0.5  # entries judged by position must be at least this fraction of one kind's (else vacuous)
AGREEMENT = ("statistics", "histogram", "trigger positions", "trigger activations", "value top tokens")
# bfloat16 against float32 (8 significant bits): per-neuron std and max within BF16_RTOL for >= BF16_SHARE of neurons
BF16_RTOL, BF16_SHARE = 5e-2, 0.95

__all__ = ["RTOL", "ATOL", "HIST_MOVED", "MIN_DECIDED", "AGREEMENT", "BF16_RTOL", "BF16_SHARE", "Criterion",
           "compare", "compare_bf16", "tie_groups", "judged"]


class Criterion(NamedTuple):
    name: str
    measured: str
    limit: str
    ok: bool


def judged(criteria: list[Criterion]) -> tuple[str, str]:
    return ("ok" if all(c.ok for c in criteria) else "FAIL",
            "; ".join(f"{c.name}: {c.measured} ({c.limit}){'' if c.ok else ' FAIL'}" for c in criteria))


def _tolerance(values) -> np.ndarray:
    return ATOL + RTOL * np.abs(np.asarray(values, dtype=np.float64))


def tie_groups(frame: pd.DataFrame, key: list[str], column: str = "activation") -> pd.DataFrame:
    """For ``frame`` sorted by ``key`` + rank: each row's tie ``group`` (an integer, runs of rows each
    within twice the tolerance of the one before), and whether that group is ``undecidable`` (it holds
    the last rank of a list as long as the longest of its kind: a full list)."""
    value = frame[column].to_numpy(np.float64)
    grouped = frame.groupby(key, sort=False)
    before = grouped[column].shift(1).to_numpy(np.float64)
    starts = np.isnan(before) | (np.abs(value - before) > 2 * _tolerance(value))
    group = np.cumsum(starts)
    size = grouped[column].transform("size").to_numpy()
    position = grouped.cumcount().to_numpy()
    full = size == _longest_by_kind(frame, size)
    last_group = pd.Series(np.where(position == size - 1, group, -1)).groupby(
        [frame[k].to_numpy() for k in key]).transform("max").to_numpy()
    return pd.DataFrame({"group": group, "undecidable": full & (group == last_group)}, index=frame.index)


def _longest_by_kind(frame: pd.DataFrame, size: np.ndarray) -> np.ndarray:
    """Each row's kind's longest kept list (top_k, or fewer when fewer positions were read)."""
    return pd.Series(size, index=frame.index).groupby(frame["kind"].to_numpy()).transform("max").to_numpy()


def _trigger_positions(cpu: pd.DataFrame, device: pd.DataFrame, kinds: tuple[str, ...]) -> Criterion:
    key = ["layer", "neuron", "kind"]
    a = cpu[cpu.kind.isin(kinds)].sort_values([*key, "rank"]).reset_index(drop=True)
    b = device[device.kind.isin(kinds)].set_index([*key, "rank"]).reindex(pd.MultiIndex.from_frame(a[[*key, "rank"]]))
    groups = tie_groups(a, key)
    where_a = a.doc.to_numpy(np.int64) << 32 | a.pos.to_numpy(np.int64)
    where_b = np.where(b.doc.isna(), -1, b.doc.fillna(0).to_numpy(np.int64) << 32 | b.pos.fillna(0).to_numpy(np.int64))
    decidable = ~groups.undecidable.to_numpy()
    group = groups.group.to_numpy()
    # a group's positions as a set: sorted within the group, then compared row by row
    order = np.lexsort((where_a, group))
    order_b = np.lexsort((where_b, group))
    same = np.empty(len(a), dtype=bool)
    same[order] = where_a[order] == where_b[order_b]
    wrong = decidable & ~same
    # undecidable groups: the device's activations within the tolerance of the tied values
    act_a, act_b = a.activation.to_numpy(np.float64), b.activation.to_numpy(np.float64)
    spans = pd.DataFrame({"group": group, "low": act_a, "high": act_a})[~decidable].groupby("group")
    low, high = spans.low.min(), spans.high.max()
    undecided = ~decidable
    g = group[undecided]
    outside = (act_b[undecided] < low.reindex(g).to_numpy() - _tolerance(low.reindex(g))) | (
        act_b[undecided] > high.reindex(g).to_numpy() + _tolerance(high.reindex(g)))
    parts, best = [], 0.0
    for kind in kinds:
        mine = (a.kind == kind).to_numpy()
        if not mine.any():
            continue
        share = float(decidable[mine].mean())
        best = max(best, share)
        parts.append(f"{kind} {int(wrong[mine].sum())} of {int(decidable[mine].sum())} differ ({share:.0%} decidable)")
    bad_ties = int(np.isnan(act_b[undecided]).sum() + outside.sum())
    ok = not wrong.any() and bad_ties == 0 and best >= MIN_DECIDED
    return Criterion("trigger positions", ", ".join(parts) + f"; {bad_ties} undecidable entries off their tie",
                     f"0, 0, some kind >= {MIN_DECIDED:.0%} decidable", ok)


def compare(cpu: dict[str, pd.DataFrame], device: dict[str, pd.DataFrame],
            kinds: tuple[str, ...] = ("top", "bottom")) -> list[Criterion]:
    """The agreement criteria (:data:`AGREEMENT`, in order) of two scans of one model: ``cpu`` the reference.

    - statistics: the same count per neuron, mean / std / min / max within ATOL + RTOL |cpu|;
    - histogram: at most HIST_MOVED of all counts in another bin;
    - trigger positions: per kind of ``kinds``, the decidable entries at the same positions (see the
      module docstring), the undecidable ones within the tolerance of their tie;
    - trigger activations: every (layer, neuron, kind, doc, pos) kept by both within ATOL + RTOL |cpu|;
    - value top tokens: the same top promoted token of every (layer, neuron, convention) whose top two
      scores are farther apart than twice the tolerance; at least MIN_DECIDED of the rows are so.
    """
    out = []
    a, b = cpu["neurons"].set_index(["layer", "neuron"]), device["neurons"].set_index(["layer", "neuron"])
    b = b.reindex(a.index)
    worst = max(float(np.nanmax(np.abs(a[c].to_numpy(np.float64) - b[c].to_numpy(np.float64)) / _tolerance(a[c])))
                for c in ("mean", "std", "min", "max"))
    same_count = bool((a["count"] == b["count"]).all())
    out.append(Criterion("statistics", f"worst {worst:.2f} of tolerance, counts {'equal' if same_count else 'DIFFER'}",
                         f"<= 1 (rtol {RTOL:g}, atol {ATOL:g})", same_count and worst <= 1))

    ha, hb = (np.stack(t["histograms"].sort_values(["layer", "neuron"]).counts.to_numpy()) for t in (cpu, device))
    moved = float(np.abs(ha - hb).sum() / 2 / max(ha.sum(), 1))
    out.append(Criterion("histogram", f"{moved:.2e} of counts moved", f"<= {HIST_MOVED:g}", moved <= HIST_MOVED))

    out.append(_trigger_positions(cpu["triggers"], device["triggers"], kinds))

    join = ["layer", "neuron", "kind", "doc", "pos"]
    both = cpu["triggers"][cpu["triggers"].kind.isin(kinds)].merge(
        device["triggers"][device["triggers"].kind.isin(kinds)][join + ["activation"]], on=join, suffixes=("", "_d"))
    diff = np.abs(both.activation.to_numpy(np.float64) - both.activation_d.to_numpy(np.float64)) / _tolerance(
        both.activation)
    worst_act = float(diff.max()) if len(diff) else float("inf")
    out.append(Criterion("trigger activations", f"worst {worst_act:.2f} of tolerance at {len(both)} kept by both",
                         "<= 1", worst_act <= 1))

    vkey = ["layer", "neuron", "convention"]
    va = cpu["values"][(cpu["values"].kind == "promote") & (cpu["values"]["rank"] <= 1)]
    va = va.sort_values([*vkey, "rank"]).reset_index(drop=True)
    first = va[va["rank"] == 0].reset_index(drop=True)
    second = va[va["rank"] == 1].set_index(vkey).score.reindex(pd.MultiIndex.from_frame(first[vkey]))
    free_v = np.abs(first.score.to_numpy(np.float64) - second.to_numpy(np.float64)) > 2 * _tolerance(first.score)
    vb = device["values"][(device["values"].kind == "promote") & (device["values"]["rank"] == 0)].set_index(vkey)
    token_b = vb.token_id.reindex(pd.MultiIndex.from_frame(first[vkey])).to_numpy()
    wrong_v, share_v = int((free_v & (first.token_id.to_numpy() != token_b)).sum()), float(free_v.mean())
    out.append(Criterion("value top tokens", f"{wrong_v} of {int(free_v.sum())} tie-free differ ({share_v:.0%} tie-free)",
                         f"0, >= {MIN_DECIDED:.0%} tie-free", wrong_v == 0 and share_v >= MIN_DECIDED))
    return out


def compare_bf16(reference: dict[str, pd.DataFrame], bf16: dict[str, pd.DataFrame]) -> list[Criterion]:
    """bfloat16 against float32: finite statistics, equal counts, std and max within BF16_RTOL for
    at least BF16_SHARE of the neurons."""
    a, b = (t["neurons"].set_index(["layer", "neuron"]).sort_index() for t in (reference, bf16))
    finite = bool(np.isfinite(b[["mean", "std", "min", "max"]].to_numpy(np.float64)).all())
    out = [Criterion("finite, counts", f"{'finite' if finite else 'NOT FINITE'}, counts "
                     f"{'equal' if (a['count'] == b['count']).all() else 'DIFFER'}", "finite, equal",
                     finite and bool((a["count"] == b["count"]).all()))]
    for column in ("std", "max"):
        rel = np.abs(b[column] - a[column]) / np.maximum(np.abs(a[column]), 1e-6)
        share = float((rel <= BF16_RTOL).mean())
        out.append(Criterion(f"{column} within {BF16_RTOL:g}", f"{share:.1%} of neurons (median {float(rel.median()):.1e})",
                             f">= {BF16_SHARE:.0%}", share >= BF16_SHARE))
    return out
