"""The layer's prediction against its memories' (Geva et al. 2021, sec. 5): composition, and the residual.

At positions drawn uniformly (seeded) from a corpus, for each layer, first as the released code
computes it (``released_*``): the layer's prediction is the top token of residual + FFN output
(``blocks.L.hook_resid_post``) projected under ``convention`` (``raw``, the output embedding, is
Geva et al.'s), compared with the top tokens of *all* the layer's memories (d_ff values; for signed
FFNs both sides, +v's top and -v's top, with the positive side alone reported too). The "≥ 68%"
of the paper is ``released_matches_none``.

Then kvmem's variants (labelled ``variant`` in :data:`LAYER_COLUMNS`):

- the FFN's prediction: the top token of its output (``blocks.L.mlp.hook_out``, b2 included)
  projected under ``convention`` (``final_norm``: the final norm's linear part, then W_U, no b_U);
- each memory's prediction: the top token of m_i·v_i under the same convention (the value's top
  token when m_i > 0, its bottom token when m_i < 0), from the atlas's values table when given;
- whether some *active* memory (m_i > ``threshold``; for gated FFNs |m_i| > ``abs_threshold``)
  or one of the ``top_memories`` heaviest (|m_i|·‖v_i‖) predicts the FFN's token. Geva et al.
  found the layer's prediction differs from every single memory's in at least 68% of examples;
- the logit lens (full final norm, W_U and b_U) of the residual before the FFN
  (``blocks.L.hook_resid_mid``) and after it (``hook_resid_post``), against the model's final
  prediction, and whether the residual after the FFN keeps the residual's token, takes the FFN's,
  or neither (a composition).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from kvmem.errors import KvmemError
from kvmem.experiments.active import DEFAULT_ABS_THRESHOLD, sample_for
from kvmem.experiments.argument_checks import check_convention, check_positive
from kvmem.experiments.atlas_inputs import as_atlas, check_fingerprint, value_top_tokens
from kvmem.experiments.forward import read_positions
from kvmem.experiments.percent_axes import finish_percent_axes
from kvmem.experiments.result_provenance import provenance
from kvmem.experiments.signed_memories import memory_sides
from kvmem.experiments.stats import bootstrap_ci
from kvmem.tracing import project

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.atlas import Atlas
    from kvmem.models import Model

__all__ = ["LAYER_COLUMNS", "layer_vs_memories", "memory_agreement", "plot_layer_vs_memories"]

LAYER_COLUMNS = {
    "layer": "FFN layer",
    "positions": "corpus positions read",
    "released_matches_none": "as released: the top token of residual + FFN output is no memory's top token, over "
                             "all d_ff memories (both sides when signed); Geva et al.: >= 68%",
    "released_matches_none_ci_low": "bootstrap 95% interval over positions (low end)",
    "released_matches_none_ci_high": "its high end",
    "released_matches_none_positive": "the same against the positive side (+v) alone",
    "active": "variant: mean number of active memories",
    "ffn_matches_active": "variant: some active memory's top token (of m_i·v_i) is the FFN output's top token",
    "ffn_matches_none": "variant: 1 - ffn_matches_active (the FFN output alone, active memories only)",
    "ffn_matches_none_ci_low": "bootstrap 95% interval over positions (low end)",
    "ffn_matches_none_ci_high": "its high end",
    "ffn_matches_top{k}": "variant: some of the k heaviest memories (|m_i|·‖v_i‖) predicts the FFN's token",
    "ffn_matches_heaviest": "variant: the single heaviest memory predicts the FFN's token",
    "before_is_final": "logit-lens top token before the FFN equals the model's final prediction",
    "after_is_final": "the same after the FFN",
    "after_is_before": "the residual's top token after the FFN is the one before it",
    "after_is_ffn": "the residual's top token after the FFN is the FFN's own top token",
    "after_is_neither": "neither: the FFN and the residual compose a new prediction",
}


def memory_agreement(m: Tensor, ffn_top: Tensor, value_top: Tensor, value_bottom: Tensor, *, active: Tensor,
                     weight: Tensor, top_memories: int) -> dict[str, np.ndarray]:
    """Which memories predict the FFN's token, per position (the pure core of :func:`layer_vs_memories`).

    m [n, d_ff] coefficients; ffn_top [n] the FFN output's top token; value_top / value_bottom [d_ff]
    each value's top and bottom token; active [n, d_ff] bool; weight [n, d_ff] = |m|·‖v‖.
    A memory predicts ``value_top`` when m_i >= 0 and ``value_bottom`` when m_i < 0.
    Returns {"active": [n] count, "matches_active", "matches_top", "matches_heaviest": [n] bool}.
    """
    import torch

    predicted = torch.where(m >= 0, value_top[None], value_bottom[None])  # [n, d_ff]
    agrees = predicted == ffn_top[:, None]  # [n, d_ff]
    k = min(top_memories, m.shape[1])
    heavy = torch.topk(weight, k, dim=1).indices  # [n, k], heaviest first
    top_agrees = agrees.gather(1, heavy)  # [n, k]
    return {"active": active.sum(dim=1).numpy(), "matches_active": (agrees & active).any(dim=1).numpy(),
            "matches_top": top_agrees.any(dim=1).numpy(), "matches_heaviest": top_agrees[:, 0].numpy()}


_ROW_BYTES = 256 << 20  # the largest [rows, vocab] float32 score matrix _row_argmax makes at once


def _row_argmax(scores_of, parts: list[Tensor], vocab: int) -> Tensor:
    """The argmax over the vocabulary of ``scores_of(rows)`` ([rows, vocab]) for the rows of ``parts`` (each
    [n_i, d_model]), concatenated in order -> [sum n_i], on as many rows at once as fit ``_ROW_BYTES`` of scores."""
    import torch

    rows = torch.cat(parts)
    step = max(1, _ROW_BYTES // (4 * vocab))
    return torch.cat([scores_of(rows[start:start + step]).argmax(dim=1) for start in range(0, len(rows), step)])


def layer_vs_memories(model: Model, corpus: Any = None, *, positions: int = 300, seed: int = 0,
                      convention: str = "final_norm", top_memories: int = 10, threshold: float = 0.0,
                      abs_threshold: float = DEFAULT_ABS_THRESHOLD, layers: Sequence[int] | None = None,
                      atlas: Atlas | str | None = None, window: int | None = None, prepend_bos: bool | None = None,
                      max_tokens: int | None = None, unit: str = "document", sides: Sequence[str] | str | None = None,
                      n_boot: int = 1000, batch_tokens: int = 2048) -> pd.DataFrame:
    """Per layer, how often the FFN's prediction is some single memory's, and how the residual's
    logit-lens prediction relates to the FFN's and to the model's final one. Columns :data:`LAYER_COLUMNS`.

    ``corpus`` / ``atlas`` / ``window`` / ``prepend_bos`` / ``max_tokens`` / ``unit``: as in
    :func:`~kvmem.experiments.active_memories`. With an atlas, the memories' top tokens come from its
    values table (no vocabulary pass over the values).
    """
    import torch


    check_convention(convention)
    check_positive("top_memories", top_memories)
    chosen_sides = memory_sides(model.gated, sides)
    atlas = as_atlas(atlas) if atlas is not None else None
    match = check_fingerprint(atlas, model) if atlas is not None else None
    chosen = list(range(model.n_layers)) if layers is None else sorted({int(x) for x in layers})
    for layer in chosen:
        model.hook_name(layer)  # checks the range
    last = model.n_layers - 1
    has_mid = all(model.has_site(layer, "resid_mid") for layer in chosen)
    names: dict[tuple[int, str], str] = {}
    for layer in chosen:
        names[(layer, "m")] = model.hook_name(layer, "post")
        names[(layer, "out")] = model.hook_name(layer, "out")
        names[(layer, "post")] = model.hook_name(layer, "resid_post")
        if has_mid:
            names[(layer, "mid")] = model.hook_name(layer, "resid_mid")
    names[(last, "post")] = model.hook_name(last, "resid_post")
    sampled, corpus, settings = sample_for(model, corpus, atlas, positions=positions, seed=seed, window=window,
                                           prepend_bos=prepend_bos, max_tokens=max_tokens, unit=unit)

    tops = {layer: tuple(torch.from_numpy(np.asarray(t)) for t in value_top_tokens(model, layer, convention, atlas=atlas))
            for layer in chosen}
    norms = {layer: model.written_values(layer).norm(dim=1) for layer in chosen}  # [d_ff]
    memory_tops = {layer: torch.unique(torch.cat([tops[layer][0 if side == "positive" else 1] for side in chosen_sides]))
                   for layer in chosen}  # [memories] every memory's top token, as the released code compares
    vocab = model.unembedding().shape[1]
    keys = ("active", "matches_active", "matches_top", "matches_heaviest", "before_final", "after_final",
            "after_before", "after_ffn", "released", "released_positive")
    parts: dict[int, dict[str, list[np.ndarray]]] = {layer: {k: [] for k in keys} for layer in chosen}

    def on_batch(index: np.ndarray, captured: dict[str, Tensor]) -> None:
        with torch.inference_mode():
            n = len(index)
            outs = [captured[names[(layer, "out")]] for layer in chosen]  # [n, d_model] each
            posts = [captured[names[(layer, "post")]] for layer in chosen]
            mids = [captured[names[(layer, "mid")]] if has_mid else post - out
                    for layer, out, post in zip(chosen, outs, posts)]
            # every layer's projections in a few large products (a row's top token does not depend on the rows
            # beside it): per layer its FFN output and residual under the convention, and the logit lens before
            # and after the FFN, then the final residual's
            tops_of = _row_argmax(lambda x: project(model, x, convention=convention), [*outs, *posts], vocab)
            lens_of = _row_argmax(model.logits, [*mids, *posts, captured[names[(last, "post")]]], vocab)
            final = lens_of[2 * len(chosen) * n:]  # [n]
            for i, layer in enumerate(chosen):
                m = captured[names[(layer, "m")]]  # [n, d_ff]
                ffn_top = tops_of[i * n:(i + 1) * n]  # [n]
                active = m.abs() > abs_threshold if model.gated else m > threshold
                got = memory_agreement(m, ffn_top, *tops[layer], active=active, weight=m.abs() * norms[layer][None],
                                       top_memories=top_memories)
                released = tops_of[(len(chosen) + i) * n:(len(chosen) + i + 1) * n]  # [n]
                got.update(released=torch.isin(released, memory_tops[layer]).numpy(),
                           released_positive=torch.isin(released, tops[layer][0]).numpy())
                before = lens_of[i * n:(i + 1) * n]
                after = lens_of[(len(chosen) + i) * n:(len(chosen) + i + 1) * n]
                got.update(before_final=(before == final).numpy(), after_final=(after == final).numpy(),
                           after_before=(after == before).numpy(), after_ffn=(after == ffn_top).numpy())
                for k in keys:
                    parts[layer][k].append(np.asarray(got[k]))

    read_positions(model, sampled.sequences, sampled.reads, sorted(set(names.values())), on_batch,
                   batch_tokens=batch_tokens)
    rows = []
    for layer in chosen:
        got = {k: np.concatenate(v) for k, v in parts[layer].items()}
        after_other = ~got["after_before"] & ~got["after_ffn"]
        released_none = 1.0 - got["released"].astype(np.float64)
        ffn_none = 1.0 - got["matches_active"].astype(np.float64)
        released_low, released_high = bootstrap_ci(released_none, n_boot=n_boot, seed=seed)
        ffn_low, ffn_high = bootstrap_ci(ffn_none, n_boot=n_boot, seed=seed)
        rows.append({"layer": layer, "positions": len(got["active"]),
                     "released_matches_none": float(released_none.mean()), "released_matches_none_ci_low": released_low,
                     "released_matches_none_ci_high": released_high,
                     "released_matches_none_positive": 1.0 - float(got["released_positive"].mean()),
                     "active": float(got["active"].mean()),
                     "ffn_matches_active": float(got["matches_active"].mean()),
                     "ffn_matches_none": float(ffn_none.mean()), "ffn_matches_none_ci_low": ffn_low,
                     "ffn_matches_none_ci_high": ffn_high,
                     f"ffn_matches_top{top_memories}": float(got["matches_top"].mean()),
                     "ffn_matches_heaviest": float(got["matches_heaviest"].mean()),
                     "before_is_final": float(got["before_final"].mean()),
                     "after_is_final": float(got["after_final"].mean()),
                     "after_is_before": float(got["after_before"].mean()),
                     "after_is_ffn": float(got["after_ffn"].mean()), "after_is_neither": float(after_other.mean())})
    frame = pd.DataFrame(rows)
    if not len(frame):
        raise KvmemError("no positions were read; pass a larger corpus or more positions")
    frame.attrs = provenance("layer_vs_memories", model=model, atlas=atlas, corpus=corpus, convention=convention,
                             settings={**settings, "sides": list(chosen_sides), "n_boot": n_boot,
                                       "released": "top token of hook_resid_post under the convention vs every memory's "
                                                   "top token (value argmax; -v's argmax on the negative side)",
                                       "top_memories": top_memories, "threshold": threshold,
                                       "abs_threshold": abs_threshold, "layers": chosen,
                                       "active_rule": (f"|m_i| > {abs_threshold} (gated FFN)" if model.gated
                                                       else f"m_i > {threshold}"),
                                       "memory_prediction": "top token of m_i * v_i under the convention",
                                       "residual_before": "hook_resid_mid" if has_mid else "hook_resid_post - mlp.hook_out",
                                       "logit_lens": "full final norm, W_U and b_U",
                                       "value_tops_from": "atlas values table" if atlas is not None else "model"})
    if match is not None:
        frame.attrs["fingerprint_match"] = match
    return frame


def plot_layer_vs_memories(frame: pd.DataFrame, *, ax=None):
    """Per layer: the FFN's prediction matched by no single active memory, and the residual's fate after the FFN."""
    import matplotlib.pyplot as plt

    needed = {"layer", "ffn_matches_none", "after_is_before", "after_is_ffn", "after_is_neither", "after_is_final"}
    if not needed <= set(frame.columns):
        raise KvmemError("plot_layer_vs_memories expects the frame of kvmem.experiments.layer_vs_memories")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    if "released_matches_none" in frame:
        ax.fill_between(frame.layer, 100 * frame.released_matches_none_ci_low, 100 * frame.released_matches_none_ci_high,
                        color="black", alpha=0.15)
        ax.plot(frame.layer, 100 * frame.released_matches_none, marker="o", ms=3, color="black",
                label="layer's token (residual + FFN) is no memory's (as released)")
    ax.plot(frame.layer, 100 * frame.ffn_matches_none, marker=".", ms=3, color="tab:purple", lw=0.8,
            label="variant: FFN's token is no active memory's")
    ax.plot(frame.layer, 100 * frame.after_is_before, label="residual keeps its token")
    ax.plot(frame.layer, 100 * frame.after_is_ffn, label="residual takes the FFN's token")
    ax.plot(frame.layer, 100 * frame.after_is_neither, label="neither (composition)")
    ax.plot(frame.layer, 100 * frame.after_is_final, ls="--", color="tab:gray", label="after FFN = final prediction")
    ax.axhline(68, ls=":", color="black", lw=0.8)
    return finish_percent_axes(ax, ylabel="positions (%)", title=f"layer vs. memories ({frame.attrs.get('model', '?')}, "
                                                                  f"{frame.attrs.get('convention', '?')})")
