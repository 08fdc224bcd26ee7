"""Write notebooks/geva2021.ipynb (Geva et al. 2021's key-value measurements) from readable source.

Run ``python notebooks/make_geva2021.py`` after editing a cell here; the notebook is written with
outputs cleared. It runs offline on a CPU: ``KVMEM_NOTEBOOK_TOKENS`` sets the scanned token budget
(default 20000, about 15 minutes on 2 cores), ``KVMEM_NOTEBOOK_FAST=1`` shrinks every sample
(tests set TOKENS=800 and FAST=1), ``KVMEM_NOTEBOOK_DIR`` where the atlas goes (default: a
temporary directory).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(text.strip())


def code(text: str):
    return new_code_cell(text.strip())


CELLS = [
    md("""
# Geva et al. (2021): feed-forward layers as key-value memories, measured with kvmem

"Transformer Feed-Forward Layers Are Key-Value Memories" (arXiv 2012.14913) read an FFN layer
`FFN(x) = Σ_i m_i(x) v_i + b2` as `d_ff` memories: key `k_i` (a row of W1) decides when slot `i`
fires (coefficient `m_i`), value `v_i` (a column of W2) is what it writes. Their measurements, on a
16-layer ReLU LM trained on WikiText-103 ("WikiLM"), are reproduced here with `kvmem.experiments`:

| section | measurement | paper (WikiLM) |
|---|---|---|
| 1 | token removal: coefficient change when the first / last / a random token of a trigger prefix is removed | last: ≈ -65..-70% at layer 1, ≈ -20% at layer 16; first, random: ≈ -10..-20% |
| 2 | agreement: the value's top token is the next token of the key's top trigger | ≈ 0 in layers 1-10, ≈ 3.5% at the top layer; chance 1/\\|V\\| |
| 3 | rank of that next token in the value's vocabulary distribution | median 10k-15k in low layers, under 2k at the top |
| 4 | active memories per prefix | 10-50% of a layer's slots |
| 5 | the layer's prediction vs. its single memories' | differs from every single memory's in ≥ 68% of examples |

Defaults run offline on a CPU: the trained **SmolLM2-135M** (Llama architecture, 30 layers, gated
SwiGLU FFN with d_ff 1536, vocabulary 49,152) over the running Python's **standard-library
docstrings**, split into sentences (Geva et al. took one trigger per sentence: `kind="top_doc"`).
With a model hub, set `MODEL = "gpt2"` and `CORPUS = "hf:wikitext:wikitext-103-raw-v1:train"` for
GPT-2 small on WikiText-103, the paper's corpus.
"""),
    code("""
import os
import tempfile
import time
from pathlib import Path

import pandas as pd

import kvmem
from kvmem import experiments as E

MODEL = "smollm2-135m"  # with a hub: "gpt2"
CORPUS = "stdlib-docs"  # with a hub: "hf:wikitext:wikitext-103-raw-v1:train"
UNIT = "sentence"  # one document per sentence: per-document triggers are Geva et al.'s one prefix per sentence
KIND = "top_doc"  # trigger kind for sections 1-3 (best position of each sentence)
CONVENTION = "final_norm"  # value projection: W_U^T (final norm's linear part of v)
TOKENS = int(os.environ.get("KVMEM_NOTEBOOK_TOKENS", 20000))  # corpus tokens to scan
FAST = os.environ.get("KVMEM_NOTEBOOK_FAST") == "1"  # tests: 4 layers, tiny samples
SEED = 0
KEYS_PER_LAYER = 3 if FAST else 5  # token removal: keys sampled per layer ...
TRIGGERS = 1 if FAST else 3  # ... and top triggers per key
POSITIONS = 30 if FAST else 400  # random corpus positions for sections 4 and 5
OUT = Path(os.environ.get("KVMEM_NOTEBOOK_DIR") or tempfile.mkdtemp(prefix="kvmem-geva2021-"))
pd.set_option("display.precision", 4)
pd.set_option("display.width", 160)
timings = {}
started = time.perf_counter()
print(f"{MODEL} on {CORPUS} ({UNIT}s), {TOKENS:,} tokens, fast={FAST}; atlas in {OUT}")
"""),
    md("""
## 0. The atlas

One streaming scan keeps, for every slot of every layer, its 25 top triggers (positions with the
highest coefficient) and the best position of each sentence, and projects every value through
the vocabulary under two conventions (`raw` = W_U^T v, LM-Debugger's; `final_norm` = through the
final norm's linear part, as ffn-values). Geva et al. scanned all of WikiText-103's training set;
a CPU budget of a few ten thousand tokens gives each key far fewer candidates, so its top triggers
are noisier.
"""),
    code("""
t = time.perf_counter()
model = kvmem.load_model(MODEL)
layers = sorted({0, model.n_layers // 3, 2 * model.n_layers // 3, model.n_layers - 1}) if FAST else None
atlas = kvmem.scan(model, CORPUS, unit=UNIT, out=OUT / "atlas", overwrite=True, max_tokens=TOKENS, per_document=True,
                   top_k=25, layers=layers, conventions=("raw", "final_norm"), context_activations=False,
                   progress=False)
timings["load + scan"] = time.perf_counter() - t
print(model)
print(atlas)
print(f"fingerprint {model.fingerprint}; scan {atlas.manifest['timing']}")
"""),
    md("""
## 1. Token removal (Geva et al. sec. 3.2, fig. 3)

For a seeded sample of keys per layer and their top triggers, the key's coefficient is recomputed
on the trigger prefix (the window tokens up to the trigger, what the model read) with its first, its
last (the trigger token itself) or a random interior token removed. `max_abs_error` checks that the
unmodified recomputation reproduces the atlas's stored coefficient.
"""),
    code("""
t = time.perf_counter()
removal = E.token_removal(atlas, model, keys_per_layer=KEYS_PER_LAYER, triggers=TRIGGERS, kind=KIND, seed=SEED)
timings["token removal"] = time.perf_counter() - t
display(removal)
ax = E.plot_token_removal(removal)
"""),
    md("""
## 2. Agreement (sec. 4, fig. 4)

The fraction of keys whose value's top token is the next token of the key's top trigger (or of any
of its top-5 / top-25 triggers), beside two baselines: each key paired with another slot's value
(dashed) and chance (dotted). Read from the atlas alone, under both conventions.
"""),
    code("""
t = time.perf_counter()
agreement = E.agreement(atlas, convention=CONVENTION, kind=KIND, seed=SEED)
agreement_raw = E.agreement(atlas, convention="raw", kind=KIND, seed=SEED)
timings["agreement"] = time.perf_counter() - t
display(agreement)
print("raw convention, top-1:", agreement_raw.agree_top1.round(4).tolist())
ax = E.plot_agreement(agreement)
"""),
    md("""
## 3. Rank of the next token in the value's distribution (fig. 5)

For each key's top trigger: 1 + the number of vocabulary tokens its value scores above the
trigger's next token (the full vocabulary, computed in blocks). A random token would sit near
|V|/2; the dashed line pairs the same triggers with other slots' values.
"""),
    code("""
t = time.perf_counter()
ranks = E.next_token_rank(atlas, model, convention=CONVENTION, kind=KIND, seed=SEED)
timings["next-token rank"] = time.perf_counter() - t
display(ranks)
ax = E.plot_next_token_rank(ranks)
"""),
    md("""
## 4. Active memories (sec. 5.1)

At random corpus positions: the fraction of a layer's slots with m_i > 0. SwiGLU coefficients
silu(g·x)(u·x) are signed and rarely exactly zero, so about half are positive by symmetry; the table
also counts |m_i| > 0.1 and the share of slots that carry 90% of the layer's Σ|m_i|·‖v_i‖.
"""),
    code("""
t = time.perf_counter()
active = E.active_memories(model, atlas=atlas, positions=POSITIONS, layers=atlas.layers, seed=SEED)
timings["active memories"] = time.perf_counter() - t
display(active)
ax = E.plot_active_memories(active)
"""),
    md("""
## 5. The layer's prediction vs. its memories' (sec. 5.1-5.2)

At random positions: is the FFN output's top token (same convention) the top token of some single
active memory (m_i·v_i), or of one of the 10 heaviest? And, with the logit lens (full final norm and
unembedding), does the residual after the FFN keep the residual's prediction, take the FFN's, or
neither?
"""),
    code("""
t = time.perf_counter()
layer_vs = E.layer_vs_memories(model, atlas=atlas, positions=POSITIONS, convention=CONVENTION, layers=atlas.layers,
                               seed=SEED)
timings["layer vs memories"] = time.perf_counter() - t
display(layer_vs)
ax = E.plot_layer_vs_memories(layer_vs)
"""),
    md("""
## Measured beside the paper

Low = mean over the first third of the layers, upper = mean over the last third, last = the top layer.
"""),
    code("""
def thirds(frame, column):
    n = len(frame)
    low, upper = frame[column].iloc[: max(n // 3, 1)], frame[column].iloc[-max(n // 3, 1):]
    return low.mean(), upper.mean(), frame[column].iloc[-1]


rows = [
    ("token removal, last token (mean change)", "≈ -65..-70% (layer 1) → ≈ -20% (layer 16)", removal, "change_last", 100),
    ("token removal, first token", "≈ -10..-20%", removal, "change_first", 100),
    ("token removal, random token", "≈ -10..-20%", removal, "change_random", 100),
    ("agreement, top-1 trigger (%)", "≈ 0 (layers 1-10) → ≈ 3.5% (top)", agreement, "agree_top1", 100),
    ("agreement, shuffled values (%)", "-", agreement, "shuffled_top1", 100),
    ("next-token rank, median", "10k-15k (low) → < 2k (top)", ranks, "median", 1),
    ("next-token rank, shuffled median", "-", ranks, "median_shuffled", 1),
    ("active memories, m_i > 0 (%)", "10-50%", active, "active_mean", 100),
    ("active memories, |m_i| > 0.1 (%)", "-", active, "abs_active_mean", 100),
    ("FFN prediction is no active memory's (%)", "≥ 68%", layer_vs, "ffn_matches_none", 100),
    ("residual after FFN = final prediction (%)", "-", layer_vs, "after_is_final", 100),
]
summary = pd.DataFrame([(name, paper, *(scale * v for v in thirds(frame, column)))
                        for name, paper, frame, column, scale in rows],
                       columns=["measurement", "paper (WikiLM)", "low layers", "upper layers", "last layer"])
timings["total"] = time.perf_counter() - started
print(f"{MODEL} on {CORPUS}: {atlas.manifest['tokens']:,} tokens, layers {atlas.layers[0]}..{atlas.layers[-1]}, "
      f"chance agreement {agreement.random_top1.iloc[0]:.2e}")
print(summary.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
print("seconds:", {name: round(s) for name, s in timings.items()})
"""),
]


def build() -> nbformat.NotebookNode:
    notebook = new_notebook(cells=CELLS)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


def main() -> None:
    nbformat.write(build(), HERE / "geva2021.ipynb")


if __name__ == "__main__":
    main()
