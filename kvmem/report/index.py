"""The index page of a report directory, linking to each slot's report: HTML (sortable), Markdown or JSON.

The HTML table sorts when a heading is clicked, or on load from the address: ``index.html#sort=max``
(descending) or ``#sort=layer-asc``; keys are report, layer, neuron, max, mean, frac_positive,
value_norm, top_trigger, promotes.

An index row is a small dict (``kvmem.index/1``)::

    {layer, neuron, file (relative path), max, mean, frac_positive, value_norm,
     top_trigger (token of the top trigger or ""), promotes ([str], first five promoted tokens, default convention)}
"""

from __future__ import annotations

import base64
import hashlib
from string import Template

from kvmem.report.html import esc, fmt, template, token_html
from kvmem.report.jsonfmt import dumps
from kvmem.report.text import md_code, md_text

__all__ = ["INDEX_SCHEMA", "index_row", "render_index"]

INDEX_SCHEMA = "kvmem.index/1"
_COLUMNS = [("layer", "layer", "d"), ("slot", "neuron", "d"), ("max m", "max", ".4g"), ("mean m", "mean", ".4g"),
            ("active", "frac_positive", ".1%"), ("‖v‖", "value_norm", ".4g")]


def index_row(data: dict, file: str) -> dict:
    """The index entry of one ``kvmem.neuron/1`` dict whose report is at ``file``."""
    top = data["triggers"].get("top", [])
    values = data["values"].get(data["provenance"]["convention"]) or next(iter(data["values"].values()), {})
    return {"layer": data["layer"], "neuron": data["neuron"], "file": file,
            **{key: data["stats"].get(key) for key in ("max", "mean", "frac_positive", "value_norm")},
            "top_trigger": top[0]["token"] if top else "",
            "promotes": [entry["token"] for entry in values.get("promote", [])[:5]]}


def render_index(rows: list[dict], provenance: dict, *, format: str) -> str:
    """The index text in ``format`` (html | md | json)."""
    if format == "json":
        return dumps({"schema": INDEX_SCHEMA, "provenance": provenance, "neurons": rows})
    if format == "md":
        return _markdown(rows, provenance)
    return _html(rows, provenance)


def _html(rows: list[dict], p: dict) -> str:
    from kvmem import __version__

    head = "".join(f'<th class="sortable num" data-key="{key}">{label}</th>' for label, key, _ in _COLUMNS)
    body = []
    for row in rows:
        cells = "".join(f'<td class="num" data-v="{row[key] if row[key] is not None else "-Infinity"}">{fmt(row[key], spec)}</td>'
                        for _, key, spec in _COLUMNS)
        trigger = token_html(row["top_trigger"])
        promotes = " ".join(token_html(t) for t in row["promotes"])
        body.append(f'<tr><td data-v="{esc(row["file"])}"><a href="{esc(row["file"])}">L{row["layer"]}/{row["neuron"]}'
                    f'</a></td>{cells}<td data-v="{esc(row["top_trigger"])}">{trigger}</td>'
                    f'<td data-v="{esc(" ".join(row["promotes"]))}">{promotes}</td></tr>')
    table = ('<table class="bt sortable-table"><thead><tr><th class="sortable" data-key="report">report</th>' + head
             + '<th class="sortable" data-key="top_trigger">top trigger</th>'
             + '<th class="sortable" data-key="promotes">promotes ('
             + esc(p["convention"]) + f')</th></tr></thead><tbody>{"".join(body)}</tbody></table>')
    title = f"kvmem reports · {p['model']}"
    body_html = (f"<h1>Memory slot reports</h1><p class=\"subtitle\">{esc(p['model'])} · corpus {esc(p['corpus'])} · "
                 f"{p['tokens']:,} tokens · {len(rows)} slots</p>"
                 f'<p class="note">Model fingerprint <span class="mono">{esc(p["fingerprint"])}</span>; atlas written by '
                 f"kvmem {esc(p['kvmem_version'])}. Active: fraction of positions with m &gt; 0.</p>{table}")
    script = template("index.js")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    return Template(template("index.html")).substitute(
        title=esc(title), css=template("report.css"), body=body_html, script=script,
        script_hash=f"sha256-{digest}", version=esc(__version__))


def _markdown(rows: list[dict], p: dict) -> str:
    lines = ["# Memory slot reports", "",
             f"{md_text(p['model'])} · corpus {md_text(p['corpus'])} · {p['tokens']:,} tokens · {len(rows)} slots", "",
             "| report | layer | slot | max m | mean m | active | ‖v‖ | top trigger | promotes |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        cells = [fmt(row[key], spec) for _, key, spec in _COLUMNS]
        promotes = " ".join(md_code(t) for t in row["promotes"])
        lines.append(f"| [L{row['layer']}/{row['neuron']}](<{row['file']}>) | " + " | ".join(cells)
                     + f" | {md_code(row['top_trigger'])} | {promotes} |")
    return "\n".join(lines) + "\n"
