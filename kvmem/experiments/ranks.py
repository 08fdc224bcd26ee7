"""Rank of a trigger's next token in its value's vocabulary distribution (Geva et al. 2021, fig. 5).

For each key's top trigger(s), the next token's score under the value (``convention``) is compared
with every vocabulary score of the same value: rank = 1 + number of tokens scored strictly higher
(1 = the value's top token). Scores are computed block by block, ``block`` slots × vocab at a time;
the slots × vocab matrix never exists. Baseline: the same triggers ranked under another slot's
value (a seeded random derangement within the layer); a uniform random token's median rank is
about |V| / 2.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from kvmem.errors import KvmemError
from kvmem.experiments.common import (
    as_atlas,
    atlas_layers,
    check_convention,
    check_fingerprint,
    check_positive,
    check_seed,
    convention_vectors,
    provenance,
    read_columns,
    single_cycle,
)

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.atlas import Atlas
    from kvmem.models import Model

__all__ = [
    "RANK_COLUMNS",
    "SUMMARY_COLUMNS",
    "next_token_rank",
    "next_token_ranks",
    "pair_ranks",
    "plot_next_token_rank",
    "summarize_ranks",
]

RANK_COLUMNS = {
    "layer": "FFN layer",
    "neuron": "memory slot",
    "trigger": "trigger rank (0 = the key's strongest trigger with a next token)",
    "next_token_id": "the token after the trigger",
    "token_rank": "1 + number of vocabulary tokens the value scores strictly higher than next_token_id (1 = top)",
    "shuffled_rank": "the same rank under another slot's value of the same layer (seeded derangement)",
}

SUMMARY_COLUMNS = {
    "layer": "FFN layer",
    "triggers": "ranked (key, trigger) pairs",
    "median": "median token_rank",
    "q1": "first quartile of token_rank",
    "q3": "third quartile of token_rank",
    "top1": "fraction with token_rank == 1 (the value's top token is the next token)",
    "median_shuffled": "median shuffled_rank (baseline)",
}


def pair_ranks(vectors: Tensor, basis: Tensor, slots: np.ndarray, tokens: np.ndarray, *, block: int = 256) -> np.ndarray:
    """Rank of ``tokens[p]`` among the scores ``vectors[slots[p]] @ basis`` for each pair p.

    vectors [rows, d_model], basis [d_model, vocab], slots and tokens [pairs] int. Returns
    ranks [pairs] int64, 1 + #(scores strictly above the token's score). At most ``block`` rows ×
    vocab scores (and pairs-in-block × vocab comparisons) exist at once.
    """
    import torch

    slots = np.asarray(slots, np.int64)
    tokens = np.asarray(tokens, np.int64)
    out = np.zeros(len(slots), np.int64)
    if len(slots) == 0:
        return out
    if tokens.min() < 0 or tokens.max() >= basis.shape[1]:
        raise KvmemError(f"token ids must lie in 0..{basis.shape[1] - 1}, got {tokens.min()}..{tokens.max()}")
    order = np.argsort(slots, kind="stable")
    sorted_slots = slots[order]
    basis = basis.float()
    with torch.inference_mode():
        for start in np.unique(sorted_slots // block) * block:
            lo, hi = np.searchsorted(sorted_slots, [start, start + block])
            members = order[lo:hi]
            scores = vectors[start:start + block].float() @ basis  # [block, vocab]
            rows = torch.from_numpy(slots[members] - start)
            own = scores[rows, torch.from_numpy(tokens[members])]  # [members]
            for chunk in range(0, len(members), block):  # [chunk, vocab] comparisons at a time
                part = slice(chunk, chunk + block)
                higher = (scores[rows[part]] > own[part, None]).sum(dim=1)
                out[members[part]] = higher.cpu().numpy() + 1
    return out


def next_token_ranks(atlas: Atlas | str | os.PathLike, model: Model, *, convention: str = "final_norm",
                     triggers: int = 1, kind: str = "top", layers: Sequence[int] | None = None, seed: int = 0,
                     block: int = 256) -> pd.DataFrame:
    """One row per (key, trigger): the next token's rank in the value's distribution (:data:`RANK_COLUMNS`).

    ``triggers``: how many of each key's top triggers (those with a next token) to rank.
    """
    atlas = as_atlas(atlas)
    check_convention(convention)
    check_positive("triggers", triggers)
    check_seed(seed)
    check_positive("block", block)
    if kind not in ("top", "top_doc"):
        raise KvmemError(f"kind must be 'top' or 'top_doc', got {kind!r}")
    chosen = atlas_layers(atlas, layers)
    match = check_fingerprint(atlas, model)
    frame = read_columns(atlas, "triggers", ["layer", "neuron", "rank", "next_token_id"], [("kind", "=", kind)])
    frame = frame[(frame.next_token_id.to_numpy() >= 0) & frame.layer.isin(chosen).to_numpy()]
    frame = frame.sort_values(["layer", "neuron", "rank"], kind="stable")
    frame = frame.assign(trigger=frame.groupby(["layer", "neuron"]).cumcount().to_numpy())
    frame = frame[frame.trigger.to_numpy() < triggers]
    unembedding = model.unembedding()  # [d_model, vocab]
    parts = []
    for layer in chosen:
        here = frame[frame.layer.to_numpy() == layer]
        neuron = here.neuron.to_numpy().astype(np.int64)
        tokens = here.next_token_id.to_numpy().astype(np.int64)
        keys = np.unique(neuron)
        sigma = single_cycle(len(keys), np.random.default_rng([seed, layer]))  # as agreement's shuffle
        partner = dict(zip(keys.tolist(), keys[sigma].tolist()))
        other = np.array([partner[n] for n in neuron.tolist()], np.int64)
        vectors = convention_vectors(model, model.values(layer), convention)  # [d_ff, d_model]
        ranks = pair_ranks(vectors, unembedding, np.concatenate([neuron, other]), np.concatenate([tokens, tokens]),
                           block=block)
        parts.append(pd.DataFrame({"layer": layer, "neuron": neuron, "trigger": here.trigger.to_numpy(),
                                   "next_token_id": tokens, "token_rank": ranks[:len(neuron)],
                                   "shuffled_rank": ranks[len(neuron):] if len(keys) > 1 else -1}))
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(RANK_COLUMNS))
    out.attrs = provenance("next_token_rank", model=model, atlas=atlas, convention=convention, settings={
        "triggers": triggers, "kind": kind, "layers": chosen, "seed": seed,
        "rank": "1 + number of tokens scored strictly higher (1 = top)"})
    out.attrs["fingerprint_match"] = match
    out.attrs["random_median"] = (model.vocab_size + 1) / 2
    return out


def summarize_ranks(ranks: pd.DataFrame) -> pd.DataFrame:
    """Per-layer median and quartiles of :func:`next_token_ranks`'s rows (:data:`SUMMARY_COLUMNS`)."""
    if not {"layer", "token_rank"} <= set(ranks.columns):
        raise KvmemError(f"summarize_ranks needs columns layer and token_rank, got {list(ranks.columns)}")
    rows = []
    for layer, part in ranks.groupby("layer", sort=True):
        r = part.token_rank.to_numpy().astype(np.float64)
        shuffled = part.shuffled_rank.to_numpy().astype(np.float64) if "shuffled_rank" in part else np.array([-1.0])
        rows.append({"layer": int(layer), "triggers": len(r), "median": float(np.median(r)),
                     "q1": float(np.quantile(r, 0.25)), "q3": float(np.quantile(r, 0.75)),
                     "top1": float(np.mean(r == 1)),
                     "median_shuffled": float(np.median(shuffled)) if shuffled.min() >= 1 else float("nan")})
    out = pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
    out.attrs = dict(ranks.attrs)
    return out


def next_token_rank(atlas: Atlas | str | os.PathLike, model: Model, *, convention: str = "final_norm",
                    triggers: int = 1, kind: str = "top", layers: Sequence[int] | None = None, seed: int = 0,
                    block: int = 256) -> pd.DataFrame:
    """Per layer, median and quartiles of the rank of each key's top-trigger next token in its value's
    vocabulary distribution (Geva et al.: 10k-15k in low layers, under 2k in top layers for WikiLM).

    Needs the model (full vocabulary scores, computed in blocks). Columns :data:`SUMMARY_COLUMNS`;
    provenance in ``frame.attrs`` (``random_median`` = (|V| + 1) / 2). Per-trigger rows:
    :func:`next_token_ranks`.
    """
    return summarize_ranks(next_token_ranks(atlas, model, convention=convention, triggers=triggers, kind=kind,
                                            layers=layers, seed=seed, block=block))


def plot_next_token_rank(frame: pd.DataFrame, *, ax=None):
    """Median rank (line) with the quartile band, the shuffled baseline (dashed) and |V|/2 (dotted); log scale."""
    import matplotlib.pyplot as plt

    if not {"layer", "median", "q1", "q3"} <= set(frame.columns):
        raise KvmemError("plot_next_token_rank expects the frame of kvmem.experiments.next_token_rank")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    ax.fill_between(frame.layer, frame.q1, frame.q3, alpha=0.25, label="quartiles")
    ax.plot(frame.layer, frame["median"], marker="o", ms=3, label="median rank of the next token")
    if "median_shuffled" in frame:
        ax.plot(frame.layer, frame.median_shuffled, ls="--", color="tab:gray", label="median, shuffled values")
    random_median = frame.attrs.get("random_median")
    if random_median:
        ax.axhline(random_median, ls=":", color="tab:gray", lw=1, label="random token (|V|/2)")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("rank in the value's distribution (1 = top)")
    ax.set_title(f"next-token rank ({frame.attrs.get('model', '?')}, {frame.attrs.get('convention', '?')})")
    ax.legend(fontsize="small")
    return ax
