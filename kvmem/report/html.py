"""One self-contained HTML page per neuron (inline CSS, figures as base64 PNG, no script, no fetch) and the index.

Every untrusted string goes through :func:`kvmem.report.safe_text.html_text`; a Content-Security-Policy
(``default-src 'none'``) in the page is a second wall. Page skeleton and CSS: ``kvmem/templates``.
"""

from __future__ import annotations

import base64
import hashlib
from importlib import resources
from pathlib import Path
from string import Template

from kvmem import __version__
from kvmem.report.figures import neuron_figures
from kvmem.report.index import INDEX_COLUMNS
from kvmem.report.safe_text import html_text as esc
from kvmem.report.safe_text import write_text
from kvmem.schema import KEY_VECTOR_NAMES

__all__ = ["context_html", "fmt", "render_index", "render_neuron", "template", "token_html", "write_neuron"]

TRIGGER_TITLES = {"top": "Top triggers", "bottom": "Bottom triggers",
                  "top_doc": "Top triggers, one per document", "bottom_doc": "Bottom triggers, one per document"}


def template(name: str) -> str:
    """A file of ``kvmem/templates`` as text."""
    return resources.files("kvmem").joinpath("templates", name).read_text(encoding="utf-8")


def fmt(value, spec: str = ".4g") -> str:
    """A number for a table cell ('–' for missing)."""
    return "–" if value is None else format(value, spec)


def token_html(token) -> str:
    return f'<span class="tok">{esc(token)}</span>'


def _shade(value, scale: float) -> str:
    if value is None or scale <= 0:
        return ""
    alpha = min(abs(value) / scale, 1.0) * 0.6
    colour = "var(--pos)" if value >= 0 else "var(--neg)"
    return f' style="background: rgba({colour}, {alpha:.2f})" title="m = {value:.4g}"'


def context_html(trigger: dict, scale: float) -> str:
    """The context with each token shaded by its own coefficient and the trigger token outlined."""
    tokens, acts = trigger["context_tokens"], trigger["context_activations"]
    if not tokens:  # no token split stored: mark the span in the plain text
        start, end = trigger["span"]
        text = trigger["context"]
        return (f'<span class="ctx">{esc(text[:start])}<span class="trig">{esc(text[start:end])}</span>'
                f"{esc(text[end:])}</span>")
    parts = []
    for i, token in enumerate(tokens):
        value = acts[i] if i < len(acts) else None
        cls = ' class="trig"' if i == trigger["context_trigger"] else ""
        style = _shade(value, scale) if acts else ""
        if cls and not acts:
            style = f' title="m = {trigger["activation"]:.4g}"' if trigger["activation"] is not None else ""
        parts.append(f"<span{cls}{style}>{esc(token)}</span>")
    return f'<span class="ctx">{"".join(parts)}</span>'


def _scale(triggers: dict) -> float:
    values = [abs(a) for rows in triggers.values() for t in rows for a in [t["activation"], *t["context_activations"]]
              if a is not None]
    return max(values, default=0.0)


def _figure(figure) -> str:
    data = base64.b64encode(figure.png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" width="{figure.width}" height="{figure.height}" '
            f'alt="{esc(figure.caption)}"><figcaption>{esc(figure.caption)}</figcaption></figure>')


def _header(data: dict) -> str:
    p = data["provenance"]
    conventions = "; ".join(f"{esc(name)}{' (default)' if name == p['convention'] else ''}"
                            for name in p["conventions"])
    rows = [("Model", esc(p["model"])), ("Fingerprint", f'<span class="mono">{esc(p["fingerprint"])}</span>'),
            ("Layer", str(data["layer"])), ("Neuron", str(data["neuron"])),
            ("FFN", f"{esc(p['activation'])}{', gated (two keys per neuron)' if p['gated'] else ''}"),
            ("Corpus", esc(p["corpus"])), ("Tokens scanned", f"{p['tokens']:,}"),
            ("Projection conventions", conventions),
            ("kvmem version", f"atlas written by {esc(p['kvmem_version'])}, report by {esc(p['exported_with'])}")]
    table = "".join(f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in rows)
    return (f"<h1>Neuron {data['layer']}:{data['neuron']}</h1>"
            f'<p class="subtitle">{esc(p["model"])} · layer {data["layer"]}, neuron {data["neuron"]}</p>'
            f'<table class="meta">{table}</table>')


def _stats(data: dict, figures: dict) -> str:
    s = data["stats"]
    columns = [("positions", "count", ",d"), ("mean", "mean", ".4g"), ("std", "std", ".4g"), ("min", "min", ".4g"),
               ("max", "max", ".4g"), ("active (m&gt;0)", "frac_positive", ".1%"), ("‖k‖", "key_norm", ".4g"),
               ("‖g‖", "gate_norm", ".4g"), ("‖v‖", "value_norm", ".4g")]
    head = "".join(f'<th class="num">{label}</th>' for label, _, _ in columns)
    cells = "".join(f'<td class="num">{fmt(s.get(key), spec)}</td>' for _, key, spec in columns)
    return (f'<h2>Statistics</h2><table class="bt"><tr>{head}</tr><tr>{cells}</tr></table>'
            + (_figure(figures["histogram"]) if "histogram" in figures else ""))


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value if isinstance(value, str) else fmt(value)


def _taxonomy(data: dict) -> str:
    """The neuron's taxonomy row (kvmem taxonomy --atlas), or nothing when the atlas has none."""
    row = data.get("taxonomy")
    if not row:
        return ""
    cells = "".join(f'<tr><th>{esc(name)}</th><td class="num">{esc(_cell(value))}</td></tr>'
                    for name, value in row.items())
    return f'<h2>Taxonomy</h2><table class="meta">{cells}</table>'


def _next(trigger: dict) -> str:
    return token_html(trigger["next_token"]) if trigger["next_token_id"] >= 0 else '<span class="none">end</span>'


def _trigger_table(rows: list[dict], scale: float) -> str:
    if not rows:
        return '<p class="none">none kept</p>'
    body = "".join(
        f'<tr><td class="num">{t["rank"] + 1}</td><td class="num">{fmt(t["activation"], "#.4g")}</td>'
        f"<td>{context_html(t, scale)}</td><td>{_next(t)}</td>"
        f'<td class="note">{esc(t["doc_id"])}:{t["pos"]}</td></tr>' for t in rows)
    return ('<table class="bt"><tr><th class="num">#</th><th class="num">m</th><th>context (trigger outlined)</th>'
            f"<th>next</th><th>document:position</th></tr>{body}</table>")


def _triggers(data: dict, figures: dict) -> str:
    triggers = data["triggers"]
    scale = _scale(triggers)
    note = ('<p class="note">Each context token is shaded by this neuron\'s own coefficient there (orange positive, '
            f"blue negative; full colour at |m| = {scale:.3g}); hover a token for its value.</p>")
    out = ["<h2>Triggers</h2>", note]
    for kind in ("top", "bottom"):
        out.append(f"<h3>{TRIGGER_TITLES[kind]}</h3>{_trigger_table(triggers.get(kind, []), scale)}")
    if "triggers" in figures:
        out.append(_figure(figures["triggers"]))
    for kind in ("top_doc", "bottom_doc"):
        if kind in triggers:
            out.append(f"<details><summary>{TRIGGER_TITLES[kind]}</summary>{_trigger_table(triggers[kind], scale)}"
                       "</details>")
    return "".join(out)


def _projection_table(groups: dict, labels: tuple[str, str]) -> str:
    promote, suppress = groups.get("promote", []), groups.get("suppress", [])
    rows = []
    for i in range(max(len(promote), len(suppress))):
        cells = []
        for entries in (promote, suppress):
            entry = entries[i] if i < len(entries) else None
            cells.append(f"<td>{token_html(entry['token'])}</td><td class=\"num\">{fmt(entry['score'], '#.4g')}</td>"
                         if entry else "<td></td><td></td>")
        rows.append(f'<tr><td class="num">{i + 1}</td>{"".join(cells)}</tr>')
    return (f'<table class="bt"><tr><th class="num">#</th><th>{labels[0]}</th><th class="num">score</th>'
            f'<th>{labels[1]}</th><th class="num">score</th></tr>{"".join(rows)}</table>')


def _values(data: dict, figures: dict) -> str:
    out = ["<h2>Value projection</h2>", ("<p>The value vector v read through the unembedding: the tokens this neuron "
                                         "adds logit to (promotes) and takes logit from (suppresses) per unit "
                                         "coefficient.</p>")]
    for convention, groups in data["values"].items():
        definition = data["provenance"]["conventions"].get(convention, "")
        figure = figures.get(f"values_{convention}")
        out.append(f"<h3>Convention {esc(convention)}</h3><p class=\"note\">{esc(definition)}</p>"
                   f'<div class="pair"><div>{_projection_table(groups, ("promoted", "suppressed"))}</div>'
                   f"<div>{_figure(figure) if figure else ''}</div></div>")
    return "".join(out)


def key_vector_title(vector: str) -> str:
    """A keys table's vector as a heading: "Key k", "Gate key g" (a name kvmem does not know, as it is)."""
    name = KEY_VECTOR_NAMES.get(vector)
    return name[:1].upper() + name[1:] if name else vector


def _keys(data: dict) -> str:
    gate = "; a gated neuron has a second key, the gate g" if data["provenance"]["gated"] else ""
    out = ["<h2>Key projection</h2>",
           f"<p>Input-embedding tokens that best match the key (score = W<sub>E</sub>[token] · k, no norm){gate}.</p>"]
    for vector, groups in data["keys"].items():
        out.append(f"<h3>{esc(key_vector_title(vector))}</h3>"
                   + _projection_table(groups, ("highest", "lowest")))
    return "".join(out)


def _agreement(data: dict) -> str:
    rows, lists = [], []
    for a in data["agreement"]:
        rows.append(f"<tr><td>{esc(a['convention'])}</td><td>{a['triggers']}</td><td>{a['tokens']} (top {a['top_n']})"
                    f'</td><td class="num">{a["checked"]}</td><td class="num">{len(a["hits"])}</td>'
                    f'<td class="num">{fmt(a["fraction"], ".1%")}</td><td class="num">{fmt(a["chance"], ".3%")}</td></tr>')
        if a["hits"]:
            hits = ", ".join(f"{token_html(h['next_token'])} (trigger #{h['trigger_rank'] + 1}, value rank "
                             f"{h['value_rank'] + 1})" for h in a["hits"])
            lists.append(f"<li>{esc(a['convention'])}, {a['triggers']} triggers: {hits}</li>")
    table = ('<table class="bt"><tr><th>convention</th><th>triggers</th><th>among the value\'s</th>'
             '<th class="num">checked</th><th class="num">hits</th><th class="num">fraction</th>'
             f'<th class="num">chance</th></tr>{"".join(rows)}</table>')
    found = f"<ul>{''.join(lists)}</ul>" if lists else '<p class="none">No trigger is followed by such a token.</p>'
    return ("<h2>Does the value promote what follows the triggers?</h2><p>For each kept top trigger, is the token "
            "that follows it among the tokens the value promotes? Since m &lt; 0 flips the value, bottom triggers "
            "are checked against the suppressed tokens. Chance: top_n / vocabulary size.</p>" + table + found)


def _quantiles(data: dict) -> str:
    bands = data.get("quantiles") or []
    if not bands:
        return ""
    rows = []
    for band in bands:
        label = f"{band['levels'][0]:g}–{band['levels'][1]:g}"
        bounds = f"[{fmt(band['low'])}, {fmt(band['high'])}]"
        if not band["samples"]:
            rows.append(f'<tr><td>{label}</td><td class="num">{bounds}</td><td></td>'
                        '<td class="none">no sample kept</td><td></td></tr>')
        for s in band["samples"]:
            rows.append(f'<tr><td>{label}</td><td class="num">{bounds}</td><td class="num">{fmt(s["activation"], "#.4g")}'
                        f"</td><td>{context_html(s, 0.0)}</td>"
                        f'<td class="note">{esc(s["doc_id"])}:{s["pos"]}</td></tr>')
    return ("<h2>Quantile samples</h2><p>Uniform samples of the positions in each quantile band of this neuron's "
            "coefficients (bands made of whole histogram bins; bounds are the bins' edges, – for unbounded). "
            "Only the sampled token's coefficient is stored; it is outlined.</p>"
            '<table class="bt"><tr><th>quantiles</th><th class="num">band</th><th class="num">m</th>'
            f'<th>context (sampled token outlined)</th><th>document:position</th></tr>{"".join(rows)}</table>')


def _explanations(data: dict) -> str:
    entries = data.get("explanations") or []
    if not entries:
        return ""

    def cell(s: dict | None, key: str = "") -> str:
        if not s or s[key or "score"] is None:
            return "–"
        low, high = s[f"{key}_low" if key else "low"], s[f"{key}_high" if key else "high"]
        return f"{s[key or 'score']:.2f} [{fmt(low, '.2f')}, {fmt(high, '.2f')}]"

    rows = []
    for e in entries:
        for name, s in (e["scores"] or {"": None}).items():
            rows.append(f"<tr><td>{esc(e['side'])}</td><td>{esc(e['explainer'])}</td><td>{esc(e['text'])}</td>"
                        f'<td>{esc(name)}</td><td class="num">{cell(s)}</td>'
                        f'<td class="num">{"–" if not s or s.get("p") is None else format(s["p"], ".3g")}</td>'
                        f'<td class="num">{cell(s, "baseline")}</td><td>{esc(s.get("random_init_text", "") if s else "") or "–"}</td>'
                        "</tr>")
    return ("<h2>Explanations</h2><p>Scored on held-out examples the explainer never saw: score [95% interval], p "
            "under the side's permutation null; baseline: the same examples judged with another neuron's explanation "
            "of this layer; random-init: the layer's sides scored in a random-init copy, as a population.</p>"
            '<table class="bt"><tr><th>side</th><th>explainer</th><th>explanation</th><th>scorer</th>'
            f'<th class="num">score</th><th class="num">p</th><th class="num">baseline</th><th>random-init</th></tr>'
            f'{"".join(rows)}</table>')


def render_neuron(data: dict, figures: list) -> str:
    """The complete page for one ``kvmem.neuron/1`` dict and its :class:`~kvmem.report.figures.Figure` list."""
    by_name = {figure.name: figure for figure in figures}
    body = (_header(data) + _stats(data, by_name) + _taxonomy(data) + _triggers(data, by_name) + _quantiles(data) + _values(data, by_name)
            + _keys(data)
            + _agreement(data) + _explanations(data))
    footer = (f'Written by kvmem {esc(_version())} from the atlas <span class="mono">{esc(data["provenance"]["atlas"])}'
              "</span>; schema kvmem.neuron/1. Every number comes from the atlas files; nothing is fetched.")
    return _page(f"{data['layer']}:{data['neuron']} · {data['provenance']['model']}", body, footer)


def _version() -> str:
    return __version__


def _page(title: str, body: str, footer: str, *, script: str | None = None) -> str:
    """A whole page from ``templates/page.html``: ``body`` and ``footer`` are HTML; a ``script`` is allowed by its hash."""
    policy, tag = "", ""
    if script is not None:
        digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
        policy, tag = f"; script-src 'sha256-{digest}'", f"<script>{script}</script>"
    return Template(template("page.html")).substitute(
        title=esc(title), css=template("report.css"), body=body, footer=footer, script_policy=policy, script=tag,
        version=esc(_version()))


def write_neuron(record, data: dict, out: Path, stem: str) -> Path:
    """Write ``out/stem.html``: one self-contained page, figures embedded."""

    path = out / f"{stem}.html"
    write_text(path, render_neuron(data, neuron_figures(record, data)))
    return path


def render_index(rows: list[dict], provenance: dict) -> str:
    """The sortable index page of ``kvmem.index/1`` rows (its only script is ``templates/index.js``, CSP-hashed)."""
    p = provenance
    head = "".join(f'<th class="sortable num" data-key="{key}">{label}</th>' for label, key, _ in INDEX_COLUMNS)
    body = []
    for row in rows:
        cells = "".join(f'<td class="num" data-v="{row[key] if row[key] is not None else "-Infinity"}">{fmt(row[key], spec)}</td>'
                        for _, key, spec in INDEX_COLUMNS)
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
    body_html = (f"<h1>Neuron reports</h1><p class=\"subtitle\">{esc(p['model'])} · corpus {esc(p['corpus'])} · "
                 f"{p['tokens']:,} tokens · {len(rows)} neurons</p>"
                 f'<p class="note">Model fingerprint <span class="mono">{esc(p["fingerprint"])}</span>; atlas written by '
                 f"kvmem {esc(p['kvmem_version'])}. Active: fraction of positions with m &gt; 0.</p>{table}")
    footer = f"Written by kvmem {esc(_version())}. Click a column heading to sort. Each row links to its report."
    return _page(title, body_html, footer, script=template("index.js"))
