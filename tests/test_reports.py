"""Neuron reports: JSON schema, self-contained HTML, Markdown, index pages, the CLI, and hostile text."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from html_dom import Elements

import kvmem
from kvmem.atlas import Atlas
from kvmem.cli import main
from kvmem.conventions import DEFAULT_CONVENTION
from kvmem.errors import KvmemError
from kvmem.report import export_many, export_neuron, neuron_data
from kvmem.report.safe_text import clean, md_code, md_text, visible

NASTY = [
    "Plain words first. <script>alert(1)</script> then more plain words follow here. ",
    'A quote "><img src=x onerror=alert(1)> and an ampersand &amp; &lt;b&gt; stay text. ',
    "Odd \u202eevil\u202c text, zero\u200bwidth space, and a tab\there; done. ",
    "Markdown *bold* _it_ [link](http://x.invalid) `code` | pipe | # head <b>b</b> $x$ \\ end. ",
]
CORPUS = [text * 4 for text in NASTY] + ["The cat sat on the mat. It was a sunny day in Paris. " * 6]
# tags the HTML report itself emits: anything else came from the corpus
REPORT_TAGS = {"html", "head", "meta", "title", "style", "body", "main", "footer", "h1", "h2", "h3", "p", "table",
               "tr", "th", "td", "span", "figure", "img", "figcaption", "div", "details", "summary", "sub", "ul", "li",
               "thead", "tbody", "a", "script"}
HOSTILE = "<script>alert(1)</script>\"><img src=x onerror=alert(1)> \u202e\u200b\ud800 *b* `c` | [l](u) $x$"




def assert_safe_html(text: str, *, scripts: int = 0) -> Elements:
    parsed = Elements(text)
    names = [tag for tag, _ in parsed.tags]
    assert set(names) <= REPORT_TAGS, set(names) - REPORT_TAGS
    assert names.count("script") == scripts
    for tag, attrs in parsed.tags:
        assert not [a for a in attrs if a.startswith("on")], (tag, attrs)
        if tag == "img":
            assert attrs["src"].startswith("data:image/png;base64,")
            assert base64.b64decode(attrs["src"].split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
        if tag == "script":
            assert "src" not in attrs
        if tag == "a":
            assert "://" not in attrs.get("href", "")
    for needle in ("<script>alert", "<img src=x", "onerror=alert(1)>", "\u202e", "\u200b", "<b>b</b>"):
        assert needle not in text
    return parsed


@pytest.fixture(scope="module")
def atlas(gpt2_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("reports") / "atlas"
    return kvmem.scan(gpt2_model, CORPUS, out=out, top_k=5, window=64, per_document=True, progress=False)


@pytest.fixture(scope="module")
def best(atlas):
    """The slot with the largest coefficient in each layer."""
    frame = atlas.neurons.sort_values("max", ascending=False).drop_duplicates("layer").sort_values("layer")
    return [(int(r.layer), int(r.neuron)) for r in frame.itertuples()]


class HostileAtlas(Atlas):
    """The atlas with hostile strings (lone surrogate included) in every token and context."""

    def triggers(self, layer, neuron, *, kind=None):
        frame = super().triggers(layer, neuron, kind=kind).copy()
        for column in ("token", "next_token", "doc_id"):
            frame[column] = _objects([text + HOSTILE for text in frame[column]])
        frame["context_tokens"] = _objects([[HOSTILE, *tokens] for tokens in frame.context_tokens])
        frame["context_activations"] = _objects([[1.0, *acts] if len(acts) else [] for acts in frame.context_activations])
        frame["context_trigger"] = frame.context_trigger + 1
        frame["context"] = _objects([HOSTILE + text for text in frame.context])
        frame["span_start"], frame["span_end"] = frame.span_start + len(HOSTILE), frame.span_end + len(HOSTILE)
        return frame

    def samples(self, layer, neuron, *, kind=None):
        frame = super().samples(layer, neuron, kind=kind).copy()
        for column in ("token", "doc_id"):
            frame[column] = _objects([text + HOSTILE for text in frame[column]])
        frame["context_tokens"] = _objects([[HOSTILE, *tokens] for tokens in frame.context_tokens])
        frame["context_trigger"] = frame.context_trigger + 1
        frame["context"] = _objects([HOSTILE + text for text in frame.context])
        frame["span_start"], frame["span_end"] = frame.span_start + len(HOSTILE), frame.span_end + len(HOSTILE)
        return frame

    def values(self, layer, neuron, **kwargs):
        frame = super().values(layer, neuron, **kwargs).copy()
        frame["token"] = _objects([text + HOSTILE for text in frame.token])
        return frame


def _objects(values: list):
    """A column of Python objects (arrow-backed strings refuse lone surrogates)."""
    return pd.Series(values, dtype=object)


def test_text_helpers():
    assert clean("a\ud800b") == "a\ufffdb" and visible("a\u202eb\u200bc\nd") == "a⟨U+202E⟩b⟨U+200B⟩c↵d"
    assert md_text("<script>") == "\\<script\\>" and md_text("  x") == "␣␣x"
    assert md_code("a|b") == "`a\\|b`" and md_code("``x") == "``` ``x ```" and md_code(" ") == "`␣`"


def test_default_convention_is_the_registry_default_else_what_the_atlas_has(atlas):
    assert atlas.default_convention == DEFAULT_CONVENTION and atlas.provenance()["convention"] == DEFAULT_CONVENTION
    raw_only = Atlas(atlas.path)
    raw_only.manifest = replace(atlas.manifest, scan={**atlas.manifest.scan, "conventions": ["raw"]},
                                projection={**atlas.manifest.projection, "default_convention": "raw"})
    assert raw_only.default_convention == "raw" == raw_only.provenance()["convention"]
    older = Atlas(atlas.path)  # format 1 recorded no default: the registry's if held, else the first one
    older.manifest = replace(raw_only.manifest, projection={})
    assert older.default_convention == "raw"


def test_json_schema_matches_atlas(atlas, best, tmp_path):
    layer, neuron = best[0]
    path = export_neuron(atlas, layer, neuron, format="json", out=tmp_path)
    assert path == tmp_path / f"L{layer}_N{neuron}.json"
    data = json.loads(path.read_text("utf-8"), parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))
    assert data["schema"] == "kvmem.neuron/1" and (data["layer"], data["neuron"]) == (layer, neuron)
    assert set(data) == {"schema", "layer", "neuron", "provenance", "stats", "histogram", "triggers", "values", "keys",
                         "agreement", "quantiles", "explanations"}
    p = data["provenance"]
    assert p["fingerprint"] == atlas.manifest.model["fingerprint"] and p["tokens"] == atlas.manifest.tokens
    assert list(p["conventions"]) == atlas.conventions and p["convention"] == atlas.default_convention == DEFAULT_CONVENTION
    row = atlas.neurons[(atlas.neurons.layer == layer) & (atlas.neurons.neuron == neuron)].iloc[0]
    assert data["stats"]["max"] == pytest.approx(row["max"], rel=1e-6) and data["stats"]["gate_norm"] is None
    assert sum(data["histogram"]["counts"]) == data["stats"]["count"] == atlas.manifest.tokens
    assert len(data["histogram"]["edges"]) == len(data["histogram"]["counts"]) + 1
    assert data["histogram"]["edges"][0] is None and data["histogram"]["edges"][-1] is None
    assert list(data["triggers"]) == ["top", "bottom", "top_doc", "bottom_doc"]
    top = data["triggers"]["top"]
    assert [t["rank"] for t in top] == list(range(5)) and top[0]["activation"] == pytest.approx(row["max"], rel=1e-6)
    for t in top:
        assert "".join(t["context_tokens"]) == t["context"]
        assert t["context_tokens"][t["context_trigger"]] == t["token"] == t["context"][slice(*t["span"])]
        assert len(t["context_activations"]) == len(t["context_tokens"])
        assert t["context_activations"][t["context_trigger"]] == pytest.approx(t["activation"], rel=1e-3, abs=1e-5)
    assert list(data["values"]) == atlas.conventions and list(data["keys"]) == ["key"]
    raw = atlas.values(layer, neuron, convention="raw", kind="promote")
    assert [e["token"] for e in data["values"]["raw"]["promote"]] == raw.token.tolist()


def test_agreement_is_brute_force(atlas, best):
    for layer, neuron in best:
        data = neuron_data(atlas, layer, neuron)
        triggers = atlas.triggers(layer, neuron, kind="top")
        for convention in atlas.conventions:
            promoted = set(atlas.values(layer, neuron, convention=convention, kind="promote").token_id)
            checked = triggers[triggers.next_token_id >= 0]
            hits = int(checked.next_token_id.isin(promoted).sum())
            row = next(a for a in data["agreement"] if a["convention"] == convention and a["triggers"] == "top")
            assert (row["checked"], len(row["hits"])) == (len(checked), hits)
            assert row["chance"] == pytest.approx(20 / 50257, rel=1e-6)


def test_agreement_counts_a_planted_hit(atlas, best):
    layer, neuron = best[0]
    data = neuron_data(atlas, layer, neuron)
    planted = data["values"]["raw"]["promote"][3]
    data["triggers"]["top"][0].update(next_token=planted["token"], next_token_id=planted["token_id"])
    from kvmem.report.neuron_dict import agreement

    row = next(a for a in agreement(data) if a["convention"] == "raw" and a["triggers"] == "top")
    assert row["hits"][0] == {"trigger_rank": 0, "next_token": planted["token"], "next_token_id": planted["token_id"],
                              "value_rank": 3}


def test_html_is_self_contained_and_escaped(atlas, best, tmp_path):
    index = export_many(atlas, best, format="html", out=tmp_path / "html", progress=False)
    for layer, neuron in best:
        text = (tmp_path / "html" / f"L{layer}_N{neuron}.html").read_text("utf-8")
        parsed = assert_safe_html(text)
        assert "http://" not in text.replace("http://x.invalid", "") and "https://" not in text
        assert sum(tag == "img" for tag, _ in parsed.tags) == 2 + len(atlas.conventions)
        shown = "".join(parsed.text)
        for needle in (atlas.manifest.model["fingerprint"], "final_norm", "raw", f"{layer}:{neuron}",
                       f"{atlas.manifest.tokens:,}", atlas.manifest.kvmem_version, "Key projection",
                       "Does the value promote"):
            assert needle in shown
        for trigger in atlas.triggers(layer, neuron).itertuples():
            assert visible(trigger.context) in shown  # context shows as text, escaped, in full
        assert "Quantile samples" in shown
        for band in atlas.quantile_samples(layer, neuron, levels=(0, 0.5, 0.9, 0.99, 0.999, 1), per_band=3):
            for sample in band.itertuples():
                assert visible(sample.context) in shown
    parsed = assert_safe_html(index.read_text("utf-8"), scripts=1)
    links = [attrs["href"] for tag, attrs in parsed.tags if tag == "a"]
    assert links == [f"L{layer}_N{neuron}.html" for layer, neuron in best]


def test_corpus_markup_reaches_the_report_as_text(atlas, tmp_path):
    hits = atlas.search(r"<script>|<img", limit=50)
    assert len(hits), "the corpus should put markup into some trigger contexts"
    for row in hits.head(3).itertuples():
        text = export_neuron(atlas, int(row.layer), int(row.neuron), out=tmp_path).read_text("utf-8")
        assert visible(row.context) in "".join(assert_safe_html(text).text)


def test_hostile_strings_everywhere(atlas, best, tmp_path):
    hostile = HostileAtlas(atlas.path)
    for format in ("html", "md", "json"):
        index = export_many(hostile, best, format=format, out=tmp_path / format, progress=False)
        for path in index.parent.iterdir():
            if path.is_file():
                path.read_bytes().decode("utf-8")  # strict: no surrogate or broken byte reached a file
    text = (tmp_path / "html" / f"L{best[0][0]}_N{best[0][1]}.html").read_text("utf-8")
    shown = "".join(assert_safe_html(text).text)
    assert "⟨U+202E⟩⟨U+200B⟩\ufffd" in shown and '"><img src=x onerror=alert(1)>' in shown
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in text
    data = json.loads((tmp_path / "json" / f"L{best[0][0]}_N{best[0][1]}.json").read_text("utf-8"))
    assert data["triggers"]["top"][0]["token"].endswith(clean(HOSTILE))
    quantile = next(s for band in data["quantiles"] for s in band["samples"])
    assert quantile["token"].endswith(clean(HOSTILE)) and quantile["context_tokens"][0] == clean(HOSTILE)
    section = text[text.index("<h2>Quantile samples</h2>"):text.index("<h2>Value projection</h2>")]
    assert section.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 2 and "<script>" not in section
    assert_safe_markdown(tmp_path / "md" / f"L{best[0][0]}_N{best[0][1]}.md")
    assert_safe_markdown(tmp_path / "md" / "index.md")


def assert_safe_markdown(path: Path, *, hostile: bool = True) -> None:
    """Render like GitHub (CommonMark + tables, raw HTML allowed): only our own images, no markup from text."""
    markdown_it = pytest.importorskip("markdown_it")
    text = path.read_text("utf-8")
    rendered = markdown_it.MarkdownIt("commonmark").enable("table").render(text)
    parsed = Elements(rendered)
    names = {tag for tag, _ in parsed.tags}
    assert names <= {"h1", "h2", "h3", "p", "table", "thead", "tbody", "tr", "th", "td", "code", "em", "img", "a",
                     "ul", "li", "hr", "strong"}, names
    for tag, attrs in parsed.tags:
        if tag == "img":
            assert (path.parent / attrs["src"]).is_file()
        if tag == "a":
            assert (path.parent / attrs["href"]).is_file()
    shown = "".join(parsed.text)
    assert not hostile or ("<script>alert(1)</script>" in shown and "⟨U+202E⟩" in shown)


def test_markdown_report_and_images(atlas, best, tmp_path):
    layer, neuron = best[-1]
    path = export_neuron(atlas, layer, neuron, format="md", out=tmp_path)
    images = sorted(p.name for p in (tmp_path / f"L{layer}_N{neuron}_files").iterdir())
    assert images == ["histogram.png", "triggers.png", "values_final_norm.png", "values_raw.png"]
    assert all((tmp_path / f"L{layer}_N{neuron}_files" / name).read_bytes()[:4] == b"\x89PNG" for name in images)
    assert_safe_markdown(path, hostile=False)


def test_gated_report_shows_both_keys(llama_model, tmp_path):
    atlas = kvmem.scan(llama_model, CORPUS[-1:], out=tmp_path / "atlas", top_k=3, window=32, progress=False)
    data = json.loads(export_neuron(atlas, 1, 5, format="json", out=tmp_path).read_text("utf-8"))
    assert list(data["keys"]) == ["key", "gate"] and data["provenance"]["gated"] is True
    assert data["stats"]["gate_norm"] > 0
    text = export_neuron(atlas, 1, 5, out=tmp_path).read_text("utf-8")
    assert "Gate key g" in text and "gated" in text


def test_report_without_context_activations(gpt2_model, tmp_path):
    atlas = kvmem.scan(gpt2_model, CORPUS[-1:], out=tmp_path / "atlas", top_k=3, window=32, context_activations=False,
                       progress=False)
    data = neuron_data(atlas, 0, 7)
    assert all(t["context_activations"] == [] for rows in data["triggers"].values() for t in rows)
    text = export_neuron(tmp_path / "atlas", 0, 7, out=tmp_path).read_text("utf-8")  # a path opens the atlas
    parsed = assert_safe_html(text)
    outlined = [attrs for tag, attrs in parsed.tags if tag == "span" and attrs.get("class") == "trig"]
    quantile = sum(len(band["samples"]) for band in data["quantiles"])  # the quantile samples outline theirs too
    assert len(outlined) == 6 + quantile and all(attrs["title"].startswith("m = ") for attrs in outlined)
    assert not [attrs for tag, attrs in parsed.tags if "background" in attrs.get("style", "")]


def test_indexes(atlas, best, tmp_path):
    index = export_many(atlas, best, format="json", out=tmp_path / "j", progress=False)
    data = json.loads(index.read_text("utf-8"))
    assert data["schema"] == "kvmem.index/1" and [(r["layer"], r["neuron"]) for r in data["neurons"]] == best
    assert all((index.parent / r["file"]).is_file() for r in data["neurons"])
    md = export_many(atlas, best, format="md", out=tmp_path / "m", progress=False)
    assert md.name == "index.md" and md.read_text("utf-8").count("](<L") == len(best)
    assert_safe_markdown(md, hostile=False)


def test_export_many_refuses_and_replaces(atlas, best, tmp_path):
    out = tmp_path / "r"
    export_many(atlas, best[:1], format="html", out=out, progress=False)
    with pytest.raises(KvmemError, match="already exists"):
        export_many(atlas, best, format="html", out=out, progress=False)
    export_many(atlas, best, format="json", out=out, progress=False, overwrite=True)
    assert sorted(p.suffix for p in out.iterdir()) == [".json"] * (len(best) + 1)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "precious.txt").write_text("keep me")
    with pytest.raises(KvmemError, match="no kvmem report index"):
        export_many(atlas, best, format="html", out=tmp_path / "home", progress=False, overwrite=True)
    assert (tmp_path / "home" / "precious.txt").exists()
    with pytest.raises(KvmemError, match="unknown report format 'pdf'"):
        export_neuron(atlas, *best[0], format="pdf", out=tmp_path)


def _report_parser():
    from kvmem.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command")
    return commands.choices["report"]


def test_cli_format_choices_are_the_registry():
    from kvmem.report.formats import FORMATS

    action = next(a for a in _report_parser()._actions if a.dest == "format")
    assert list(action.choices) == list(FORMATS) == ["html", "md", "json"]
    assert all(f.description in action.help for f in FORMATS.values())


def test_a_new_format_is_one_registry_entry(atlas, best, tmp_path, monkeypatch, capsys):
    from kvmem.report.formats import FORMATS, ReportFormat

    def write_neuron(record, data, out, stem):
        path = out / f"{stem}.txt"
        path.write_text(f"{data['layer']} {data['neuron']} {record.stats['max']}\n")
        return path

    monkeypatch.setitem(FORMATS, "txt", ReportFormat(
        name="txt", suffix=".txt", description="one line per neuron", write_neuron=write_neuron,
        render_index=lambda rows, provenance: "".join(f"{row['file']}\n" for row in rows)))
    action = next(a for a in _report_parser()._actions if a.dest == "format")
    assert "txt" in action.choices and "one line per neuron" in action.help
    (layer, neuron), out = best[0], tmp_path / "txt"
    assert main(["report", "--atlas", str(atlas.path), "--neurons", f"{layer}:{neuron}", "--format", "txt", "--out", str(out),
                 "--no-progress"]) == 0
    assert (out / "index.txt").read_text() == f"L{layer}_N{neuron}.txt\n"
    assert (out / f"L{layer}_N{neuron}.txt").read_text().startswith(f"{layer} {neuron} ")
    assert "wrote 1 txt report(s)" in capsys.readouterr().out


def test_cli(atlas, best, tmp_path, capsys):
    (layer, neuron), out = best[0], tmp_path / "cli"
    assert main(["report", "--atlas", str(atlas.path), "--neurons", f"{layer}:{neuron},1:2", "--out", str(out),
                 "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([f"L{layer}_N{neuron}.html", "L1_N2.html", "index.html"])
    assert main(["report", "--atlas", str(atlas.path), "--neurons", "0:1", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["report", "--atlas", str(atlas.path), "--layers", "1", "--top", "3", "--by", "frac_positive",
                 "--format", "md", "--out", str(out), "--overwrite"]) == 0
    assert "reports: 100%" in capsys.readouterr().err  # the tqdm bar
    frame = atlas.neurons[atlas.neurons.layer == 1].sort_values(["frac_positive", "neuron"], ascending=[False, True])
    expected = [f"L1_N{n}.md" for n in frame.neuron.head(3)]
    assert sorted(p.name for p in out.glob("*.md")) == sorted([*expected, "index.md"])
    for argv, message in [(["--neurons", "0:999"], _atlas_error(atlas, 0, 999)),
                          (["--neurons", "7:0"], _atlas_error(atlas, 7, 0)),
                          (["--neurons", "0"], "--neurons expects neuron ids LAYER:NEURON"),
                          (["--neurons", "0:1", "--layers", "0", "--top", "2"], "give either"),
                          (["--layers", "0"], "--layers and --top go together"), ([], "nothing to report")]:
        assert main(["report", "--atlas", str(atlas.path), *argv, "--out", str(tmp_path / "x")]) == 2
        assert capsys.readouterr().err.startswith(f"kvmem: error: {message}")
    assert not (tmp_path / "x").exists()


def _atlas_error(atlas, layer, neuron) -> str:
    with pytest.raises(KvmemError) as info:
        atlas.check(layer, neuron)
    return str(info.value)


def test_import_is_light():
    code = ("import sys, kvmem, kvmem.report, kvmem.plots, kvmem.report.html, kvmem.report.markdown; "
            "print('matplotlib' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
