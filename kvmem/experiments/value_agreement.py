"""Agreement (Geva et al. 2021, sec. 4): does a memory's value promote the token that follows its triggers?

For each neuron (memory slot) of a layer, its value's top token (argmax of the value's vocabulary
scores under a projection convention) is compared with the next token of the neuron's top trigger,
and with the next tokens of any of its top-k triggers. Signed (gated) FFNs are read as two memories
per neuron: the top triggers with +v (the value's top token) and the bottom triggers with -v (the
value's bottom token, its most suppressed); ReLU/GELU models keep the paper's positive side
(:func:`~kvmem.experiments.signed_memories.memory_sides`). Each side is reported apart, under every
convention asked for (``raw`` is Geva et al.'s: the output embedding, no final norm).

Null: the exact expectation of agreement when the layer's values are permuted uniformly among its
neurons (:func:`~kvmem.experiments.stats.exact_permutation_null`), which keeps token frequencies;
1/|V| per distinct next token is kept only as a labelled reference (``chance_*``). Uncertainty: a
bootstrap interval over neurons. Alignment diagnostic (``self_*``): the same comparison with the
trigger's own token, the token *at* the firing position, which is what the released code's
``record_tokens[-2]`` reads if taken literally.

Everything comes from the atlas (triggers and the values table's rank-0 tokens): no model needed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from kvmem.errors import KvmemError
from kvmem.experiments.argument_checks import check_positive, check_seed, conventions_for
from kvmem.experiments.atlas_inputs import as_atlas, atlas_layers, check_fingerprint, read_columns, value_top_tokens
from kvmem.experiments.result_provenance import provenance
from kvmem.experiments.signed_memories import memory_sides, trigger_kind
from kvmem.experiments.stats import bootstrap_ci, exact_permutation_null_of_pairs

if TYPE_CHECKING:
    from kvmem.atlas import Atlas
    from kvmem.models import Model

__all__ = ["AGREEMENT_COLUMNS", "DEFAULT_TOP_TRIGGERS", "agreement", "agreement_from_frames", "plot_agreement"]

DEFAULT_TOP_TRIGGERS = (1, 5, 25)

AGREEMENT_COLUMNS = {
    "convention": "value projection convention (raw: W_U^T v, Geva et al.'s; final_norm: through the final norm)",
    "side": "positive: top triggers with +v; negative: bottom triggers with -v (signed FFNs only)",
    "layer": "FFN layer",
    "neurons": "neurons with at least one trigger that has a next token (triggers at a document's last token have "
               "none and are skipped, so a neuron's top-1 trigger is its best trigger with a next token)",
    "agree_top{k}": "fraction of neurons whose value's top token is the next token of one of their top-k triggers",
    "agree_top{k}_ci_low": "bootstrap 95% interval over neurons (low end)",
    "agree_top{k}_ci_high": "its high end",
    "null_top{k}": "exact expected agreement with the layer's values permuted among its neurons (the null)",
    "chance_top{k}": "reference only, not a null: mean over neurons of (distinct next tokens among the top-k) / |V|",
    "self_top1": "alignment diagnostic: the value's top token is the top-1 trigger's own token (not the next)",
    "null_self_top1": "exact permutation null of self_top1",
}


def agreement_from_frames(triggers: pd.DataFrame, value_tops: pd.DataFrame, *, vocab_size: int,
                          top_triggers: Sequence[int] = DEFAULT_TOP_TRIGGERS, n_boot: int = 1000,
                          seed: int = 0) -> pd.DataFrame:
    """The agreement metric from plain frames (the pure core of :func:`agreement`), one side and convention.

    ``triggers``: columns layer, neuron, rank (0 = the neuron's strongest trigger), next_token_id (-1: none)
    and, for the alignment diagnostic, token_id. ``value_tops``: columns layer, neuron, token_id: each
    memory's top token. ``seed``: the bootstrap's. Returns one row per layer, the columns of
    :data:`AGREEMENT_COLUMNS` from ``layer`` on (one agree/ci/null/chance group per k).
    """
    check_seed(seed)
    check_positive("n_boot", n_boot)
    ks = sorted({int(k) for k in top_triggers})
    if not ks or ks[0] < 1:
        raise KvmemError(f"top_triggers must be integers >= 1, got {list(top_triggers)}")
    if vocab_size < 1:
        raise KvmemError(f"vocab_size must be >= 1, got {vocab_size}")
    for frame, needed, name in ((triggers, {"layer", "neuron", "rank", "next_token_id"}, "triggers"),
                                (value_tops, {"layer", "neuron", "token_id"}, "value_tops")):
        if not needed <= set(frame.columns):
            raise KvmemError(f"{name} needs columns {sorted(needed)}, got {list(frame.columns)}")
    has_self = "token_id" in triggers
    valid = triggers[triggers.next_token_id.to_numpy() >= 0].sort_values(["layer", "neuron", "rank"], kind="stable")
    valid = valid.assign(order=valid.groupby(["layer", "neuron"]).cumcount().to_numpy())
    rows = []
    for layer, tops in value_tops.groupby("layer", sort=True):
        top_of = np.full(int(tops.neuron.max()) + 1, -1, np.int64)  # neuron -> its memory's top token
        top_of[tops.neuron.to_numpy()] = tops.token_id.to_numpy()
        here = valid[valid.layer.to_numpy() == layer]
        here_neuron = here.neuron.to_numpy().astype(np.int64)
        listed = np.isin(here_neuron, tops.neuron.to_numpy())
        here, here_neuron = here[listed], here_neuron[listed]
        order = here.order.to_numpy()
        neurons = np.unique(here_neuron)
        own = top_of[neurons]  # [neurons] each memory's top token
        row = {"layer": int(layer), "neurons": len(neurons)}
        for k in ks:
            first = order < k
            owners, targets = _distinct_pairs(np.searchsorted(neurons, here_neuron[first]),
                                              here.next_token_id.to_numpy()[first])
            hits = np.zeros(len(neurons), np.float64)  # the memory's top token is one of its top-k next tokens
            hits[owners[targets == own[owners]]] = 1.0
            row[f"agree_top{k}"] = float(hits.mean()) if len(hits) else float("nan")
            row[f"agree_top{k}_ci_low"], row[f"agree_top{k}_ci_high"] = bootstrap_ci(hits, n_boot=n_boot, seed=seed)
            row[f"null_top{k}"] = exact_permutation_null_of_pairs(owners, targets, own)
            row[f"chance_top{k}"] = (float(np.mean(np.bincount(owners, minlength=len(neurons)))) / vocab_size
                                     if len(hits) else float("nan"))
        if has_self:
            first = order == 0
            owners = np.searchsorted(neurons, here_neuron[first])
            tokens = here.token_id.to_numpy()[first]
            row["self_top1"] = float(np.mean(tokens == own[owners])) if len(own) else float("nan")
            row["null_self_top1"] = exact_permutation_null_of_pairs(owners, tokens, own)
        rows.append(row)
    columns = ["layer", "neurons"] + [f"{p}_top{k}{q}" for k in ks for p, q in (
        ("agree", ""), ("agree", "_ci_low"), ("agree", "_ci_high"), ("null", ""), ("chance", ""))]
    return pd.DataFrame(rows, columns=columns + (["self_top1", "null_self_top1"] if has_self else []))


def _distinct_pairs(owners: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (owner, target) pairs, as two arrays."""
    pairs = np.unique(np.stack([owners.astype(np.int64), targets.astype(np.int64)], axis=1).reshape(-1, 2), axis=0)
    return pairs[:, 0], pairs[:, 1]


def agreement(atlas: Atlas | str | os.PathLike, *, model: Model | None = None,
              convention: str | Sequence[str] | None = None, sides: str | Sequence[str] | None = None,
              top_triggers: Sequence[int] | None = None, kind: str = "top", layers: Sequence[int] | None = None,
              n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per convention, side and layer: the fraction of neurons whose value's top token is the next token of
    their top trigger (``agree_top1``) or of any of their top-k triggers, with its exact permutation null,
    a bootstrap interval and the self-token alignment diagnostic.

    ``atlas``: an Atlas or its directory. ``convention``: one or several of ``raw`` (Geva et al.'s) and
    ``final_norm``; None: both, read from the atlas's values table (rank 0 = the full argmax), so
    ``model`` is needed only for a convention the atlas lacks (its fingerprint is checked). ``sides``:
    None reads gated FFNs as two memories per neuron and ReLU/GELU as one (see :data:`AGREEMENT_COLUMNS`).
    ``top_triggers``: the k values (default 1, 5, 25, capped at the atlas's top_k). ``kind``: ``top``
    (top-k positions) or ``top_doc`` (one per document, Geva et al.'s choice; needs a per-document atlas).
    ``n_boot``/``seed``: the bootstrap. Columns :data:`AGREEMENT_COLUMNS`; provenance in ``frame.attrs``.
    """
    atlas = as_atlas(atlas)
    if kind not in ("top", "top_doc"):
        raise KvmemError(f"kind must be 'top' or 'top_doc', got {kind!r}")
    if kind == "top_doc" and not atlas.manifest.scan.get("per_document"):
        raise KvmemError(f"atlas {atlas.path} has no per-document triggers; use kind='top' or rescan with --per-document")
    conventions = conventions_for(convention if convention is not None or model is not None else
                                  [c for c in ("raw", "final_norm") if c in atlas.conventions],
                                  None if model is not None else atlas)
    gated = bool(atlas.manifest.model.get("gated"))
    chosen_sides = memory_sides(gated, sides)
    top_k = int(atlas.manifest.scan["top_k"])
    if top_triggers is None:
        ks = sorted({min(k, top_k) for k in DEFAULT_TOP_TRIGGERS})
    else:
        ks = sorted({int(k) for k in top_triggers})
        if not ks or ks[0] < 1 or ks[-1] > top_k:
            raise KvmemError(f"top_triggers must lie in 1..{top_k} (the atlas keeps {top_k} triggers per neuron), got {ks}")
    chosen = atlas_layers(atlas, layers)
    check_seed(seed)
    match = check_fingerprint(atlas, model) if model is not None else None
    vocab_size = int(atlas.manifest.model["vocab_size"])
    parts = []
    for side in chosen_sides:
        triggers = read_columns(atlas, "triggers", ["layer", "neuron", "rank", "token_id", "next_token_id"],
                                [("kind", "=", trigger_kind(side, kind)), ("next_token_id", ">=", 0),
                                 ("layer", "in", chosen)])
        for name in conventions:
            tops = []
            for layer in chosen:
                top = value_top_tokens(model, layer, name, atlas=atlas)[0 if side == "positive" else 1]
                tops.append(pd.DataFrame({"layer": layer, "neuron": np.arange(len(top)), "token_id": top}))
            frame = agreement_from_frames(triggers, pd.concat(tops, ignore_index=True), vocab_size=vocab_size,
                                          top_triggers=ks, n_boot=n_boot, seed=seed)
            frame.insert(0, "side", side)
            frame.insert(0, "convention", name)
            parts.append(frame)
    frame = pd.concat(parts, ignore_index=True)
    frame.attrs = provenance("agreement", model=model, atlas=atlas, convention=conventions[0], settings={
        "conventions": conventions, "sides": list(chosen_sides), "top_triggers": ks, "kind": kind, "layers": chosen,
        "n_boot": n_boot, "seed": seed, "gated": gated,
        "null": "exact expectation under a uniform permutation of the layer's values among its neurons",
        "chance": "reference only: distinct next tokens / |V|",
        "value_top": "argmax of the memory's vocabulary scores (+v: values table promote rank 0; -v: suppress rank 0)"})
    if match is not None:
        frame.attrs["fingerprint_match"] = match
    return frame


def side_panels(frame: pd.DataFrame, convention: str | None, ax):
    """A per-layer plot's parts: (frame of one convention, the convention, ax, [(color, side, rows)])."""
    import matplotlib.pyplot as plt

    frame, convention = _panel(frame, convention)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = frame.groupby(frame.side if "side" in frame else np.zeros(len(frame)), sort=False)
    return frame, convention, ax, [(colors[i % len(colors)], side, part) for i, (side, part) in enumerate(groups)]


def _panel(frame: pd.DataFrame, convention: str | None) -> tuple[pd.DataFrame, str]:
    """The rows of one convention (default: raw when present, Geva et al.'s), and its name."""
    if "convention" not in frame:
        return frame, frame.attrs.get("convention", "?")
    names = list(dict.fromkeys(frame.convention))
    chosen = convention or ("raw" if "raw" in names else names[0])
    if chosen not in names:
        raise KvmemError(f"convention {chosen!r} is not in this frame; it has {', '.join(names)}")
    return frame[frame.convention == chosen], chosen


def plot_agreement(frame: pd.DataFrame, *, ax=None, convention: str | None = None):
    """Top-1 agreement per layer and side with its bootstrap band, the exact permutation null (dashed) and
    the 1/|V| reference (dotted), in percent, for one convention (default raw)."""

    if not {"layer", "agree_top1", "null_top1"} <= set(frame.columns):
        raise KvmemError("plot_agreement expects the frame of kvmem.experiments.agreement (columns layer, agree_top1, "
                         "null_top1)")
    frame, convention, ax, panels = side_panels(frame, convention, ax)
    for color, side, part in panels:
        ax.fill_between(part.layer, 100 * part.agree_top1_ci_low, 100 * part.agree_top1_ci_high, color=color, alpha=0.2)
        ax.plot(part.layer, 100 * part.agree_top1, color=color, marker="o", ms=3, label=f"{side} side, top-1 trigger")
        ax.plot(part.layer, 100 * part.null_top1, color=color, ls="--", lw=1, label=f"{side}, permutation null")
    ax.plot(frame.layer, 100 * frame.chance_top1, color="tab:gray", ls=":", lw=1, label="1/|V| (reference)")
    ax.set_xlabel("layer")
    ax.set_ylabel("neurons whose value's top token\nis the trigger's next token (%)")
    ax.set_title(f"agreement ({frame.attrs.get('model', '?')}, {convention})")
    ax.legend(fontsize="small")
    return ax
