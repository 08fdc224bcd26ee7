"""Write the kvmem notebooks (quickstart, vocabulary_projections, neuron_reports) from readable source.

Run ``python notebooks/make_notebooks.py`` after editing a cell here; the notebooks are written with
outputs cleared. They run offline top to bottom; ``KVMEM_NOTEBOOK_TOKENS`` sets the token budget
(default 4000), ``KVMEM_NOTEBOOK_FAST=1`` scans fewer layers (and reports fewer neurons) and ``KVMEM_NOTEBOOK_OUT`` is where
files go (default: a new temporary directory); tests set all three.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETTINGS = '''import os
import tempfile
from pathlib import Path

import kvmem

TOKENS = int(os.environ.get("KVMEM_NOTEBOOK_TOKENS", 4000))  # corpus tokens to scan
FAST = os.environ.get("KVMEM_NOTEBOOK_FAST") == "1"  # tests: fewer layers (and neurons to report)
# everything this notebook writes goes here (tests point KVMEM_NOTEBOOK_OUT at their own directory)
OUT = Path(os.environ.get("KVMEM_NOTEBOOK_OUT") or tempfile.mkdtemp(prefix="kvmem-notebook-"))
print(f"scanning {TOKENS:,} tokens; writing to {OUT}")'''


def md(text: str):
    return new_markdown_cell(text.strip())


def code(text: str):
    return new_code_cell(text.strip())


def quickstart():
    return [
        md("""
# kvmem quickstart

A transformer's feed-forward layer, `FFN(x) = W_out · act(W_in x)`, can be read as a key-value memory
(Geva et al. 2021): neuron *i* has a **key** (row *i* of `W_in`; SmolLM2's gated FFN has two, gate and up),
a **coefficient** `m_i(x)` (the hidden activation) and a **value** (column *i* of `W_out`). This notebook
loads a real trained model, scans a small corpus into an *atlas*, asks it about a few neurons, and
exports a report. Everything runs offline on a CPU.
"""),
        code(SETTINGS),
        md("## Load SmolLM2-135M (30 layers, gated SwiGLU FFN, 1,536 neurons per layer)"),
        code('''model = kvmem.load_model("smollm2-135m")
print(model)
model.anatomy().head(3)'''),
        md("""
## Scan a corpus into an atlas

The scan streams text through the model and keeps, for every neuron, its statistics, its top and bottom
*triggers* (the contexts where `m_i` is most extreme) and its value and key projections through the vocabulary.
The built-in `pydoc` corpus is the Python documentation shipped with the interpreter.
"""),
        code('''LAYERS = [3, 29] if FAST else [0, 6, 12, 18, 24, 29]
atlas = kvmem.scan(model, "pydoc", out=OUT / "atlas", overwrite=True, max_tokens=TOKENS, layers=LAYERS,
                   top_k=10, progress=False)
atlas'''),
        md("## The neurons with the largest coefficients"),
        code('''columns = ["layer", "neuron", "max", "mean", "frac_positive", "value_norm"]
top = atlas.neurons.sort_values("max", ascending=False)[columns].head(8)
top'''),
        md("## One neuron: statistics, triggers (the trigger token in `[[...]]`) and the tokens its value promotes"),
        code('''layer, neuron = int(top.layer.iloc[0]), int(top.neuron.iloc[0])
record = atlas.neuron(layer, neuron)
print(record)'''),
        code('''atlas.triggers(layer, neuron, kind="top")[["activation", "token", "next_token", "context"]].head(5)'''),
        md("""
Check it yourself: recompute the top trigger's coefficient with a plain forward of the model and a torch
hook on the down projection (whose input is the coefficient vector), on exactly the window the scan read
(`atlas.manifest.tokenization` states the rule: the document tokenized alone, windows of `window` tokens,
BOS first).
"""),
        code('''import torch

from kvmem.corpus import open_corpus

trigger = atlas.triggers(layer, neuron, kind="top").iloc[0]
rule = atlas.manifest.tokenization
document = next(d for d in open_corpus("pydoc") if d.index == trigger.doc)
ids = model.tokenizer(document.text, add_special_tokens=False)["input_ids"]
start = trigger.pos - trigger.pos % rule["window"]
window = ([rule["bos_token_id"]] if rule["prepend_bos"] else []) + ids[start:start + rule["window"]]
spec = model.spec
down = model.hf_model.get_submodule(f"{spec.layers}.{layer}.{spec.mlp}.{spec.value}")
down = getattr(down, "original_component", down)  # the HF module itself
seen = {}
handle = down.register_forward_pre_hook(lambda module, args: seen.setdefault("m", args[0][0].detach()))
try:
    with torch.no_grad():
        model.hf_model(torch.tensor([window]))
finally:
    handle.remove()
recomputed = float(seen["m"][trigger.pos - start + int(rule["prepend_bos"]), neuron])
print(f"stored {trigger.activation:.5f}, recomputed {recomputed:.5f}, token {model.token_str(ids[trigger.pos])!r}")
assert ids[trigger.pos] == trigger.token_id
assert abs(recomputed - trigger.activation) <= 1e-3 * max(1.0, abs(trigger.activation))'''),
        code('''atlas.values(layer, neuron, convention="final_norm", kind="promote")[["rank", "token", "score"]].head(8)'''),
        code('''# the same list from the weights alone: W_U^T (gain * v) for SmolLM2's RMSNorm (final_norm convention)
v = model.values(layer)[neuron]  # [d_model]
scores = (v * model.final_norm().gain) @ model.unembedding()  # [vocab]
promoted = atlas.values(layer, neuron, convention="final_norm", kind="promote")
assert promoted.token_id.tolist()[:5] == scores.topk(5).indices.tolist()'''),
        md("## Which neurons promote a token? (`tokenizer=` resolves the string to its single token)"),
        code('''atlas.top_neurons(token=" the", by="value", k=5, tokenizer=model.tokenizer)'''),
        md("## Plots: the per-layer picture and one neuron's coefficient histogram"),
        code('''import matplotlib.pyplot as plt

from kvmem import plots

plots.plot_layer_summary(atlas.neurons)
fig, ax = plt.subplots(figsize=(5, 2.6), layout="constrained")
plots.plot_histogram(atlas.histogram(layer, neuron), ax=ax);'''),
        md("## Export a self-contained report (one HTML file: open it in any browser, offline)"),
        code('''path = kvmem.report.export_neuron(atlas, layer, neuron, format="html", out=OUT / "reports")
print(path, f"{path.stat().st_size / 1e3:.0f} kB")'''),
    ]


def vocabulary_projections():
    return [
        md("""
# Value projections: raw or through the final norm?

Projecting a value vector `v` through the unembedding shows which tokens the neuron promotes (Geva et al. 2022).
Tools disagree on *how*: LM-Debugger projects raw `W_U^T v`; ffn-values and OpenAI's neuron viewer first
apply the final norm's linear part. kvmem stores both and records which produced each number. This notebook
puts them side by side and measures how much the answer changes across whole layers of SmolLM2-135M
(its final norm is an RMSNorm, so `final_norm` multiplies `v` by the norm's per-dimension gain).
"""),
        code(SETTINGS),
        code('''from kvmem.conventions import CONVENTIONS, DEFAULT_CONVENTION

for name, convention in CONVENTIONS.items():
    print(f"{name}{' (default)' if name == DEFAULT_CONVENTION else ''}: {convention.formula}\\n")'''),
        md("""
Value projections depend only on the weights, not on the corpus, so a tiny scan is enough to store them
for every neuron of the chosen layers (`context_activations=False` skips work this notebook does not need).
"""),
        code('''model = kvmem.load_model("smollm2-135m")
LAYERS = [0, 29] if FAST else [0, 10, 20, 29]
atlas = kvmem.scan(model, "pydoc", out=OUT / "atlas", overwrite=True, max_tokens=min(TOKENS, 512), layers=LAYERS,
                   top_k=3, context_activations=False, progress=False)
values = atlas.table("values")
values.head(3)'''),
        md("## Side by side: the top promoted tokens of a few neurons under each convention"),
        code('''import pandas as pd


def side_by_side(layer, neuron, n=10):
    frame = atlas.values(layer, neuron, kind="promote")
    return pd.DataFrame({c: frame[frame.convention == c].sort_values("rank").token.head(n).tolist()
                         for c in atlas.conventions})

last = LAYERS[-1]
for neuron in (0, 1, 2):
    print(f"L{last}/{neuron}")
    print(side_by_side(last, neuron).to_string(), "\\n")'''),
        md("The stored lists are the weights' own: recompute both conventions for those neurons from `W_U` and `v`."),
        code('''W_U = model.unembedding()  # [d_model, vocab]
gain = model.final_norm().gain  # RMSNorm: the final norm's linear part is the gain
for neuron in (0, 1, 2):
    v = model.values(last)[neuron]  # [d_model]
    for convention, vector in (("raw", v), ("final_norm", v * gain)):
        stored = atlas.values(last, neuron, convention=convention, kind="promote").sort_values("rank")
        assert stored.token_id.tolist()[:10] == (vector @ W_U).topk(10).indices.tolist(), (neuron, convention)
print("raw and final_norm lists recomputed from the weights")'''),
        md("## Across whole layers: overlap of the top-20 promoted tokens"),
        code('''promote = values[values.kind == "promote"]
sets = promote.groupby(["layer", "neuron", "convention"]).token_id.agg(frozenset).unstack("convention")
top1 = promote[promote["rank"] == 0].pivot_table(index=["layer", "neuron"], columns="convention", values="token_id")
overlap = pd.DataFrame({
    "shared of 20": [len(a & b) for a, b in zip(sets["raw"], sets["final_norm"])],
    "same top token": (top1["raw"] == top1["final_norm"]).to_numpy(),
}, index=sets.index)
summary = overlap.groupby("layer").agg(mean_shared=("shared of 20", "mean"), median_shared=("shared of 20", "median"),
                                       same_top_token=("same top token", "mean"))
# the finding: the conventions disagree on many neurons (SmolLM2's final-norm gain is far from uniform)
assert (overlap["shared of 20"] < 20).mean() > 0.5 and summary.same_top_token.max() < 1
summary'''),
        code('''import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(5.5, 2.8), layout="constrained")
for layer, group in overlap.groupby("layer"):
    ax.hist(group["shared of 20"], bins=range(22), histtype="step", linewidth=1.4, label=f"layer {layer}")
ax.set_xlabel("tokens shared by the raw and final_norm top-20")
ax.set_ylabel("neurons")
ax.legend(frameon=False);'''),
        md("""
Where the overlap is far below 20, the two conventions tell different stories about the same neuron:
a result quoted without its convention cannot be reproduced. kvmem writes the convention beside every
number (`atlas.values(..., convention=...)`, the manifest, and every exported report).
"""),
    ]


def neuron_reports():
    return [
        md("""
# Neuron reports

Export neurons as reports: **HTML** (one self-contained file per neuron, figures inline, opens offline),
**Markdown** (renders on GitHub, figures as PNG files beside it) or **JSON** (schema `kvmem.neuron/1`,
documented in `kvmem.report.neuron_dict`). Many at once get an index page. The same from a shell:
`kvmem report --atlas DIR --layer 29 --top 5 --format html --out reports/`.
"""),
        code(SETTINGS),
        code('''model = kvmem.load_model("smollm2-135m")
LAYER = 29
atlas = kvmem.scan(model, "pydoc", out=OUT / "atlas", overwrite=True, max_tokens=TOKENS,
                   layers=[LAYER] if FAST else [20, 25, LAYER], top_k=10, progress=False)
atlas'''),
        md("## Choose neurons: the best of a layer by max coefficient, and the most often active"),
        code('''from kvmem.report import export_many, select_neurons

TOP = 1 if FAST else 3  # tests: one neuron of each kind (each report draws four figures)
best = select_neurons(atlas, LAYER, top=TOP, by="max")
often = select_neurons(atlas, LAYER, top=TOP, by="frac_positive")
neurons = list(dict.fromkeys(best + often))  # a neuron can be in both lists
neurons'''),
        code('''html_index = export_many(atlas, neurons, format="html", out=OUT / "html", progress=False)
md_index = export_many(atlas, neurons, format="md", out=OUT / "md", progress=False)
json_index = export_many(atlas, neurons, format="json", out=OUT / "json", progress=False)
for index in (html_index, md_index, json_index):
    print(index, sorted(p.name for p in index.parent.iterdir()))'''),
        md("## One report, read back: the JSON record"),
        code('''import json

import numpy as np
import pandas as pd

layer, neuron = neurons[0]
data = json.loads((OUT / "json" / f"L{layer}_N{neuron}.json").read_text())
print(data["schema"], data["provenance"]["model"], data["provenance"]["convention"])
triggers = pd.DataFrame(data["triggers"]["top"])
# the report holds the atlas's own triggers, and its index links every chosen neuron
stored = atlas.triggers(layer, neuron, kind="top")
np.testing.assert_allclose(triggers.activation, stored.activation, rtol=1e-6)
assert triggers.context.tolist() == stored.context.tolist()
page = html_index.read_text()
assert all(f"L{at}_N{n}.html" in page for at, n in neurons)
triggers[["rank", "activation", "token", "next_token", "context"]].head(5)'''),
        md("Does the value promote the tokens that follow its triggers?"),
        code('''agreement = pd.DataFrame(data["agreement"])
assert ((agreement.fraction >= 0) & (agreement.fraction <= 1)).all() and set(agreement.convention) == set(atlas.conventions)
agreement[["convention", "triggers", "tokens", "checked", "fraction", "chance"]]'''),
        md("## The Markdown version (first lines) and the neuron itself, shown inline"),
        code('''print("\\n".join((OUT / "md" / f"L{layer}_N{neuron}.md").read_text().splitlines()[:16]))'''),
        code('''atlas.neuron(layer, neuron)'''),
        md("Open the HTML report in a browser (it fetches nothing):"),
        code('''print(html_index.parent / f"L{layer}_N{neuron}.html")'''),
    ]


NOTEBOOKS = {"quickstart": quickstart, "vocabulary_projections": vocabulary_projections,
             "neuron_reports": neuron_reports}


def build(name: str):
    notebook = new_notebook(cells=NOTEBOOKS[name]())
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(notebook.cells):
        cell["id"] = f"{name[:12]}-{i:02d}"  # stable ids: regenerating gives no spurious diff
    nbformat.validate(notebook)
    return notebook


def main() -> None:
    for name in NOTEBOOKS:
        path = HERE / f"{name}.ipynb"
        nbformat.write(build(name), path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
