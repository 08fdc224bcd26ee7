"""Write notebooks/geva2021.ipynb (Geva et al. 2021's key-value measurements) from readable source.

Run ``python notebooks/make_geva2021.py`` after editing a cell here; the notebook is written with
outputs cleared. It runs offline on a CPU: ``KVMEM_NOTEBOOK_TOKENS`` sets the scanned token budget
(default 20000), ``KVMEM_NOTEBOOK_FAST=1`` shrinks every sample (tests set TOKENS=800 and FAST=1),
``KVMEM_NOTEBOOK_OUT`` (or ``KVMEM_NOTEBOOK_DIR``) where the atlas and results go (default: a
temporary directory). ``KVMEM_GEVA2021_RESULTS`` names a saved results directory to draw from
instead of computing (the figures come from saved results either way).
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
# Geva et al. (2021): feed-forward layers as key-value memories, measured faithfully with kvmem

"Transformer Feed-Forward Layers Are Key-Value Memories" (arXiv 2012.14913) read an FFN layer
`FFN(x) = Σ_i m_i(x) v_i + b2` as `d_ff` memories: key `k_i` decides when neuron `i` fires
(coefficient `m_i`), value `v_i` is what it writes. Their measurements, on a 16-layer ReLU LM trained
on WikiText-103 ("WikiLM"), are reproduced here as their released code computes them
(`kvmem.experiments.reproduce_geva2021`, method in `docs/geva2021.md`):

| section | measurement | paper (WikiLM) |
|---|---|---|
| 1 | token removal: coefficient change when the first / last / a random token of a trigger prefix is removed | last: ≈ -65..-70% at layer 1, ≈ -20% at layer 16; first, random: ≈ -10..-20% |
| 2 | agreement: the value's top token is the next token of the neuron's top trigger | ≈ 0 in layers 1-10, ≈ 3.5% at the top layer |
| 3 | rank of the triggers' next tokens in the value's distribution, pooled over all triggers | median 10k-15k in low layers, under 2k at the top |
| 4 | active memories per prefix | 10-50% of a layer's neurons |
| 5 | the layer's prediction (residual + FFN) vs. every memory's top token | differs from all of them in ≥ 68% of examples |

Signed (gated) FFNs are read as two memories per neuron (top triggers with +v, bottom triggers with −v),
each side reported apart; both projection conventions are reported (`raw` is Geva et al.'s); nulls
keep token frequencies (exact within-layer permutation expectation, shuffled-value ranks with a paired
test) and every per-layer figure carries a bootstrap interval. The model's perplexity on the scanned
text is reported beside the results.

The computation writes a **results directory**; every table and figure below is drawn from that
directory alone. To redraw the figures of a saved run (e.g. the million-token reference run), set
`KVMEM_GEVA2021_RESULTS` to its directory: the notebook then skips the scan and the computation.
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
TOKENS = int(os.environ.get("KVMEM_NOTEBOOK_TOKENS", 20000))  # corpus tokens to scan
FAST = os.environ.get("KVMEM_NOTEBOOK_FAST") == "1"  # tests: 4 layers, tiny samples
SEED = 0
NEURONS_PER_LAYER = 3 if FAST else 10  # token removal: neurons sampled per layer and side ...
TRIGGERS = 1 if FAST else 3  # ... and top triggers per neuron
POSITIONS = 30 if FAST else 400  # random corpus positions for sections 4 and 5
N_BOOT = 100 if FAST else 1000  # bootstrap replicates
BOS = ("default", "<|im_start|>") if MODEL == "smollm2-135m" else ("default",)  # perplexity per window start
OUT = Path(os.environ.get("KVMEM_NOTEBOOK_OUT") or os.environ.get("KVMEM_NOTEBOOK_DIR")
           or tempfile.mkdtemp(prefix="kvmem-geva2021-"))
SAVED = os.environ.get("KVMEM_GEVA2021_RESULTS")  # a results directory to draw from instead of computing
RESULTS = Path(SAVED) if SAVED else OUT / "results"
FIGURES = os.environ.get("KVMEM_GEVA2021_FIGURES")  # a directory to save every figure into as PNG (docs/figures)


def save(ax, name: str) -> None:  # the figure as FIGURES/geva2021_<name>.png when FIGURES is set
    if FIGURES:
        Path(FIGURES).mkdir(parents=True, exist_ok=True)
        ax.figure.savefig(Path(FIGURES) / f"geva2021_{name}.png", dpi=110, bbox_inches="tight")


pd.set_option("display.precision", 4)
pd.set_option("display.width", 160)
print(f"drawing from the saved results in {RESULTS}" if SAVED else
      f"{MODEL} on {CORPUS} ({UNIT}s), {TOKENS:,} tokens, fast={FAST}; results in {RESULTS}")
"""),
    md("""
## 0. Scan and compute (skipped when drawing from saved results)

One streaming scan keeps, for every neuron of every layer, its top and bottom triggers and the best and
worst position of each sentence, and projects every value under both conventions. Then
`reproduce_geva2021` runs every measurement and saves the frames. The equivalent command is
`kvmem experiment geva2021 --atlas ATLAS --out RESULTS`.
"""),
    code("""
if not SAVED:
    t = time.perf_counter()
    model = kvmem.load_model(MODEL)
    layers = sorted({0, model.n_layers // 3, 2 * model.n_layers // 3, model.n_layers - 1}) if FAST else None
    atlas = kvmem.scan(model, CORPUS, unit=UNIT, out=OUT / "atlas", overwrite=True, max_tokens=TOKENS,
                       per_document=True, top_k=25, layers=layers, conventions=("raw", "final_norm"),
                       context_activations=False, progress=False)
    print(f"scan: {time.perf_counter() - t:.0f} s; {atlas}")
    index = E.reproduce_geva2021(atlas, model, out=RESULTS, neurons_per_layer=NEURONS_PER_LAYER, triggers=TRIGGERS,
                                 positions=POSITIONS, bos=BOS, n_boot=N_BOOT, seed=SEED, overwrite=True)
    display(index)
"""),
    md("## From here on, everything is read from the results directory"),
    code("""
results = E.load_results(RESULTS)
a = results["agreement"].attrs
print(f"model {a['model']} ({a['fingerprint']}), corpus {a['corpus']}, {a['atlas_tokens']:,} tokens, "
      f"sides {a['settings']['sides']}, trigger kind {a['settings']['kind']}")
"""),
    md("""
## The model as an LM on the scanned text

Perplexity and next-token accuracy of the model on the windows that were scanned, for each choice of
the window's first token (the same targets in every row). The better one is the model's default.
"""),
    code("""
display(results["lm_quality"])
"""),
    md("""
## 1. Token removal (sec. 3.2, fig. 3)

Coefficient change when the first, the last (the trigger itself) or a random interior token of a
trigger prefix is removed, with bootstrap intervals; on the negative side a negative change still
means a weaker memory. `max_abs_error` checks that the unmodified recomputation reproduces the atlas.
"""),
    code("""
display(results["token_removal"])
save(E.plot_token_removal(results["token_removal"]), "token_removal")
"""),
    md("""
## 2. Agreement (sec. 4, fig. 4)

Fraction of neurons whose value's top token is the next token of their top-1 trigger (or of any of the
top-k), beside the exact permutation null (dashed) and the 1/|V| reference (dotted). `self_top1` is the
alignment diagnostic: the same comparison with the trigger's own token.
"""),
    code("""
agreement = results["agreement"]
display(agreement[["convention", "side", "layer", "neurons", "agree_top1", "agree_top1_ci_low", "agree_top1_ci_high",
                   "null_top1", "agree_top25" if "agree_top25" in agreement else "agree_top1", "self_top1"]])
for convention in agreement.convention.unique():
    save(E.plot_agreement(agreement, convention=convention), f"agreement_{convention}")
"""),
    md("""
## 3. Rank of the next token in the value's distribution (fig. 5)

Pooled over every kept trigger of every neuron (as the released code), and for the top-1 trigger;
bootstrap intervals resample neurons. The paired Wilcoxon test compares each neuron's median rank under
its own value with the same triggers under another neuron's value.
"""),
    code("""
ranks = results["next_token_rank"]
display(ranks[["convention", "side", "layer", "median", "median_ci_low", "median_ci_high", "median_top1",
               "median_shuffled", "wilcoxon_z", "wilcoxon_p", "sign_p", "median_self"]])
for convention in ranks.convention.unique():
    save(E.plot_next_token_rank(ranks, convention=convention), f"next_token_rank_{convention}")
"""),
    md("## 4. Active memories (sec. 5.1)"),
    code("""
display(results["active_memories"])
save(E.plot_active_memories(results["active_memories"]), "active_memories")
"""),
    md("""
## 5. The layer's prediction vs. its memories' (sec. 5)

As released: the top token of residual + FFN output against the top tokens of all the layer's memories
(`released_matches_none`; for signed FFNs both sides count as memories). The `ffn_*` and `after_*`
columns are kvmem's variants (the FFN output alone against active memories; the logit lens).
"""),
    code("""
layer_vs = results["layer_vs_memories"]
display(layer_vs)
for convention in layer_vs.convention.unique():
    save(E.plot_layer_vs_memories(layer_vs[layer_vs.convention == convention]), f"layer_vs_memories_{convention}")
"""),
    md("""
## Measured beside the paper

Low = mean over the first third of the layers, upper = mean over the last third, last = the top layer;
`raw` convention and the positive side, as Geva et al. read a ReLU model.
"""),
    code("""
def thirds(frame, column):
    n = len(frame)
    low, upper = frame[column].iloc[: max(n // 3, 1)], frame[column].iloc[-max(n // 3, 1):]
    return low.mean(), upper.mean(), frame[column].iloc[-1]


def pick(frame, side="positive", convention="raw"):
    if "side" in frame:
        frame = frame[frame.side == side]
    if "convention" in frame:
        frame = frame[frame.convention == convention]
    return frame.sort_values("layer")


removal, agree, rank, layer_raw = (pick(results[n]) for n in ("token_removal", "agreement", "next_token_rank",
                                                                "layer_vs_memories"))
rows = [
    ("token removal, last token (mean change, %)", "≈ -65..-70% (layer 1) → ≈ -20% (layer 16)", removal, "change_last", 100),
    ("token removal, first token (%)", "≈ -10..-20%", removal, "change_first", 100),
    ("token removal, random token (%)", "≈ -10..-20%", removal, "change_random", 100),
    ("agreement, top-1 trigger (%)", "≈ 0 (layers 1-10) → ≈ 3.5% (top)", agree, "agree_top1", 100),
    ("agreement, permutation null (%)", "-", agree, "null_top1", 100),
    ("next-token rank, pooled median", "10k-15k (low) → < 2k (top)", rank, "median", 1),
    ("next-token rank, top-1 trigger median", "-", rank, "median_top1", 1),
    ("next-token rank, shuffled median", "-", rank, "median_shuffled", 1),
    ("active memories, m_i > 0 (%)", "10-50%", results["active_memories"], "active_mean", 100),
    ("layer's prediction is no memory's (%)", "≥ 68%", layer_raw, "released_matches_none", 100),
]
summary = pd.DataFrame([(name, paper, *(scale * v for v in thirds(frame, column)))
                        for name, paper, frame, column, scale in rows],
                       columns=["measurement", "paper (WikiLM)", "low layers", "upper layers", "last layer"])
print(summary.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
display(results["timings"])
"""),
    md("""
## The findings, asserted

On a run large enough to measure them (the saved million-token reference run, or `TOKENS` of 200,000 or
more), agreement in the upper third of the layers lies above its permutation null: in every upper layer
the lower end of the bootstrap interval exceeds the null, and the upper layers agree more often than the
lower ones, as Geva et al. found. The recomputation behind token removal reproduces the atlas. A small
run (the tests' budget) checks only that the frames are consistent.
"""),
    code("""
upper = agree.iloc[-max(len(agree) // 3, 1):]
assert ((agree.agree_top1 >= agree.agree_top1_ci_low) & (agree.agree_top1 <= agree.agree_top1_ci_high)).all()
assert ((agree.null_top1 >= 0) & (agree.null_top1 < 1)).all()
assert (results["token_removal"].max_abs_error.dropna() < 1e-3).all()
if SAVED or TOKENS >= 200_000:
    assert (upper.agree_top1_ci_low > upper.null_top1).all(), upper[["layer", "agree_top1_ci_low", "null_top1"]]
    low_mean, upper_mean, _ = thirds(agree, "agree_top1")
    assert upper_mean > 3 * low_mean, (low_mean, upper_mean)
    print(f"upper-layer agreement {upper_mean:.2%} against a null of {upper.null_top1.mean():.3%} "
          f"(lower layers {low_mean:.2%})")
else:
    print(f"{TOKENS:,} tokens: too few to measure agreement against its null; frames checked for consistency")
"""),
]


def build() -> nbformat.NotebookNode:
    notebook = new_notebook(cells=CELLS)
    for i, cell in enumerate(notebook.cells):
        cell["id"] = f"geva2021-{i:02d}"  # stable ids: regenerating gives no spurious diff
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


def main() -> None:
    nbformat.write(build(), HERE / "geva2021.ipynb")


if __name__ == "__main__":
    main()
