"""Search neurons: by a token their value promotes or suppresses, a token they fire on (or right before), a
regular expression over their trigger contexts or explanations, a taxonomy class, or an explanation score
range; every result sortable and paginated.

:func:`run_search` answers one :class:`Query` from a :class:`~kvmem.explorer.search_index.SearchIndex`;
the result is plain data (the page and ``/api/search`` show the same).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from kvmem.atlas_projections import missing_table_message
from kvmem.errors import KvmemError
from kvmem.explorer.search_index import SIDES, group_max, regex_mask
from kvmem.explorer.snapshot import SCORERS, TAXONOMY_FLAGS

__all__ = ["BY", "SORTS", "Query", "run_search", "MAX_PER_PAGE"]

BY: dict[str, str] = {
    "all": "every neuron (browse; narrow by layer, class or score)",
    "promotes": "a token its value promotes (among the kept top tokens of a convention)",
    "suppresses": "a token its value suppresses",
    "fires": "a token it fires on (the token at a kept trigger)",
    "precedes": "a token it fires right before (the token after a kept trigger)",
    "context": "a regular expression over its trigger contexts (RE2 syntax)",
    "explanation": "a regular expression over its explanations (case-insensitive)",
    "class": "a taxonomy class (prediction, suppression, entropy_candidate, dead, rare, positional, token_frequency)",
}
SORTS: dict[str, str] = {
    "match": "the match's own number: score, coefficient or class statistic",
    "count": "how many kept entries matched", "layer": "layer, then neuron", "max": "highest coefficient seen",
    "min": "lowest coefficient seen", "mean": "mean coefficient", "frac_positive": "share of positions with m > 0",
    "value_norm": "‖w_i‖", "score": "best explanation score of the chosen scorer",
}
# the taxonomy statistic each class is ranked by
CLASS_MEASURE = {"prediction": "vocab_kurtosis", "suppression": "vocab_kurtosis", "entropy_candidate": "null_space_fraction",
                 "dead": "freq_active", "rare": "freq_active", "positional": "position_correlation",
                 "token_frequency": "unigram_alignment"}
DEFAULT_SORT = {"all": "max", "promotes": "match", "suppresses": "match", "fires": "count", "precedes": "count",
                "context": "count", "explanation": "match", "class": "match"}
MAX_PER_PAGE = 500
_STATS = ("max", "min", "mean", "frac_positive", "value_norm")


@dataclass(frozen=True, kw_only=True)
class Query:
    """One search. ``q``: the token, pattern or class; ``layer``: one layer or None; ``side``: top or bottom
    triggers; ``taxonomy``: keep only neurons of this class; ``scorer``/``score_min``/``score_max``: keep only
    neurons whose best explanation score lies in the range; ``sort``/``order``/``page``/``per_page``."""

    q: str = ""
    by: str = "all"
    layer: int | None = None
    side: str = "top"
    convention: str | None = None
    taxonomy: str | None = None
    scorer: str = "detection"
    score_min: float | None = None
    score_max: float | None = None
    sort: str | None = None
    order: str | None = None
    page: int = 1
    per_page: int = 50

    def check(self, snapshot) -> None:
        if self.by not in BY:
            raise KvmemError(f"unknown search by={self.by!r}; choose one of {', '.join(BY)}")
        if self.by not in ("all",) and not self.q.strip() and self.by != "class":
            raise KvmemError(f"searching by {self.by} needs a query (q=...)")
        if self.side not in SIDES:
            raise KvmemError(f"side must be one of {', '.join(SIDES)}, got {self.side!r}")
        if self.sort is not None and self.sort not in SORTS:
            raise KvmemError(f"unknown sort {self.sort!r}; choose one of {', '.join(SORTS)}")
        if self.order not in (None, "asc", "desc"):
            raise KvmemError(f"order must be asc or desc, got {self.order!r}")
        if self.scorer not in SCORERS:
            raise KvmemError(f"unknown scorer {self.scorer!r}; choose one of {', '.join(SCORERS)}")
        for flag in (self.taxonomy, self.q if self.by == "class" else None):
            if flag is not None and flag not in TAXONOMY_FLAGS:
                raise KvmemError(f"unknown taxonomy class {flag!r}; choose one of {', '.join(TAXONOMY_FLAGS)}")
        if (self.taxonomy or self.by == "class") and snapshot.taxonomy is None:
            raise KvmemError(f"this atlas has no taxonomy table; write one with: kvmem taxonomy --atlas {snapshot.path}")
        if not 1 <= self.per_page <= MAX_PER_PAGE:
            raise KvmemError(f"per_page must be 1..{MAX_PER_PAGE}, got {self.per_page}")
        if self.page < 1:
            raise KvmemError(f"page must be 1 or more, got {self.page}")
        if self.layer is not None:
            snapshot.check_neuron(self.layer)

    def to_dict(self) -> dict:
        return asdict(self)


def _candidates(index, query: Query, convention: str) -> tuple[pd.DataFrame, str]:
    """Matched neurons: columns flat, count, match (the number), example (int: trigger row, rank or explanation
    row); and a note on how the query was read."""
    snapshot = index.snapshot
    if query.by == "all":
        flat = np.arange(snapshot.n_neurons)
        return pd.DataFrame({"flat": flat, "count": 1, "match": np.nan, "example": -1}), "every neuron"
    if query.by in ("promotes", "suppresses", "fires", "precedes"):
        if query.by in ("fires", "precedes"):
            index.triggers()  # the positions' tokens join the vocabulary
        else:
            if not snapshot.has("values"):
                raise KvmemError(missing_table_message(snapshot.path, "values", ", and a search by a promoted or "
                                                       "suppressed token reads every neuron's"))
            index.values(convention)
        token = index.vocabulary.match(query.q)
        if query.by in ("promotes", "suppresses"):
            kind = "promote" if query.by == "promotes" else "suppress"
            keys, counts, best, example = index.value_hits(token.ids, convention, kind)
            note = f"{token.note}; values projected as {convention}"
        else:
            keys, counts, best, example = index.trigger_hits(token.ids, query.side, following=query.by == "precedes")
            note = f"{token.note}; {query.side} triggers"
        return pd.DataFrame({"flat": keys, "count": counts, "match": best, "example": example}), note
    if query.by == "context":
        keys, counts, best, example = index.context_hits(query.q, query.side)
        return (pd.DataFrame({"flat": keys, "count": counts, "match": best, "example": example}),
                f"{query.side} trigger contexts matching /{query.q}/")
    if query.by == "explanation":
        e = index.explanations()
        rows = np.flatnonzero(regex_mask(e["text"], query.q, ignore_case=True))
        score = np.where(np.isfinite(e[query.scorer][rows]), e[query.scorer][rows], -np.inf)
        keys, counts, best, at = group_max(e["flat"][rows].astype(np.int64), score)
        best = np.where(np.isfinite(best), best, np.nan)
        return (pd.DataFrame({"flat": keys, "count": counts, "match": best, "example": rows[at] if len(rows) else at}),
                f"explanations matching /{query.q}/ (case-insensitive); match = best {query.scorer} score")
    tax = snapshot.taxonomy  # by == "class"
    keep = tax[query.q].to_numpy(dtype=bool, na_value=False)
    measure = CLASS_MEASURE[query.q]
    flat = index.flat_of(tax.layer.to_numpy()[keep], tax.neuron.to_numpy()[keep])
    return (pd.DataFrame({"flat": flat, "count": 1, "match": tax[measure].to_numpy(dtype=float)[keep], "example": -1}),
            f"taxonomy class {query.q}; match = {measure}")


def run_search(index, query: Query) -> dict:
    """The page of results of ``query``: {query, note, total, page, pages, rows: [...]}."""
    snapshot = index.snapshot
    query.check(snapshot)
    convention = query.convention or snapshot.atlas.default_convention
    if convention not in snapshot.atlas.conventions:
        raise KvmemError(f"convention {convention!r} is not in this atlas; it has {', '.join(snapshot.atlas.conventions)}")
    found, note = _candidates(index, query, convention)
    flat = found["flat"].to_numpy(np.int64)
    layers = np.asarray(snapshot.layers)
    found["layer"] = layers[flat // snapshot.d_ff]
    found["neuron"] = flat % snapshot.d_ff
    keep = np.ones(len(found), bool)
    if query.layer is not None:
        keep &= found["layer"].to_numpy() == query.layer
    if query.taxonomy is not None:
        tax = snapshot.taxonomy
        flags = np.zeros(snapshot.n_neurons, bool)
        flags[index.flat_of(tax.layer.to_numpy(), tax.neuron.to_numpy())] = tax[query.taxonomy].to_numpy(dtype=bool,
                                                                                                         na_value=False)
        keep &= flags[flat]
    explanations = index.explanations()
    best_score = explanations["best"][query.scorer][flat]
    if query.score_min is not None or query.score_max is not None:
        low = -math.inf if query.score_min is None else query.score_min
        high = math.inf if query.score_max is None else query.score_max
        keep &= np.isfinite(best_score) & (best_score >= low) & (best_score <= high)
        note += f"; best {query.scorer} score in [{low:g}, {high:g}]"
    found = found.assign(score=best_score)[keep]
    stats = snapshot.neurons
    for column in _STATS:
        found[column] = stats[column].to_numpy()[found["flat"].to_numpy(np.int64)]
    sort = query.sort or DEFAULT_SORT[query.by]
    lower_first = query.by == "suppresses" or (query.by in ("fires", "precedes", "context") and query.side == "bottom")
    if query.order:
        ascending = query.order == "asc"
    else:
        ascending = sort in ("layer", "min") or (sort == "match" and lower_first)
    if sort == "count":  # ties by the match, best first
        keys, directions = ["count", "match"], [ascending, lower_first]
    elif sort == "layer":
        keys, directions = ["layer", "neuron"], [ascending, ascending]
    else:
        keys, directions = [sort, "layer", "neuron"], [ascending, True, True]
    ordered = found.sort_values(keys, ascending=directions, kind="stable", na_position="last")
    total = len(ordered)
    pages = max(1, math.ceil(total / query.per_page))
    page = ordered.iloc[(query.page - 1) * query.per_page: query.page * query.per_page]
    rows = [_row(index, query, convention, record, explanations) for record in page.to_dict("records")]
    return {"query": query.to_dict(), "convention": convention, "note": note, "total": total, "page": query.page,
            "pages": pages, "sort": sort, "order": "asc" if ascending else "desc", "rows": rows,
            "columns": {"match": _match_label(query)}}


def _match_label(query: Query) -> str:
    return {"all": "", "promotes": "score", "suppresses": "score", "fires": "best m", "precedes": "best m",
            "context": "best m", "explanation": f"{query.scorer}", "class": CLASS_MEASURE.get(query.q, "")}[query.by]


def _clean(value):
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _row(index, query: Query, convention: str, record: dict, explanations: dict) -> dict:
    flat = int(record["flat"])
    text = index.vocabulary.text
    values = index.values(convention)
    row = {"layer": int(record["layer"]), "neuron": int(record["neuron"]), "count": int(record["count"]),
           "match": _clean(record["match"]), "score": _clean(record["score"]),
           **{column: _clean(record[column]) for column in _STATS}}
    top = int(values["top_token"][flat])
    row["promotes"] = text.get(top) if top >= 0 else None
    if index.has_triggers or query.by in ("fires", "precedes", "context"):
        trigger = int(index.triggers()["top_trigger_token"][flat])
        row["top_trigger"] = text.get(trigger) if trigger >= 0 else None
    example = int(record["example"])
    if query.by in ("fires", "precedes", "context") and example >= 0:
        row["example"] = index.trigger_example(example)
    elif query.by in ("promotes", "suppresses"):
        row["example"] = {"rank": example}
    first = explanations["first"].get(flat) if query.by != "explanation" or example < 0 else example
    if first is not None:
        row["explanation"] = explanations["text"][first].as_py()
    return row
