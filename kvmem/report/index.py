"""The index of a report directory, linking to each neuron's report: one ``kvmem.index/1`` row per neuron.

Each format renders the rows its own way (``render_index`` in :mod:`kvmem.report.html` (sortable),
:mod:`kvmem.report.markdown`, :mod:`kvmem.report.jsonfmt`). The HTML table sorts when a heading
is clicked, or on load from the address: ``index.html#sort=max`` (descending) or
``#sort=layer-asc``; keys are report, layer, neuron, max, mean, frac_positive, value_norm,
top_trigger, promotes.

An index row is a small dict (``kvmem.index/1``)::

    {layer, neuron, file (relative path), max, mean, frac_positive, value_norm,
     top_trigger (token of the top trigger or ""), promotes ([str], first five promoted tokens, default convention)}
"""

from __future__ import annotations

__all__ = ["INDEX_COLUMNS", "INDEX_SCHEMA", "index_row"]

INDEX_SCHEMA = "kvmem.index/1"
# (heading, row key, number format) of the numeric columns every index shows
INDEX_COLUMNS = [("layer", "layer", "d"), ("neuron", "neuron", "d"), ("max m", "max", ".4g"),
                 ("mean m", "mean", ".4g"), ("active", "frac_positive", ".1%"), ("‖v‖", "value_norm", ".4g")]


def index_row(data: dict, file: str) -> dict:
    """The index entry of one ``kvmem.neuron/1`` dict whose report is at ``file``."""
    top = data["triggers"].get("top", [])
    values = data["values"].get(data["provenance"]["convention"]) or next(iter(data["values"].values()), {})
    return {"layer": data["layer"], "neuron": data["neuron"], "file": file,
            **{key: data["stats"].get(key) for key in ("max", "mean", "frac_positive", "value_norm")},
            "top_trigger": top[0]["token"] if top else "",
            "promotes": [entry["token"] for entry in values.get("promote", [])[:5]]}
