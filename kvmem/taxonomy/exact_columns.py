"""Taxonomy columns computed exactly from an atlas's existing tables (no model, no approximation).

- Activation frequencies: the histogram's bin edges are fixed (2^e and 1.5·2^e, see
  :mod:`kvmem.scanning.bins`) and every threshold is one of them, so "m >= e" and "m <= −e" are
  unions of whole bins and their counts are exact integers. Bins b >= 30 are [edges[b], edges[b+1]),
  bins b < 30 are (edges[b], edges[b+1]].
- Token detector: a sum over the neuron's kept top triggers (all top_k of them are in triggers.parquet).
- Self-suppression: a lookup in the value's top_n suppressed tokens under one convention: the atlas's
  values table, or, for a lazily scanned atlas, that convention's rows of each layer
  (:meth:`kvmem.atlas.Atlas.projection_rows`: kept rows of the per-model cache, or computed for the one
  convention and kept), never the whole tables of every convention and the keys.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvmem.errors import KvmemError
from kvmem.scanning.bins import HIST_BINS, bin_edges
from kvmem.taxonomy.thresholds import Thresholds

__all__ = ["NOT_KEPT", "activation_frequencies", "count_at_least", "count_at_most", "evidence_columns",
           "self_suppression", "suppressed_values", "token_detector"]

NOT_KEPT = -1  # self_suppression_rank when the token is not among the kept suppressed tokens
_EDGES = np.asarray(bin_edges())  # [HIST_BINS + 1]
_HALF = HIST_BINS // 2


def count_at_least(counts: np.ndarray, edge: float) -> np.ndarray:
    """Positions with m >= edge, exactly, from histogram counts [n, HIST_BINS] (edge: a positive bin edge)."""
    low = _EDGES[_HALF:-1]  # lower edges of the non-negative bins
    if edge not in low:
        raise KvmemError(f"{edge!r} is not a positive histogram edge; counts above it would not be exact")
    return counts[:, _HALF:][:, low >= edge].sum(axis=1)


def count_at_most(counts: np.ndarray, edge: float) -> np.ndarray:
    """Positions with m <= −edge, exactly, from histogram counts [n, HIST_BINS] (edge: a positive bin edge)."""
    high = _EDGES[1:_HALF + 1]  # upper edges of the negative bins
    if -edge not in high:
        raise KvmemError(f"{edge!r} is not a positive histogram edge; counts below −edge would not be exact")
    return counts[:, :_HALF][:, high <= -edge].sum(axis=1)


def activation_frequencies(neurons: pd.DataFrame, histograms: pd.DataFrame, thresholds: Thresholds) -> pd.DataFrame:
    """freq_weak / freq_active / freq_strong (share of positions with |m| >= the edge), freq_positive_active
    (m >= active_edge), max_abs, dead and rare, one row per row of ``neurons`` (same order)."""
    merged = neurons[["layer", "neuron", "count", "min", "max", "frac_positive"]].merge(
        histograms[["layer", "neuron", "counts"]], on=["layer", "neuron"], how="left", validate="one_to_one")
    if merged.counts.isna().any():
        raise KvmemError("the atlas's histograms table lacks some neurons of its neurons table; it is damaged, scan again")
    counts = np.stack(merged.counts.to_numpy()).astype(np.int64)  # [n, HIST_BINS]
    total = merged["count"].to_numpy(np.int64)
    if not np.array_equal(counts.sum(axis=1), total):
        raise KvmemError("the atlas's histogram counts do not add up to the positions scanned; it is damaged, scan again")
    denominator = np.where(total > 0, total, 1).astype(np.float64)

    def share_abs(edge: float) -> np.ndarray:
        return (count_at_least(counts, edge) + count_at_most(counts, edge)) / denominator

    out = pd.DataFrame({"layer": merged.layer.to_numpy(), "neuron": merged.neuron.to_numpy(),
                        "positions": total,
                        "frac_positive": merged.frac_positive.to_numpy(np.float64),
                        "freq_weak": share_abs(thresholds.weak_edge),
                        "freq_active": share_abs(thresholds.active_edge),
                        "freq_strong": share_abs(thresholds.strong_edge),
                        "freq_positive_active": count_at_least(counts, thresholds.active_edge) / denominator,
                        "max_abs": np.maximum(np.abs(merged["min"].to_numpy(np.float64)),
                                              np.abs(merged["max"].to_numpy(np.float64)))})
    out["dead"] = out.freq_weak.to_numpy() == 0
    out["rare"] = ~out.dead.to_numpy() & (out.freq_active.to_numpy() < thresholds.rare_frequency)
    return out


def token_detector(triggers: pd.DataFrame) -> pd.DataFrame:
    """Per neuron with top triggers: detector_score = max_t M_t / Σ_t M_t, with M_t = Σ max(m, 0) over the
    neuron's kept ``top`` triggers whose token is t; detector_token_id = that t (ties: the smallest id);
    detector_triggers = kept top triggers. NaN score when no kept top trigger has m > 0."""
    top = triggers[triggers.kind.to_numpy() == "top"]
    mass = top.assign(mass=np.clip(top.activation.to_numpy(np.float64), 0, None))
    per_token = mass.groupby(["layer", "neuron", "token_id"], as_index=False, sort=True).mass.sum()
    totals = mass.groupby(["layer", "neuron"], as_index=False).agg(total=("mass", "sum"),
                                                                   detector_triggers=("mass", "size"))
    best = (per_token.sort_values(["layer", "neuron", "mass", "token_id"], ascending=[True, True, False, True],
                                  kind="stable")
            .drop_duplicates(["layer", "neuron"]))
    out = totals.merge(best, on=["layer", "neuron"], how="left")
    with np.errstate(invalid="ignore", divide="ignore"):
        score = out.mass.to_numpy(np.float64) / out.total.to_numpy(np.float64)
    positive = out.total.to_numpy() > 0
    return pd.DataFrame({"layer": out.layer.to_numpy(), "neuron": out.neuron.to_numpy(),
                         "detector_score": np.where(positive, score, np.nan),
                         "detector_token_id": np.where(positive, out.token_id.to_numpy(), -1).astype(np.int64),
                         "detector_triggers": out.detector_triggers.to_numpy(np.int64)})


def self_suppression(triggers: pd.DataFrame, values: pd.DataFrame, convention: str) -> pd.DataFrame:
    """Per neuron with a top trigger: top_trigger_token_id (the token at the rank-0 ``top`` trigger) and
    self_suppression_rank, its rank (0 = most suppressed) among the value's kept ``suppress`` tokens under
    ``convention``, or :data:`NOT_KEPT` when it is not among them."""
    if convention not in set(values.convention.unique()):
        raise KvmemError(f"convention {convention!r} is not in this atlas's values table; it has "
                         f"{', '.join(sorted(values.convention.unique()))}")
    first = triggers[(triggers.kind.to_numpy() == "top") & (triggers["rank"].to_numpy() == 0)]
    first = first[["layer", "neuron", "token_id"]].rename(columns={"token_id": "top_trigger_token_id"})
    suppressed = values[(values.convention.to_numpy() == convention) & (values.kind.to_numpy() == "suppress")]
    suppressed = suppressed[["layer", "neuron", "token_id", "rank"]].rename(
        columns={"token_id": "top_trigger_token_id", "rank": "self_suppression_rank"})
    out = first.merge(suppressed, on=["layer", "neuron", "top_trigger_token_id"], how="left")
    out["self_suppression_rank"] = out.self_suppression_rank.fillna(NOT_KEPT).astype(np.int64)
    return out.reset_index(drop=True)


def suppressed_values(atlas, convention: str, *, model=None) -> pd.DataFrame:
    """The values rows self-suppression reads: every neuron's kept ``suppress`` tokens under ``convention``
    (:meth:`kvmem.atlas.Atlas.value_rows`: the values table's, or each layer's computed for this convention alone
    and kept; ``model``: the scanned model, or None to load it from the manifest)."""
    if convention not in atlas.conventions:
        raise KvmemError(f"convention {convention!r} is not in this atlas's values table; it has "
                         f"{', '.join(sorted(atlas.conventions))}")
    return atlas.value_rows(convention, kind="suppress", model=model)[
        ["layer", "neuron", "convention", "kind", "rank", "token_id"]]


def evidence_columns(atlas, thresholds: Thresholds, *, convention: str, model=None) -> pd.DataFrame:
    """All atlas-derived columns, one row per (layer, neuron) of ``atlas.neurons``. ``model``: the scanned
    model, if at hand (a lazily scanned atlas computes its suppressed tokens with it)."""
    frequencies = activation_frequencies(atlas.neurons, atlas.table("histograms"), thresholds)
    triggers = atlas.table("triggers", ["layer", "neuron", "kind", "rank", "activation", "token_id", "token"])
    values = suppressed_values(atlas, convention, model=model)
    out = (frequencies.merge(token_detector(triggers), on=["layer", "neuron"], how="left")
           .merge(self_suppression(triggers, values, convention), on=["layer", "neuron"], how="left"))
    for column in ("detector_token_id", "top_trigger_token_id", "self_suppression_rank"):
        out[column] = out[column].fillna(-1).astype(np.int64)
    out["detector_triggers"] = out.detector_triggers.fillna(0).astype(np.int64)
    texts = dict(zip(triggers.token_id.to_numpy().tolist(), triggers.token.tolist()))
    out["detector_token"] = [texts.get(t) for t in out.detector_token_id.tolist()]
    out["top_trigger_token"] = [texts.get(t) for t in out.top_trigger_token_id.tolist()]
    return out
