"""Build notebooks/intervention.ipynb (outputs empty). Run: python notebooks/make_intervention.py"""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

cells = []
md = lambda s: cells.append(new_markdown_cell(s.strip()))  # noqa: E731
code = lambda s: cells.append(new_code_cell(s.strip()))  # noqa: E731

md("""
# Switching memories on: steering SmolLM2 by setting FFN coefficients

Geva et al. 2022 ("Transformer Feed-Forward Layers Build Predictions by Promoting Concepts in the
Vocabulary Space") turned on 10 hand-picked FFN values in GPT-2 medium (coefficient 3) and halved the
toxicity of its continuations. This notebook does the same experiment offline, on CPU, with a concept
that is easy to see: **positive words** (" good", " great", " happy", ...).

1. find values v_i whose projection through the unembedding promotes the concept;
2. look at how large coefficients m_i usually are, to pick a sensible value;
3. set those coefficients with `kvmem.intervene` and measure the next-token distribution;
4. generate text with and without the edit.

The model is `smollm2-135m` (Llama architecture, SwiGLU FFN, 30 layers, d_ff 1536). Set
`KVMEM_NOTEBOOK_FAST=1` for a smaller run (fewer prompts, shorter generations).
""")

code("""
import os

import pandas as pd
import torch

import kvmem
from kvmem.capture import capture
from kvmem.intervention import greedy_continuation, intervene
from kvmem.tracing import project

FAST = os.environ.get("KVMEM_NOTEBOOK_FAST") == "1"
torch.manual_seed(0)
model = kvmem.load_model("smollm2-135m", device="cpu")
model
""")

md("""
## 1. Values that promote the concept

For every value v_i of the upper half of the network we score the target tokens in its projection
`W_U^T (final_norm.linear_part(v_i))` (kvmem's `final_norm` convention) as z-scores against the whole
vocabulary. The mean and standard deviation over the vocabulary follow from the mean and covariance of
the columns of W_U, so no `[d_ff, vocab]` matrix is ever built.

In a gated FFN the coefficient m_i = silu(x·g_i)·(x·u_i) is often **negative**, so a value promotes the
concept either with m_i > 0 (its top tokens) or with m_i < 0 (its bottom tokens). We keep both and
remember the sign.
""")

code("""
targets = [" good", " great", " happy", " wonderful", " love", " beautiful", " excellent", " amazing"]
target_ids = [ids[0] for ids in map(model.encode, targets) if len(ids) == 1]  # single-token words only
print([model.token_str(i) for i in target_ids])

W_U = model.unembedding().float()  # [d_model, vocab]
mu = W_U.mean(dim=1)  # [d_model]
centred = W_U - mu[:, None]
cov = centred @ centred.T / W_U.shape[1]  # [d_model, d_model]
norm = model.final_norm()

rows = []
with torch.no_grad():
    for layer in range(model.n_layers // 2, model.n_layers):
        u = norm.linear_part(model.values(layer).float())  # [d_ff, d_model]
        mean, std = u @ mu, ((u @ cov) * u).sum(dim=1).sqrt()  # [d_ff]
        z = ((u @ W_U[:, target_ids]) - mean[:, None]) / std[:, None]  # [d_ff, n_targets]
        concept = z.mean(dim=1)  # [d_ff]
        for neuron in concept.abs().topk(5).indices.tolist():
            rows.append({"layer": layer, "neuron": neuron, "concept_z": float(concept[neuron])})
candidates = pd.DataFrame(rows).assign(strength=lambda f: f.concept_z.abs())
candidates = candidates.sort_values("strength", ascending=False, ignore_index=True)
n_values = 10
chosen = candidates.head(n_values).copy()
chosen["sign"] = chosen.concept_z.map(lambda z: 1.0 if z > 0 else -1.0)
chosen
""")

md("What the chosen sub-updates promote (top tokens of sign · projection):")

code("""
vectors = torch.stack([model.values(r.layer)[r.neuron] * r.sign for r in chosen.itertuples()])  # [n, d_model]
scores = project(model, vectors, convention="final_norm")  # [n, vocab]
chosen["promotes"] = [[model.token_str(i) for i in row] for row in scores.topk(6, dim=1).indices.tolist()]
chosen[["layer", "neuron", "sign", "concept_z", "promotes"]]
""")

md("""
## 2. How large are coefficients?

Geva et al. used coefficient 3 in GPT-2 medium. In a gated model the scale differs per layer, so we look
at |m_i| over a few sentences in the layers we edit and take a high but ordinary value: the 99th
percentile of |m| pooled over those layers (the last layer has rare outliers near 100, so a per-layer
maximum would be far too strong).
""")

code("""
sentences = [
    "The train left the station a few minutes late this morning.",
    "She wrote down the numbers and checked them twice before sending the report.",
][: 1 if FAST else 2]
layers = sorted(set(chosen.layer))
names = {model.hook_name(layer, "post"): layer for layer in layers}
magnitudes = {layer: [] for layer in layers}
for text in sentences:  # kvmem.capture: plain torch hooks on the HF down projections, removed afterwards
    captured = capture(model, torch.tensor([model.prompt_ids(text)]), list(names))
    for name, m in captured.items():  # m [batch, pos, d_ff]
        magnitudes[names[name]].append(m[0, 1:].abs().flatten())  # BOS left out

quantiles = pd.DataFrame(
    {layer: {q: float(torch.cat(ms).quantile(q)) for q in (0.5, 0.9, 0.99, 0.999)} | {"max": float(torch.cat(ms).max())}
     for layer, ms in magnitudes.items()}
).T.rename_axis("layer")
coefficient = round(float(torch.cat([torch.cat(ms) for ms in magnitudes.values()]).quantile(0.99)), 1)
print(f"coefficient = {coefficient} (pooled 99th percentile of |m|)")
quantiles.round(2)
""")

md("""
## 3. The next-token distribution with the memories switched on

`mode="set"` writes m_i = sign · coefficient at `hook_post`, the input of `down_proj`, at every position.
We report the probability mass on the target words and the top next tokens.
""")

code("""
prompts = ["I feel", "The movie was", "The food at the restaurant tasted"][: 2 if FAST else 3]

def edits_for(scale):
    return {(r.layer, r.neuron): r.sign * coefficient * scale for r in chosen.itertuples()}

def next_token(prompt, edits):
    with torch.no_grad(), intervene(model, edits):
        probs = model.hf_model(torch.tensor([model.prompt_ids(prompt)])).logits[0, -1].softmax(-1)  # [vocab]
    top = [model.token_str(i) for i in probs.topk(4).indices.tolist()]
    return float(probs[target_ids].sum()), top

rows = []
for prompt in prompts:
    mass_before, top_before = next_token(prompt, {})
    mass_after, top_after = next_token(prompt, edits_for(1.0))
    rows.append({"prompt": prompt, "target_mass_before": mass_before, "target_mass_after": mass_after,
                 "top_before": top_before, "top_after": top_after})
shift = pd.DataFrame(rows)
# the finding: switching on values that promote the concept raises the probability of its words, for every prompt
assert (shift.target_mass_after > shift.target_mass_before).all(), shift
shift.round(3)
""")

md("The effect grows with the coefficient (mass on the target words; m = 0 switches the memories off):")

code("""
scales = [0.0, 0.5, 1.0] if FAST else [0.0, 0.25, 0.5, 1.0, 2.0]
curve_prompts = prompts[: 1 if FAST else 2]
curve = pd.DataFrame(
    {f"m = {scale * coefficient:.2g}": [next_token(p, edits_for(scale))[0] for p in curve_prompts] for scale in scales},
    index=curve_prompts,
)
# a stronger coefficient pushes further: the mass rises from m = 0 to the full coefficient
assert (curve.iloc[:, -1] > curve.iloc[:, 0]).all(), curve
curve.round(3)
""")

md("""
## 4. Generated text with and without

Greedy decoding with half the coefficient: the edit acts at every position, and at the full value the
text collapses into repeating the concept (the curve above is already near saturation there).
`greedy_continuation` is the HF model's own `generate` (greedy, with its KV cache); the edit is a forward
pre-hook on each edited down projection, removed when the block ends.
""")

code("""
new_tokens = 5 if FAST else 8
for prompt in prompts[: 1 if FAST else 2]:
    plain = greedy_continuation(model, prompt, max_new_tokens=new_tokens)
    with intervene(model, edits_for(0.5)):
        steered = greedy_continuation(model, prompt, max_new_tokens=new_tokens)
    print(f"{prompt!r}\\n  without: {plain!r}\\n  with:    {steered!r}")
""")

md("""
## 5. The edit, seen by the tracer

`kvmem.trace` run inside the block sees the edited coefficients. `rank` is each switched-on neuron's place
among its layer's 1536 sub-updates (by |m|·‖v‖), `final_token_logit` its direct push on the logit of the
final prediction; the logit lens shows in which layers the prediction turns to the concept.
""")

code("""
with intervene(model, edits_for(0.5)):
    traced = kvmem.trace(model, prompts[0], top=None, n_tokens=0)  # all d_ff sub-updates of every layer
print(traced.attrs["final_token"], "| convention:", traced.attrs["convention"])
display(traced.layers.tail(6)[["layer", "top_before", "top_after", "changed", "final_prob_after"]])
edited = traced.sub_updates.merge(chosen[["layer", "neuron", "promotes"]], on=["layer", "neuron"])
# the tracer sees the edited coefficients: each switched-on neuron has m = sign * coefficient / 2 at the last position
expected = edited.merge(chosen[["layer", "neuron", "sign"]], on=["layer", "neuron"])
assert len(expected) == len(chosen)
assert ((expected.coefficient - expected.sign * coefficient * 0.5).abs() < 1e-4 * coefficient).all()
edited[["layer", "neuron", "rank", "coefficient", "weight_share", "final_token_logit", "promotes"]].round(3)
""")

md("""
## Notes

- Geva et al. 2022 chose values by reading their top tokens; here a z-score over the vocabulary picks them
  automatically, and each value keeps its sign because SwiGLU coefficients can be negative.
- The coefficient is set at the input of `down_proj` (`hook_post`), the number that multiplies v_i; setting
  the gate or up projection alone would produce a different m_i.
- Every number here depends on the projection convention (`final_norm`): the traces record it in `attrs`.
""")

for i, cell in enumerate(cells):
    cell["id"] = f"intervention-{i:02d}"  # stable ids: regenerating gives no spurious diff
nb = new_notebook(cells=cells, metadata={
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
})
nbformat.write(nb, str(__import__("pathlib").Path(__file__).resolve().parent / "intervention.ipynb"))
print("wrote", len(cells), "cells")
