"""One Markdown page per neuron, for GitHub (figures are PNG files beside it, ``<stem>_files/``), and the index.

Untrusted text is backslash-escaped (:func:`~kvmem.report.safe_text.md_text`) or code-quoted
(:func:`~kvmem.report.safe_text.md_code`), so no corpus string renders as markup or HTML.
"""

from __future__ import annotations

from pathlib import Path

from kvmem.report.figures import neuron_figures
from kvmem.report.html import TRIGGER_TITLES, fmt, key_vector_title
from kvmem.report.index import INDEX_COLUMNS
from kvmem.report.safe_text import md_code, md_text, write_text

__all__ = ["context_md", "render_index", "render_neuron", "write_neuron"]


def context_md(trigger: dict) -> str:
    """The context as escaped text, the trigger token code-quoted (coefficients do not survive Markdown)."""
    tokens = trigger["context_tokens"]
    if not tokens:
        start, end = trigger["span"]
        text = trigger["context"]
        before, middle, after = text[:start], text[start:end], text[end:]
    else:
        i = trigger["context_trigger"]
        before, middle, after = "".join(tokens[:i]), tokens[i] if i < len(tokens) else "", "".join(tokens[i + 1:])
    return f"{md_text(before)}{md_code(middle)}{md_text(after, lead=False)}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if h in ("#", "m", "score") else "---" for h in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _image(name: str, folder: str, caption: str) -> str:
    return f"![{md_text(caption)}]({folder}/{name}.png)\n\n*{md_text(caption)}*"


def _triggers(rows: list[dict]) -> str:
    if not rows:
        return "*none kept*"
    return _table(["#", "m", "context (trigger token quoted)", "next", "document:position"], [
        [str(t["rank"] + 1), fmt(t["activation"], "#.4g"), context_md(t),
         md_code(t["next_token"]) if t["next_token_id"] >= 0 else "*end*", f"{md_text(t['doc_id'])}:{t['pos']}"]
        for t in rows])


def _projection(groups: dict, labels: tuple[str, str]) -> str:
    promote, suppress = groups.get("promote", []), groups.get("suppress", [])
    rows = []
    for i in range(max(len(promote), len(suppress))):
        row = [str(i + 1)]
        for entries in (promote, suppress):
            entry = entries[i] if i < len(entries) else None
            row += [md_code(entry["token"]), fmt(entry["score"], "#.4g")] if entry else ["", ""]
        rows.append(row)
    return _table(["#", labels[0], "score", labels[1], "score"], rows)


def render_neuron(data: dict, figures: list, *, folder: str) -> str:
    """The Markdown text; ``folder``: the figures' directory relative to the page."""
    p, s = data["provenance"], data["stats"]
    captions = {figure.name: figure.caption for figure in figures}
    layer, neuron = data["layer"], data["neuron"]
    out = [f"# Neuron {layer}:{neuron}", "",
           _table(["field", "value"], [
               ["model", md_text(p["model"])], ["fingerprint", md_code(p["fingerprint"])],
               ["layer", str(layer)], ["neuron", str(neuron)],
               ["FFN", md_text(p["activation"] + (", gated (two keys per neuron)" if p["gated"] else ""))],
               ["corpus", md_text(p["corpus"])], ["tokens scanned", f"{p['tokens']:,}"],
               ["projection conventions", ", ".join(md_text(c) + (" (default)" if c == p["convention"] else "")
                                                   for c in p["conventions"])],
               ["kvmem version", f"atlas {md_text(p['kvmem_version'])}, report {md_text(p['exported_with'])}"]]),
           "", "## Statistics", "",
           _table(["positions", "mean", "std", "min", "max", "active (m>0)", "‖k‖", "‖g‖", "‖v‖"],
                  [[fmt(s.get("count"), ",d"), *(fmt(s.get(k)) for k in ("mean", "std", "min", "max")),
                    fmt(s.get("frac_positive"), ".1%"), *(fmt(s.get(k)) for k in ("key_norm", "gate_norm", "value_norm"))]])]
    if "histogram" in captions:
        out += ["", _image("histogram", folder, captions["histogram"])]
    out += ["", "## Triggers"]
    for kind in ("top", "bottom", "top_doc", "bottom_doc"):
        if kind in data["triggers"] or kind in ("top", "bottom"):
            out += ["", f"### {TRIGGER_TITLES[kind]}", "", _triggers(data["triggers"].get(kind, []))]
    if "triggers" in captions:
        out += ["", _image("triggers", folder, captions["triggers"])]
    out += ["", "## Value projection", "",
            "The value vector read through the unembedding: tokens it promotes and suppresses per unit coefficient."]
    for convention, groups in data["values"].items():
        out += ["", f"### Convention {md_code(convention, table=False)}", "",
                f"*{md_text(p['conventions'].get(convention, ''))}*", "", _projection(groups, ("promoted", "suppressed"))]
        if f"values_{convention}" in captions:
            out += ["", _image(f"values_{convention}", folder, captions[f"values_{convention}"])]
    out += ["", "## Key projection", "", "Input-embedding tokens that best match the key (score = W_E[token] · k)."]
    for vector, groups in data["keys"].items():
        out += ["", f"### {md_text(key_vector_title(vector))}", "",
                _projection(groups, ("highest", "lowest"))]
    out += ["", "## Does the value promote what follows the triggers?", "",
            ("Top triggers are checked against the promoted tokens, bottom triggers (m < 0 flips the value) against "
             "the suppressed ones. Chance: top_n / vocabulary size."), "",
            _table(["convention", "triggers", "among the value's", "checked", "hits", "fraction", "chance"], [
                [md_text(a["convention"]), a["triggers"], f"{a['tokens']} (top {a['top_n']})", str(a["checked"]),
                 str(len(a["hits"])), fmt(a["fraction"], ".1%"), fmt(a["chance"], ".3%")] for a in data["agreement"]])]
    for a in data["agreement"]:
        if a["hits"]:
            hits = ", ".join(f"{md_code(h['next_token'], table=False)} (trigger #{h['trigger_rank'] + 1}, value rank "
                             f"{h['value_rank'] + 1})" for h in a["hits"])
            out += ["", f"- {md_text(a['convention'])}, {a['triggers']} triggers: {hits}"]
    out += _explanations(data)
    out += ["", "---", f"*Written by kvmem {md_text(p['exported_with'])}; schema kvmem.neuron/1.*", ""]
    return "\n".join(out)


def _explanations(data: dict) -> list[str]:
    """Each stored explanation with its scores: value [95% interval] and the derangement baseline."""
    entries = data.get("explanations") or []
    if not entries:
        return []

    def cell(s: dict, key: str = "") -> str:
        value = s[key or "score"]
        low, high = s[f"{key}_low" if key else "low"], s[f"{key}_high" if key else "high"]
        return "–" if value is None else f"{value:.2f} [{fmt(low, '.2f')}, {fmt(high, '.2f')}]"

    def p_cell(s: dict | None) -> str:
        return "–" if not s or s.get("p") is None else f"{s['p']:.3g}"

    rows = []
    for e in entries:
        for name, s in (e["scores"] or {"": None}).items():
            rows.append([md_text(e["side"]), md_text(e["explainer"]), md_text(e["text"]), md_text(name),
                         cell(s) if s else "–", p_cell(s), cell(s, "baseline") if s else "–",
                         md_text(s.get("random_init_text") or "–") if s else "–"])
    return ["", "## Explanations", "",
            "Scored on held-out examples the explainer never saw; score [95% interval], p under the side's "
            "permutation null. Baseline: the same examples judged with another neuron's explanation of this layer. "
            "Random-init: the layer's sides scored in a random-init copy, as a population.", "",
            _table(["side", "explainer", "explanation", "scorer", "score", "p", "baseline", "random-init"], rows)]


def write_neuron(record, data: dict, out: Path, stem: str) -> Path:
    """Write ``out/stem.md`` and its figures as PNG files in ``out/stem_files/``."""

    figures = neuron_figures(record, data)
    folder = out / f"{stem}_files"
    folder.mkdir(exist_ok=True)
    for figure in figures:
        (folder / f"{figure.name}.png").write_bytes(figure.png)
    path = out / f"{stem}.md"
    write_text(path, render_neuron(data, figures, folder=folder.name))
    return path


def render_index(rows: list[dict], provenance: dict) -> str:
    """The index as a Markdown table linking to each report."""
    p = provenance
    lines = ["# Neuron reports", "",
             f"{md_text(p['model'])} · corpus {md_text(p['corpus'])} · {p['tokens']:,} tokens · {len(rows)} neurons", "",
             "| report | " + " | ".join(label for label, _, _ in INDEX_COLUMNS) + " | top trigger | promotes |",
             "|---|" + "---:|" * len(INDEX_COLUMNS) + "---|---|"]
    for row in rows:
        cells = [fmt(row[key], spec) for _, key, spec in INDEX_COLUMNS]
        promotes = " ".join(md_code(t) for t in row["promotes"])
        lines.append(f"| [L{row['layer']}/{row['neuron']}](<{row['file']}>) | " + " | ".join(cells)
                     + f" | {md_code(row['top_trigger'])} | {promotes} |")
    return "\n".join(lines) + "\n"
