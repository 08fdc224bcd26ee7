"""The explorer's JSON API and safety rules, against the real ``kvmem serve`` in a subprocess.

Oracles: the atlas's parquet files read with pyarrow and Python's ``re`` (not kvmem), the Atlas API where the
issue names it, and a plain Hugging Face model with a torch hook for traces and edited generations.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from explorer_fixtures import start_server

import kvmem
from kvmem.shading import LEVELS, cells, level, robust_scale

FLOAT32 = dict(rel=2e-6, abs=1e-9)


# ---- oracles read straight from the parquet files ----
def _table(atlas, name):
    return pq.read_table(atlas / f"{name}.parquet").to_pandas()


def _triggers_with_tokens(atlas):
    triggers, contexts = _table(atlas, "triggers"), _table(atlas, "contexts")
    return triggers.merge(contexts, on=["doc", "pos"], how="left", validate="many_to_one")


def _default_convention(atlas):
    return json.loads((atlas / "manifest.json").read_text())["projection"]["default_convention"]


def _pairs(rows):
    return [(r["layer"], r["neuron"]) for r in rows]


# ---- the neuron page's data ----
@pytest.mark.parametrize("layer,neuron", [(0, 0), (1, 95), (1, 7)])
def test_neuron_json_equals_the_atlas(explorer_atlas, explorer_server, layer, neuron):
    status, view = explorer_server.json(f"/api/neuron/{layer}/{neuron}")
    assert status == 200 and view["schema"] == "kvmem.explorer.neuron/1"
    data = view["neuron"]
    neurons = _table(explorer_atlas, "neurons").set_index(["layer", "neuron"]).loc[(layer, neuron)]
    for key in ("count", "mean", "std", "min", "max", "frac_positive", "value_norm"):
        assert data["stats"][key] == pytest.approx(float(neurons[key]), **FLOAT32), key
    triggers = _triggers_with_tokens(explorer_atlas)
    mine = triggers[(triggers.layer == layer) & (triggers.neuron == neuron)]
    for kind in ("top", "bottom", "top_doc"):
        expected = mine[mine.kind == kind].sort_values("rank")
        shown = data["triggers"][kind]
        assert [t["activation"] for t in shown] == pytest.approx(expected.activation.tolist(), **FLOAT32)
        assert [t["context_tokens"] for t in shown] == [list(x) for x in expected.context_tokens]
        assert [t["next_token_id"] for t in shown] == expected.next_token_id.tolist()
    values = _table(explorer_atlas, "values")
    for convention, groups in data["values"].items():
        for kind in ("promote", "suppress"):
            rows = values[(values.layer == layer) & (values.neuron == neuron) & (values.convention == convention)
                          & (values.kind == kind)].sort_values("rank")
            assert [e["token_id"] for e in groups[kind]] == rows.token_id.tolist()
    histogram = _table(explorer_atlas, "histograms").set_index(["layer", "neuron"]).loc[(layer, neuron)]
    assert data["histogram"]["counts"] == list(histogram["counts"])
    # the Atlas API, as the issue asks: random samples, quantile bands, quadrants
    atlas = kvmem.open(explorer_atlas)
    randoms = atlas.samples(layer, neuron, kind="random").sort_values("rank")
    assert [s["activation"] for s in view["random_samples"]] == pytest.approx(randoms.activation.tolist(), **FLOAT32)
    quadrants = {row["quadrant"]: row["positions"] for row in view["quadrants"]["rows"]}
    assert quadrants == {q: int(neurons[f"quadrant_{q}"]) for q in ("pp", "pn", "np", "nn")}
    assert sum(quadrants.values()) == int(neurons["count"])
    # the shading scale is the median of the kept top (bottom) triggers, not their maximum
    top = [a for a in mine[mine.kind == "top"].activation if a > 0]
    if top:
        assert view["scale"]["positive"] == pytest.approx(float(np.median(top)), rel=1e-6)


def test_explanations_and_taxonomy_on_the_neuron(explorer_atlas, explorer_server):
    explanations = _table(explorer_atlas, "explanations")
    row = explanations.iloc[0]
    _, view = explorer_server.json(f"/api/neuron/{row.layer}/{row.neuron}")
    shown = {(e["side"], e["text"]): e["scores"] for e in view["neuron"]["explanations"]}
    mine = explanations[(explanations.layer == row.layer) & (explanations.neuron == row.neuron)]
    assert set(shown) == set(zip(mine.side, mine.text))
    for item in mine.itertuples():
        detection = shown[(item.side, item.text)]["detection"]
        if item.detection_status != "ok":  # a side too thin to score is shown with its status and no number
            assert detection["score"] is None and detection["status"] == item.detection_status
            continue
        assert detection["score"] == pytest.approx(item.detection)
        assert detection["low"] == pytest.approx(item.detection_low)
    taxonomy = _table(explorer_atlas, "taxonomy").set_index(["layer", "neuron"]).loc[(row.layer, row.neuron)]
    assert view["neuron"]["taxonomy"]["rare"] == bool(taxonomy["rare"])



def test_a_gated_neuron_page_heads_both_key_tables_by_name(explorer_atlas, explorer_server):
    keys = _table(explorer_atlas, "keys")
    assert set(keys.vector) == {"key", "gate"}  # the llama atlas is gated
    status, _, body = explorer_server.get("/neuron/1/7")
    html = body.decode()
    assert status == 200
    assert '<h3>key k</h3>\n<table class="bt projection" id="keys-key">' in html
    assert '<h3>gate key g</h3>\n<table class="bt projection" id="keys-gate">' in html

# ---- search ----
def test_search_by_promoted_token_sorted_and_paginated(explorer_atlas, explorer_server):
    values = _table(explorer_atlas, "values")
    convention = _default_convention(explorer_atlas)
    promoted = values[(values.convention == convention) & (values.kind == "promote")]
    token = Counter(promoted.token_id).most_common(1)[0][0]
    hits = promoted[promoted.token_id == token].groupby(["layer", "neuron"]).score.max()
    order = sorted(hits.items(), key=lambda item: (-item[1], item[0]))
    status, result = explorer_server.json(f"/api/search?by=promotes&q=%23{token}&per_page=500")
    assert status == 200 and result["total"] == len(hits)
    assert _pairs(result["rows"]) == [pair for pair, _ in order]
    assert [r["match"] for r in result["rows"]] == pytest.approx([score for _, score in order], rel=1e-6)
    per_page = 2
    _, page2 = explorer_server.json(f"/api/search?by=promotes&q=%23{token}&per_page={per_page}&page=2")
    assert page2["pages"] == math.ceil(len(hits) / per_page)
    assert _pairs(page2["rows"]) == [pair for pair, _ in order][per_page:2 * per_page]
    _, ascending = explorer_server.json(f"/api/search?by=promotes&q=%23{token}&per_page=500&sort=match&order=asc")
    assert _pairs(ascending["rows"]) == [pair for pair, _ in sorted(hits.items(), key=lambda item: (item[1], item[0]))]
    suppressed = values[(values.convention == convention) & (values.kind == "suppress")]
    token = Counter(suppressed.token_id).most_common(1)[0][0]
    lowest = suppressed[suppressed.token_id == token].groupby(["layer", "neuron"]).score.min()
    _, result = explorer_server.json(f"/api/search?by=suppresses&q=%23{token}&per_page=500")
    assert _pairs(result["rows"]) == [pair for pair, _ in sorted(lowest.items(), key=lambda item: (item[1], item[0]))]


def test_search_by_trigger_token_context_explanation_class_and_score(explorer_atlas, explorer_server):
    triggers = _triggers_with_tokens(explorer_atlas)
    top = triggers[triggers.kind == "top"]
    token = Counter(top.token_id).most_common(1)[0][0]
    expected = top[top.token_id == token].groupby(["layer", "neuron"]).size()
    _, result = explorer_server.json(f"/api/search?by=fires&q=%23{token}&per_page=500")
    assert {(r["layer"], r["neuron"]): r["count"] for r in result["rows"]} == expected.to_dict()
    counts = [r["count"] for r in result["rows"]]
    assert counts == sorted(counts, reverse=True)

    pattern = r"<script>|<img|\bdef\b"
    matched = top[top.context.map(lambda text: re.search(pattern, text) is not None)]
    _, result = explorer_server.json(f"/api/search?by=context&q={_quote(pattern)}&per_page=500")
    assert {(r["layer"], r["neuron"]): r["count"] for r in result["rows"]} == \
        matched.groupby(["layer", "neuron"]).size().to_dict()
    assert all(re.search(pattern, r["example"]["context"]) for r in result["rows"])

    explanations = _table(explorer_atlas, "explanations")
    word = explanations.text.iloc[0].split()[2]
    wanted = explanations[explanations.text.str.contains(re.escape(word), case=False)]
    _, result = explorer_server.json(f"/api/search?by=explanation&q={_quote(re.escape(word))}&per_page=500")
    assert set(_pairs(result["rows"])) == set(zip(wanted.layer, wanted.neuron))

    taxonomy = _table(explorer_atlas, "taxonomy")
    _, result = explorer_server.json("/api/search?by=class&q=rare&layer=1&per_page=500")
    rare = taxonomy[taxonomy.rare & (taxonomy.layer == 1)]
    assert set(_pairs(result["rows"])) == set(zip(rare.layer, rare.neuron))

    best = explanations.groupby(["layer", "neuron"]).detection.max()
    inside = best[(best >= 0.55) & (best <= 0.9)]
    _, result = explorer_server.json("/api/search?score_min=0.55&score_max=0.9&sort=score&per_page=500")
    assert set(_pairs(result["rows"])) == set(inside.index)
    assert [r["score"] for r in result["rows"]] == pytest.approx(sorted(inside, reverse=True))


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def test_report_and_export_links(explorer_atlas, explorer_server):
    code, headers, body = explorer_server.get("/neuron/1/2/report")
    assert code == 200 and b"Neuron 1:2" in body and "style-src 'unsafe-inline'" in headers["content-security-policy"]
    assert "script" not in headers["content-security-policy"]
    _, record = explorer_server.json("/neuron/1/2/export")
    assert record["dataclass_name"] == "NeuronRecord" and record["neuron_id"]["layer_index"] == 1
    top = _triggers_with_tokens(explorer_atlas)
    top = top[(top.layer == 1) & (top.neuron == 2) & (top.kind == "top")].sort_values("rank")
    assert [max(r["activations"]) for r in record["most_positive_activation_records"]] == \
        pytest.approx(top.activation.tolist(), **FLOAT32)


# ---- traces and edits, against a plain Hugging Face model ----
def test_trace_and_edited_generation_match_hugging_face(explorer_atlas, explorer_server, llama_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    explorer_server.wait_model()
    prompt = "The cat sat on the"
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    hf = LlamaForCausalLM.from_pretrained(llama_dir).eval()
    ids = [tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]  # the scan's BOS
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    code, trace = explorer_server.json(f"/api/trace?prompt={_quote(prompt)}&top=4&generate=1&max_new_tokens=8")
    assert code == 200 and trace["token_ids"] == ids and trace["prepend_bos"] is True
    assert [t["token_id"] for t in trace["next_tokens"]] == logits.topk(10).indices.tolist()
    assert trace["layers"][-1]["top_after_id"] == int(logits.argmax())  # the last lens is the model's own output
    assert [len(group["rows"]) for group in trace["sub_updates"]] == [4, 4]

    layer, neuron = trace["sub_updates"][1]["rows"][0]["layer"], trace["sub_updates"][1]["rows"][0]["neuron"]

    def greedy(edit=None) -> str:
        handles = []
        if edit is not None:
            def hook(module, args):  # the down projection's input is the coefficient vector m
                (m,) = args
                m = m.clone()
                m[..., edit[1]] = edit[2]
                return (m,)
            handles.append(hf.model.layers[edit[0]].mlp.down_proj.register_forward_pre_hook(hook))
        try:
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                  pad_token_id=tokenizer.eos_token_id)
        finally:
            for handle in handles:
                handle.remove()
        return tokenizer.decode(out[0, len(ids):].tolist())

    code, edited = explorer_server.json(f"/api/trace?prompt={_quote(prompt)}&top=4&max_new_tokens=8"
                                        f"&edit={layer}:{neuron}=25")
    assert code == 200
    assert edited["generation"]["without"] == greedy() == trace["generation"]["without"]
    assert edited["generation"]["with"] == greedy((layer, neuron, 25.0))
    assert edited["edits"]["edits"] == [{"layer": layer, "neuron": neuron, "value": 25.0}]
    _, off = explorer_server.json(f"/api/trace?prompt={_quote(prompt)}&top=4&max_new_tokens=8&off={layer}:{neuron}")
    assert off["generation"]["with"] == greedy((layer, neuron, 0.0))

    def hook(module, args):  # switched off: m_neuron := 0 at every position
        (m,) = args
        m = m.clone()
        m[..., neuron] = 0.0
        return (m,)

    handle = hf.model.layers[layer].mlp.down_proj.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            probs = hf(torch.tensor([ids])).logits[0, -1].softmax(-1)
    finally:
        handle.remove()
    shown = off["next_tokens_edited"]
    assert [t["token_id"] for t in shown] == probs.topk(10).indices.tolist()
    assert [t["prob"] for t in shown] == pytest.approx(probs.topk(10).values.tolist(), rel=1e-4)
    assert [t["prob"] for t in shown] != pytest.approx([t["prob"] for t in off["next_tokens"]], rel=1e-6)


# ---- the shading rule and the notebook record ----
def test_robust_scale_is_the_median_and_a_huge_value_does_not_flatten_the_rest():
    top = [2.0, 3.0, 2.5, 400.0, 2.2]  # one massive activation among ordinary ones
    scale = robust_scale(top, [-1.0, -0.5, 2.0])
    assert scale.positive == pytest.approx(np.median(top)) and scale.negative == pytest.approx(0.75)
    assert [level(v, scale) for v in top] == [6, LEVELS, LEVELS, LEVELS, 7]  # nearest of 8 steps of |m| / 2.5
    assert level(400.0 / 2, scale) == LEVELS and level(0.01, scale) == 0 and level(-0.75, scale) == -LEVELS
    row = cells(["a", "\n", "\u200b"], [1.0, 400.0, -0.1], 1, scale)
    assert [c.text for c in row] == ["a", "↵\n", "⟨U+200B⟩"] and row[1].saturated and row[1].trigger


def test_neuron_record_html_shades_each_token(explorer_atlas):
    from html.parser import HTMLParser

    atlas = kvmem.open(explorer_atlas)
    record = atlas.neuron(1, 3)
    page = record._repr_html_()
    top = record.triggers[record.triggers.kind == "top"].head(10)

    class Spans(HTMLParser):
        def __init__(self):
            super().__init__()
            self.styles, self.marks = [], 0

        def handle_starttag(self, tag, attrs):
            if tag == "span":
                self.styles.append(dict(attrs).get("style", ""))
            self.marks += tag == "mark"

    spans = Spans()
    spans.feed(page)
    bottom = record.triggers[record.triggers.kind == "bottom"].head(10)
    assert spans.marks == len(top) + len(bottom)  # each trigger token marked
    assert len(spans.styles) == sum(len(tokens) for tokens in [*top.context_tokens, *bottom.context_tokens])
    assert sum("background:rgba(217,102,31" in s for s in spans.styles) > len(top)  # shaded token by token


def test_explore_from_a_notebook_starts_and_stops(explorer_atlas, llama_model):
    import threading
    import urllib.request

    before = {thread.name for thread in threading.enumerate()}
    running = kvmem.explore(kvmem.open(explorer_atlas), model=llama_model)  # a loaded model is used as it is
    try:
        assert running.url.startswith("http://127.0.0.1:") and f'<iframe src="{running.url}"' in running._repr_html_()
        with urllib.request.urlopen(running.url + "api/status", timeout=60) as response:
            status = json.loads(response.read())
        assert status["model"]["state"] == "ready" and status["model"]["fingerprint_match"] is True
        with urllib.request.urlopen(running.url + "api/trace?prompt=Hello", timeout=120) as response:
            assert json.loads(response.read())["model"] == llama_model.name
    finally:
        running.stop()
    assert not running.thread.is_alive()
    for thread in threading.enumerate():  # the index builder may finish a moment later
        if thread.name.startswith("kvmem-explorer") and thread.name not in before:
            thread.join(60)
    assert {t.name for t in threading.enumerate() if t.name.startswith("kvmem-explorer")} <= before
    with pytest.raises(OSError):
        urllib.request.urlopen(running.url + "api/status", timeout=5)


def test_row_groups_stream_a_table_one_layer_at_a_time(explorer_atlas):
    atlas = kvmem.open(explorer_atlas)
    groups = list(atlas.row_groups("triggers", ["layer", "neuron", "activation"]))
    assert sum(len(g) for g in groups) == pq.ParquetFile(explorer_atlas / "triggers.parquet").metadata.num_rows
    assert all(len(set(g.column("layer").to_pylist())) == 1 for g in groups)
    with pytest.raises(kvmem.KvmemError, match="stores no column"):
        next(atlas.row_groups("triggers", ["context"]))  # texts live in the contexts table


def test_a_plain_gpt2_atlas_without_taxonomy_or_explanations(atlas, tmp_path):
    """The experiments' atlas: GPT-2 (a plain GELU FFN), no taxonomy, explanations or context coefficients."""
    server = start_server(atlas.path, "--no-model", log=tmp_path / "serve.log")
    try:
        for path in ("/", "/neuron/1/5", "/search?by=all&layer=0", "/search?by=fires&q=the", "/trace"):
            code, _, body = server.get(path)
            assert code == 200, (path, body[-500:])
        _, view = server.json("/api/neuron/1/5")
        assert view["quadrants"] is None and "taxonomy" not in view["neuron"] and view["neuron"]["explanations"] == []
        code, error = server.json("/api/search?by=class&q=rare")
        assert code == 400 and "no taxonomy table" in error["error"]["message"]
        code, error = server.json("/neuron/1/5/export")
        assert code == 400 and "kvmem export" in error["error"]["message"]
    finally:
        server.stop()
    assert "Traceback" not in server.stderr()


def test_the_docs_name_every_route_and_parameter(explorer_atlas):
    import inspect
    from pathlib import Path

    from kvmem.explorer import app as app_module
    from kvmem.explorer.server import build

    docs = (Path(__file__).resolve().parents[1] / "docs" / "explorer.md").read_text()
    app, _ = build(explorer_atlas, load_model=False)
    for route in app.routes:
        if route.path != "/static":
            assert f"`{route.path.replace(':int', '')}" in docs or f"`GET {route.path.replace(':int', '')}`" in docs \
                or f"`POST {route.path}`" in docs, route.path
    source = inspect.getsource(app_module)
    names = set(re.findall(r'_(?:int|float|choice)\(request, "(\w+)"', source))
    names |= set(re.findall(r'(?:query_params|params)\.get(?:list)?\("(\w+)"', source))
    assert len(names) > 15
    missing = sorted(name for name in names if f"`{name}`" not in docs)
    assert missing == [], missing


def test_an_atlas_without_projection_tables_computes_them_with_the_model_or_says_how(explorer_atlas, tmp_path):
    """A lazily scanned atlas (no values / keys tables): with the scanned model loaded the neuron page's
    projections are computed on demand, equal to the tables' rows; without a model the page says so and how to
    write them, and a search by a promoted token (every neuron's) names the command."""
    lazy = tmp_path / "lazy"
    shutil.copytree(explorer_atlas, lazy)
    for name in ("values", "keys"):
        (lazy / f"{name}.parquet").unlink()
    eager = kvmem.open(explorer_atlas)
    server = start_server(lazy, log=tmp_path / "model.log")
    try:
        assert server.wait_model()["state"] == "ready"
        code, view = server.json("/api/neuron/1/3")
        assert code == 200 and view["projections"] == "computed on demand from the model"
        for convention, groups in view["neuron"]["values"].items():
            want = eager.values(1, 3, convention=convention, kind="promote")
            assert [entry["token_id"] for entry in groups["promote"]] == want.token_id.tolist()
            assert [entry["score"] for entry in groups["promote"]] == pytest.approx(want.score.tolist(), rel=1e-6)
        assert set(view["neuron"]["keys"]) == {"key", "gate"}
    finally:
        server.stop()
    server = start_server(lazy, "--no-model", log=tmp_path / "none.log")
    try:
        code, view = server.json("/api/neuron/1/3")
        assert code == 200 and f"kvmem project --atlas {lazy}" in view["projections"]
        assert not any(groups for groups in view["neuron"]["values"].values())
        assert server.get("/neuron/1/3")[0] == 200
        code, error = server.json("/api/search?by=promotes&q=the")
        assert code == 400 and "kvmem project --atlas" in error["error"]["message"]
        assert server.json("/api/search?by=fires&q=the")[0] == 200  # searches that need no value table still work
    finally:
        server.stop()
