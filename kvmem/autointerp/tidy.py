"""The explanation scores as people read them: one row per side and scorer, and the random-init population.

``explanations.parquet`` is wide (every scorer's fields side by side, for programs). :func:`score_table`
gives the same numbers one row per (layer, neuron, side, explainer, scorer) with the few columns a reader
needs; :meth:`kvmem.atlas.Atlas.explanation_scores` returns it for an atlas, and ``kvmem neuron``, the
reports and the explorer show it. :func:`random_init_reference` summarises a layer's random-init
scores as a distribution: neuron i of a random-init copy has nothing to do with neuron i of the trained
model, so a score is read against the population, never against its row's random-init number.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from kvmem.autointerp.scorers import SCORERS

__all__ = ["score_table", "random_init_reference", "percentile_of", "TIDY_COLUMNS"]

TIDY_COLUMNS: dict[str, str] = {
    "layer": "FFN layer", "neuron": "neuron", "side": "positive | negative (memory of a gated neuron)",
    "explainer": "who wrote the explanation", "text": "the explanation",
    "scorer": "detection, fuzzing, simulation, embedding (input: when it fires) | output, intervention (what it writes)",
    "aspect": "input | output", "protocol": "kvmem | delphi | neuron-explainer",
    "score": "the score (NaN when the side was not scorable: see status)",
    "low": "95% interval, lower end", "high": "upper end",
    "p": "one-sided p-value under the side's permutation null",
    "n": "held-out examples scored", "n_quiet": "of them non-activating (detection)",
    "status": "ok | few-quiet | few-examples",
    "baseline": "the same examples judged with another neuron's explanation (derangement)",
    "diff_low": "95% interval of score minus baseline (paired), lower end", "diff_high": "upper end",
    "chance": "the score of an explanation that says nothing (0.5, or 0 for simulation)",
    "f1": "F1 (classification scorers)", "auc": "AUC (classification scorers, embedding)",
    "judge": "who answered the scorer's queries",
}


def _chance(name: str) -> float:
    return 0.0 if name == "simulation" else 0.5


def score_table(frame: pd.DataFrame, *, scorers=None) -> pd.DataFrame:
    """One row per stored (side, explainer) and scorer that has been scored, columns :data:`TIDY_COLUMNS`, from
    rows of ``explanations.parquet`` (:func:`kvmem.autointerp.explanations`, :meth:`Atlas.explanations`)."""
    parts = []
    names = [s for s in (scorers or SCORERS) if f"{s}_n" in frame.columns]
    for name in names:
        done = frame[(frame[f"{name}_n"] >= 0) | (frame[f"{name}_status"] != "")]
        if not len(done):
            continue
        metrics = [json.loads(m) if m else {} for m in done[f"{name}_metrics"]]
        parts.append(pd.DataFrame({
            "layer": done.layer.to_numpy(), "neuron": done.neuron.to_numpy(), "side": done.side.to_numpy(),
            "explainer": done.explainer.to_numpy(), "text": done.text.to_numpy(), "scorer": name,
            "aspect": SCORERS[name].ASPECT, "protocol": done[f"{name}_protocol"].to_numpy(),
            "score": done[name].to_numpy(), "low": done[f"{name}_low"].to_numpy(),
            "high": done[f"{name}_high"].to_numpy(), "p": done[f"{name}_p"].to_numpy(),
            "n": done[f"{name}_n"].to_numpy(), "n_quiet": done[f"{name}_n_quiet"].to_numpy(),
            "status": done[f"{name}_status"].to_numpy(), "baseline": done[f"{name}_baseline"].to_numpy(),
            "diff_low": done[f"{name}_diff_low"].to_numpy(), "diff_high": done[f"{name}_diff_high"].to_numpy(),
            "chance": _chance(name),
            "f1": [np.nan if m.get("f1") is None else m["f1"] for m in metrics],
            "auc": [np.nan if m.get("auc") is None else m["auc"] for m in metrics] if name != "embedding"
            else done[name].to_numpy(),
            "judge": done[f"{name}_judge"].to_numpy()}))
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in TIDY_COLUMNS})
    out = pd.concat(parts, ignore_index=True)
    order = {s: i for i, s in enumerate(SCORERS)}
    out["_order"] = out.scorer.map(order)
    out = out.sort_values(["layer", "neuron", "side", "explainer", "_order"], kind="stable").drop(columns="_order")
    return out[list(TIDY_COLUMNS)].reset_index(drop=True)


def random_init_reference(frame: pd.DataFrame, *, layer: int, side: str, explainer: str, scorer: str) -> dict | None:
    """The random-init scores of one layer, side, explainer and scorer as a population: n sides, quartiles, and
    the share of them a score would beat (:func:`percentile_of`); None when none is stored. ``frame``: the
    atlas's explanations (every neuron of the layer that was scored with ``baseline="random-init"``)."""
    column = f"{scorer}_random_init"
    if column not in frame.columns:
        return None
    part = frame[(frame.layer == layer) & (frame.side == side) & (frame.explainer == explainer)][column]
    values = np.sort(part.to_numpy(np.float64))
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    q1, median, q3 = np.quantile(values, [0.25, 0.5, 0.75])
    return {"n": int(len(values)), "q1": float(q1), "median": float(median), "q3": float(q3), "values": values}


def percentile_of(reference: dict, value: float) -> float:
    """The share of the reference population's scores strictly below ``value`` (ties count half)."""
    values = reference["values"]
    below = np.searchsorted(values, value, side="left")
    at = np.searchsorted(values, value, side="right") - below
    return float((below + at / 2) / len(values))
