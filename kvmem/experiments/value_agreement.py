"""Agreement (Geva et al. 2021, sec. 4): does a value promote the token that follows its key's triggers?

For each key (memory slot) of a layer: its value's top token (argmax of the value's vocabulary
scores under a projection convention) is compared with the next token of the key's top trigger
(or any of its top-k triggers). Two baselines: uniform random tokens (1/|V| per distinct next
token), and the same keys paired with the values of other slots of the same layer (a seeded
random single-cycle permutation, so no key keeps its own value).

Everything comes from the atlas (triggers and the values table's rank-0 tokens): no model needed.
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
    check_seed,
    provenance,
    read_columns,
    single_cycle,
    value_top_tokens,
)

if TYPE_CHECKING:
    from kvmem.atlas import Atlas
    from kvmem.models import Model

__all__ = ["AGREEMENT_COLUMNS", "DEFAULT_TOP_TRIGGERS", "agreement", "agreement_from_frames", "plot_agreement"]

DEFAULT_TOP_TRIGGERS = (1, 5, 25)

AGREEMENT_COLUMNS = {
    "layer": "FFN layer",
    "keys": "keys with at least one trigger that has a next token (triggers at a document's last token have none "
            "and are skipped, so a key's top-1 trigger is its best trigger with a next token)",
    "agree_top{k}": "fraction of keys whose value's top token is the next token of one of the key's top-k triggers",
    "shuffled_top{k}": "the same with each key paired with another slot's value (seeded random derangement)",
    "random_top{k}": "chance level: mean over keys of (distinct next tokens among the top-k triggers) / |V|",
}


def agreement_from_frames(triggers: pd.DataFrame, value_tops: pd.DataFrame, *, vocab_size: int,
                          top_triggers: Sequence[int] = DEFAULT_TOP_TRIGGERS, seed: int = 0) -> pd.DataFrame:
    """The agreement metric from plain frames (the pure core of :func:`agreement`).

    ``triggers``: columns layer, neuron, rank (0 = the key's strongest trigger), next_token_id (-1: none).
    ``value_tops``: columns layer, neuron, token_id: each slot's value's top token.
    ``seed``: the shuffled pairing of each layer is drawn from ``default_rng([seed, layer])``.
    Returns one row per layer, columns :data:`AGREEMENT_COLUMNS` (one agree/shuffled/random column per k).
    """
    check_seed(seed)
    ks = sorted({int(k) for k in top_triggers})
    if not ks or ks[0] < 1:
        raise KvmemError(f"top_triggers must be integers >= 1, got {list(top_triggers)}")
    if vocab_size < 1:
        raise KvmemError(f"vocab_size must be >= 1, got {vocab_size}")
    for frame, needed, name in ((triggers, {"layer", "neuron", "rank", "next_token_id"}, "triggers"),
                                (value_tops, {"layer", "neuron", "token_id"}, "value_tops")):
        if not needed <= set(frame.columns):
            raise KvmemError(f"{name} needs columns {sorted(needed)}, got {list(frame.columns)}")
    valid = triggers[triggers.next_token_id.to_numpy() >= 0].sort_values(["layer", "neuron", "rank"], kind="stable")
    valid = valid.assign(order=valid.groupby(["layer", "neuron"]).cumcount().to_numpy())
    rows = []
    for layer, tops in value_tops.groupby("layer", sort=True):
        top_of = dict(zip(tops.neuron.to_numpy().tolist(), tops.token_id.to_numpy().tolist()))
        here = valid[(valid.layer.to_numpy() == layer) & valid.neuron.isin(list(top_of)).to_numpy()]
        keys = np.unique(here.neuron.to_numpy())
        row = {"layer": int(layer), "keys": len(keys)}
        # shuffled: key keys[i] is paired with the value of keys[sigma[i]]
        sigma = single_cycle(len(keys), np.random.default_rng([seed, int(layer)]))  # per layer: independent of the others
        shuffled_of = {int(keys[i]): top_of[int(keys[sigma[i]])] for i in range(len(keys))}
        for k in ks:
            part = here[here.order.to_numpy() < k]
            neuron = part.neuron.to_numpy()
            nxt = part.next_token_id.to_numpy()
            own = np.array([top_of[n] for n in neuron.tolist()], np.int64)
            other = np.array([shuffled_of[n] for n in neuron.tolist()], np.int64)
            hits = pd.DataFrame({"neuron": neuron, "own": nxt == own, "other": nxt == other, "next": nxt})
            per_key = hits.groupby("neuron").agg(own=("own", "any"), other=("other", "any"), distinct=("next", "nunique"))
            n = max(len(keys), 1)
            row[f"agree_top{k}"] = float(per_key.own.sum()) / n if len(keys) else float("nan")
            row[f"shuffled_top{k}"] = float(per_key.other.sum()) / n if len(keys) > 1 else float("nan")
            row[f"random_top{k}"] = float(per_key.distinct.mean()) / vocab_size if len(keys) else float("nan")
        rows.append(row)
    columns = ["layer", "keys"] + [f"{p}_top{k}" for k in ks for p in ("agree", "shuffled", "random")]
    return pd.DataFrame(rows, columns=columns)


def agreement(atlas: Atlas | str | os.PathLike, *, model: Model | None = None, convention: str = "final_norm",
              top_triggers: Sequence[int] | None = None, kind: str = "top", layers: Sequence[int] | None = None,
              seed: int = 0) -> pd.DataFrame:
    """Per layer, the fraction of keys whose value's top token is the next token of the key's top trigger(s).

    ``atlas``: an Atlas or its directory. ``convention``: value projection (``final_norm`` or ``raw``),
    read from the atlas's values table (rank 0 = the full argmax over the vocabulary); ``model`` is
    needed only for a convention the atlas lacks (its fingerprint is checked). ``top_triggers``:
    the k values (default 1, 5, 25, capped at the atlas's top_k). ``kind``: ``top`` (top-k positions)
    or ``top_doc`` (one per document, Geva et al.'s choice; needs an atlas scanned with per_document).
    ``seed``: the shuffled baseline's permutation. Columns: :data:`AGREEMENT_COLUMNS`; provenance in
    ``frame.attrs``.
    """
    atlas = as_atlas(atlas)
    if kind not in ("top", "top_doc"):
        raise KvmemError(f"kind must be 'top' or 'top_doc', got {kind!r}")
    if kind == "top_doc" and not atlas.manifest["scan"].get("per_document"):
        raise KvmemError(f"atlas {atlas.path} has no per-document triggers; use kind='top' or rescan with --per-document")
    check_convention(convention, None if model is not None else atlas)
    top_k = int(atlas.manifest["scan"]["top_k"])
    if top_triggers is None:
        ks = sorted({min(k, top_k) for k in DEFAULT_TOP_TRIGGERS})
    else:
        ks = sorted({int(k) for k in top_triggers})
        if not ks or ks[0] < 1 or ks[-1] > top_k:
            raise KvmemError(f"top_triggers must lie in 1..{top_k} (the atlas keeps {top_k} triggers per key), got {ks}")
    chosen = atlas_layers(atlas, layers)
    match = check_fingerprint(atlas, model) if model is not None else None
    triggers = read_columns(atlas, "triggers", ["layer", "neuron", "rank", "next_token_id"],
                            [("kind", "=", kind), ("next_token_id", ">=", 0)])
    triggers = triggers[triggers.layer.isin(chosen)]
    parts = []
    for layer in chosen:
        top, _ = value_top_tokens(model, layer, convention, atlas=atlas)
        parts.append(pd.DataFrame({"layer": layer, "neuron": np.arange(len(top)), "token_id": top}))
    vocab_size = int(atlas.manifest["model"]["vocab_size"])
    frame = agreement_from_frames(triggers, pd.concat(parts, ignore_index=True), vocab_size=vocab_size,
                                  top_triggers=ks, seed=seed)
    frame.attrs = provenance("agreement", model=model, atlas=atlas, convention=convention, settings={
        "top_triggers": ks, "kind": kind, "layers": chosen, "seed": seed,
        "value_top": "argmax of the value's vocabulary scores (atlas values table, rank 0, kind promote)"})
    if match is not None:
        frame.attrs["fingerprint_match"] = match
    return frame


def plot_agreement(frame: pd.DataFrame, *, ax=None):
    """Agreement (solid), the shuffled-values baseline (dashed) and chance (dotted) per layer, in percent."""
    import matplotlib.pyplot as plt

    ks = [int(c.removeprefix("agree_top")) for c in frame.columns if c.startswith("agree_top")]
    if "layer" not in frame or not ks:
        raise KvmemError("plot_agreement expects the frame of kvmem.experiments.agreement (columns layer, agree_top<k>)")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, k in enumerate(ks):
        color = colors[i % len(colors)]
        ax.plot(frame.layer, 100 * frame[f"agree_top{k}"], color=color, marker="o", ms=3, label=f"top-{k} trigger(s)")
        ax.plot(frame.layer, 100 * frame[f"shuffled_top{k}"], color=color, ls="--", lw=1, label=f"top-{k}, shuffled values")
        ax.plot(frame.layer, 100 * frame[f"random_top{k}"], color=color, ls=":", lw=1)
    ax.set_xlabel("layer")
    ax.set_ylabel("keys whose value's top token\nis a trigger's next token (%)")
    convention = frame.attrs.get("convention", "?")
    ax.set_title(f"agreement ({frame.attrs.get('model', '?')}, {convention}; dotted: chance)")
    ax.legend(fontsize="small")
    return ax
