"""Token removal (Geva et al. 2021, sec. 3.2): which part of a trigger prefix makes a key fire?

For a seeded sample of neurons per layer and their top triggers, the prefix is the window tokens up to
and including the trigger position (what the model read, by the tokenization rule of
:mod:`kvmem.corpus`). The key's coefficient is recomputed on the prefix as is, and with one token
removed: the first, the last (the trigger itself; the coefficient is then read at the new last
token) or a random one strictly between them. The BOS token, when the atlas prepends one, stays.
A prefix of one token has no variant (NaN); one of two tokens has no random variant.

The unmodified recomputation reproduces the atlas's stored activation (``original`` vs ``stored``);
the summary reports the largest difference. Removing the last token needs no extra forward: in a
causal model the prefix without its last token is read at the previous position of the original.
For the same reason the samples of one window share their reads: the unmodified prefixes are read from
one sequence (the window up to its last sampled trigger) and those without their first token from that
sequence without its first token, at every sampled layer in one forward. The random removal is one
sequence per sample, read to its layer.

Signed (gated) FFNs are read as two memories per neuron (:func:`~kvmem.experiments.signed_memories.memory_sides`):
the negative side samples bottom triggers, and its changes are signed so that a negative change
always means a weaker memory: change = sign · (modified - original) / |original|. Every per-layer
mean has a bootstrap interval over the sampled prefixes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from kvmem.atlas_origin import scanned_corpus
from kvmem.errors import KvmemError
from kvmem.experiments.argument_checks import check_positive, check_seed
from kvmem.experiments.atlas_inputs import as_atlas, atlas_layers, check_fingerprint, read_columns
from kvmem.experiments.forward import read_positions, scan_plan
from kvmem.experiments.result_provenance import provenance
from kvmem.experiments.signed_memories import memory_sides, trigger_kind
from kvmem.experiments.stats import bootstrap_ci

if TYPE_CHECKING:
    from kvmem.atlas import Atlas
    from kvmem.models import Model

__all__ = [
    "REMOVALS",
    "REMOVAL_COLUMNS",
    "SAMPLE_COLUMNS",
    "plot_token_removal",
    "relative_change",
    "summarize_token_removal",
    "token_removal",
    "token_removal_samples",
]

REMOVALS = ("first", "last", "random")

SAMPLE_COLUMNS = {
    "side": "positive (top triggers) or negative (bottom triggers, signed FFNs)",
    "layer": "FFN layer", "neuron": "neuron (memory slot) index", "trigger": "trigger rank (0 = strongest)",
    "doc": "document index", "doc_id": "document id", "pos": "trigger position in the document",
    "prefix_len": "tokens in the prefix (window start .. trigger, BOS not counted)",
    "random_index": "index in the prefix of the randomly removed token (-1: none)",
    "stored": "the atlas's activation", "original": "coefficient recomputed on the unmodified prefix",
    "first": "coefficient with the first prefix token removed", "last": "with the last (trigger) token removed",
    "random": "with a random interior token removed",
    "change_first": "sign * (first - original) / |original| (sign -1 on the negative side: < 0 is weaker)",
    "change_last": "sign * (last - original) / |original|", "change_random": "sign * (random - original) / |original|",
}

REMOVAL_COLUMNS = {
    "side": "memory side",
    "layer": "FFN layer",
    "samples": "(neuron, trigger) pairs",
    "change_first": "mean relative change of the coefficient with the first token removed",
    "change_first_ci_low": "bootstrap 95% interval over the samples (low end; likewise for last and random)",
    "change_first_ci_high": "its high end",
    "change_last": "the same, last token removed",
    "change_last_ci_low": "bootstrap 95% interval (low end)", "change_last_ci_high": "its high end",
    "change_random": "the same, a random interior token removed",
    "change_random_ci_low": "bootstrap 95% interval (low end)", "change_random_ci_high": "its high end",
    "median_last": "median relative change, last token removed",
    "max_abs_error": "largest |original - stored|: the recomputation check (float tolerance)",
}


def relative_change(original: np.ndarray, modified: np.ndarray, *, eps: float = 1e-8) -> np.ndarray:
    """(modified - original) / |original|; NaN where |original| <= eps."""
    original = np.asarray(original, np.float64)
    modified = np.asarray(modified, np.float64)
    out = np.full(original.shape, np.nan)
    ok = np.abs(original) > eps
    out[ok] = (modified[ok] - original[ok]) / np.abs(original[ok])
    return out


def _document_tokens(model: Model, corpus, wanted: dict[int, str]) -> dict[int, list[int]]:
    """doc index -> token ids, for the wanted documents (their ids checked against the atlas)."""
    out: dict[int, list[int]] = {}
    for document in corpus:
        if document.index in wanted:
            if document.id != wanted[document.index]:
                raise KvmemError(f"document {document.index} of corpus {corpus.spec!r} is {document.id!r}, but the atlas "
                                 f"recorded {wanted[document.index]!r}: this is not the scanned corpus; pass it with corpus=")
            out[document.index] = model.encode(document.text)
            if len(out) == len(wanted):
                break
    if len(out) < len(wanted):
        raise KvmemError(f"corpus {corpus.spec!r} ended before document {max(set(wanted) - set(out))}; "
                         f"this is not the scanned corpus; pass it with corpus=")
    return out


def token_removal_samples(atlas: Atlas | str | os.PathLike, model: Model, corpus: Any = None, *,
                          neurons_per_layer: int = 10, triggers: int = 3, kind: str = "top",
                          sides: str | Sequence[str] | None = None, layers: Sequence[int] | None = None, seed: int = 0,
                          batch_tokens: int = 4096) -> pd.DataFrame:
    """One row per (side, sampled neuron, trigger): coefficients before and after each removal
    (:data:`SAMPLE_COLUMNS`). ``sides``: None reads gated FFNs as two memories per neuron, ReLU/GELU as one."""
    atlas = as_atlas(atlas)
    check_positive("neurons_per_layer", neurons_per_layer)
    check_positive("triggers", triggers)
    check_seed(seed)
    if kind not in ("top", "top_doc"):
        raise KvmemError(f"kind must be 'top' or 'top_doc', got {kind!r}")
    chosen = atlas_layers(atlas, layers)
    chosen_sides = memory_sides(model.gated, sides)
    match = check_fingerprint(atlas, model)
    corpus = scanned_corpus(atlas, corpus)
    plan = scan_plan(model, atlas=atlas)  # the windows and BOS the scan read
    extra = plan.offset  # index of a window's first token in the model's input

    picked = []
    for s, side in enumerate(chosen_sides):
        frame = read_columns(atlas, "triggers", ["layer", "neuron", "rank", "activation", "doc", "doc_id", "pos",
                                                 "token_id"],
                             [("kind", "=", trigger_kind(side, kind)), ("rank", "<", triggers), ("layer", "in", chosen)])
        for layer in chosen:
            # a layer's sample does not depend on the other layers (nor the positive side's on the negative one)
            rng = np.random.default_rng([seed, layer] if s == 0 else [seed, layer, 2 + s])
            here = frame[frame.layer.to_numpy() == layer]
            neurons = np.unique(here.neuron.to_numpy())
            keep = np.sort(rng.choice(neurons, size=min(neurons_per_layer, len(neurons)), replace=False))
            picked.append(here[here.neuron.isin(keep).to_numpy()].assign(side=side, side_order=s))
    samples = pd.concat(picked, ignore_index=True).sort_values(["side_order", "layer", "neuron", "rank"],
                                                               ignore_index=True)
    tokens = _document_tokens(model, corpus, dict(zip(samples.doc.tolist(), samples.doc_id.tolist())))

    n = len(samples)
    values = {name: np.full(n, np.nan) for name in ("original", "first", "last", "random")}
    doc_of, pos_of = samples.doc.to_numpy().astype(np.int64), samples.pos.to_numpy().astype(np.int64)
    layer_of, neuron_of = samples.layer.to_numpy().astype(np.int64), samples.neuron.to_numpy().astype(np.int64)
    token_of = samples.token_id.to_numpy().astype(np.int64)
    start_of = np.array([plan.window_start(int(p)) for p in pos_of], np.int64)
    prefix_len = pos_of + 1 - start_of
    for i in range(n):
        ids = tokens[int(doc_of[i])]
        if pos_of[i] >= len(ids) or ids[pos_of[i]] != token_of[i]:
            raise KvmemError(f"token {pos_of[i]} of document {doc_of[i]} differs from the atlas's: this is not the "
                             f"scanned corpus, or the tokenizer differs; pass the scanned corpus (corpus=) and model")
    hooks = {layer: model.hook_name(layer, "post") for layer in chosen}

    def read(sequences: list, reads: list, targets: list, layers) -> None:
        """Read each layer of ``layers`` at ``reads``; ``targets[r]``: the (sample, column) pairs read ``r`` fills."""
        names = [hooks[layer] for layer in sorted(set(layers))]

        def on_batch(index: np.ndarray, captured) -> None:
            for row, r in enumerate(index.tolist()):
                for sample, column in targets[r]:
                    values[column][sample] = float(captured[hooks[layer_of[sample]]][row, neuron_of[sample]])

        read_positions(model, sequences, reads, names, on_batch, batch_tokens=batch_tokens)

    # The unmodified prefix and the one without its first token. In a causal model the coefficient at a prefix's
    # last token is the one at that position of any sequence that starts with the prefix, so the samples of one
    # window share two sequences (up to its last sampled trigger, with and without the window's first token), read
    # at every layer their samples need; the forward stops at the deepest.
    windows: dict[tuple[int, int], list[int]] = {}
    for i in range(n):
        windows.setdefault((int(doc_of[i]), int(start_of[i])), []).append(i)
    by_depth: dict[int, list[tuple[int, int]]] = {}
    for window, members in windows.items():
        by_depth.setdefault(int(layer_of[members].max()), []).append(window)
    for depth in sorted(by_depth):
        sequences, reads, targets = [], [], []
        for doc, start in by_depth[depth]:
            members = windows[(doc, start)]
            prefix = tokens[doc][start:int(pos_of[members].max()) + 1]
            whole: dict[int, list] = {}  # position in the model's input -> what it fills
            shifted: dict[int, list] = {}  # the same, first token removed
            for i in members:
                at = extra + int(prefix_len[i]) - 1
                whole.setdefault(at, []).append((i, "original"))
                if prefix_len[i] >= 2:
                    whole.setdefault(at - 1, []).append((i, "last"))
                    shifted.setdefault(at - 1, []).append((i, "first"))
            for sequence, places in ((prefix, whole), (prefix[1:], shifted)):
                if places:
                    sequences.append(plan.model_input(sequence))
                    reads.append(sorted(places))
                    targets += [places[at] for at in sorted(places)]
        read(sequences, reads, targets, layer_of[[i for w in by_depth[depth] for i in windows[w]]])

    # The random removal: one sequence per sample, read at its layer.
    random_index = np.full(n, -1, np.int64)
    for s, layer in [(s, layer) for s in range(len(chosen_sides)) for layer in chosen]:
        rng = np.random.default_rng([seed, layer, 1] if s == 0 else [seed, layer, 1, s])  # the random removals
        rows = np.flatnonzero((layer_of == layer) & (samples.side_order.to_numpy() == s) & (prefix_len >= 3))
        sequences, reads, targets = [], [], []
        for i in rows:
            prefix = tokens[int(doc_of[i])][int(start_of[i]):int(pos_of[i]) + 1]
            r = int(rng.integers(1, len(prefix) - 1))
            random_index[i] = r
            sequences.append(plan.model_input(prefix[:r] + prefix[r + 1:]))
            reads.append([extra + len(prefix) - 2])
            targets.append([(i, "random")])
        read(sequences, reads, targets, [layer])

    out = pd.DataFrame({
        "side": samples.side.to_numpy(), "layer": samples.layer.to_numpy(), "neuron": samples.neuron.to_numpy(), "trigger": samples["rank"].to_numpy(),
        "doc": samples.doc.to_numpy(), "doc_id": samples.doc_id.to_numpy(), "pos": samples.pos.to_numpy(),
        "prefix_len": prefix_len, "random_index": random_index,
        "stored": samples.activation.to_numpy().astype(np.float64), **values})
    sign = np.where(out.side.to_numpy() == "negative", -1.0, 1.0)
    for name in REMOVALS:
        out[f"change_{name}"] = sign * relative_change(out.original.to_numpy(), out[name].to_numpy())
    out.attrs = provenance("token_removal", model=model, atlas=atlas, settings={
        "neurons_per_layer": neurons_per_layer, "triggers": triggers, "kind": kind, "sides": list(chosen_sides),
        "layers": chosen, "seed": seed,
        "prefix": "window tokens up to and including the trigger; BOS kept; random = uniform interior token"})
    out.attrs["fingerprint_match"] = match
    return out


def summarize_token_removal(samples: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per side and layer: mean relative change per removal with bootstrap intervals (:data:`REMOVAL_COLUMNS`)
    from :func:`token_removal_samples`."""
    needed = {"layer", "stored", "original", *(f"change_{n}" for n in REMOVALS)}
    if not needed <= set(samples.columns):
        raise KvmemError(f"summarize_token_removal needs columns {sorted(needed)}, got {list(samples.columns)}")
    samples = samples if "side" in samples else samples.assign(side="positive")
    rows = []
    for (side, layer), part in samples.groupby(["side", "layer"], sort=False):
        row = {"side": side, "layer": int(layer), "samples": len(part)}
        for name in REMOVALS:
            change = part[f"change_{name}"].to_numpy()
            row[f"change_{name}"] = float(np.nanmean(change)) if np.isfinite(change).any() else float("nan")
            row[f"change_{name}_ci_low"], row[f"change_{name}_ci_high"] = bootstrap_ci(change, n_boot=n_boot, seed=seed)
        last = part.change_last.to_numpy()
        row["median_last"] = float(np.nanmedian(last)) if np.isfinite(last).any() else float("nan")
        row["max_abs_error"] = float(np.nanmax(np.abs(part.original.to_numpy() - part.stored.to_numpy())))
        rows.append(row)
    out = pd.DataFrame(rows, columns=list(REMOVAL_COLUMNS))
    out.attrs = {**samples.attrs, "summary": {"n_boot": n_boot, "seed": seed}}
    return out


def token_removal(atlas: Atlas | str | os.PathLike, model: Model, corpus: Any = None, *, neurons_per_layer: int = 10,
                  triggers: int = 3, kind: str = "top", sides: str | Sequence[str] | None = None,
                  layers: Sequence[int] | None = None, seed: int = 0, n_boot: int = 1000,
                  batch_tokens: int = 4096) -> pd.DataFrame:
    """Per layer, the mean relative change of a key's coefficient when the first, last or a random token
    of its trigger prefixes is removed (Geva et al.: last ≈ -65..-70% at layer 1, ≈ -20% at the top;
    first / random ≈ -10..-20%).

    ``corpus``: the scanned corpus (default: re-opened from the atlas manifest; in-memory corpora must
    be passed again). ``neurons_per_layer`` neurons are drawn per layer and side (``seed``), each with its
    top ``triggers`` triggers of ``kind`` (bottom triggers on the negative side).``n_boot``: the bootstrap. Columns :data:`REMOVAL_COLUMNS`; per-sample rows:
    :func:`token_removal_samples`.
    """
    return summarize_token_removal(token_removal_samples(
        atlas, model, corpus, neurons_per_layer=neurons_per_layer, triggers=triggers, kind=kind, sides=sides,
        layers=layers, seed=seed, batch_tokens=batch_tokens), n_boot=n_boot, seed=seed)


def plot_token_removal(frame: pd.DataFrame, *, ax=None):
    """Mean relative coefficient change (%) per layer for each removal."""
    import matplotlib.pyplot as plt

    if not {"layer", *(f"change_{n}" for n in REMOVALS)} <= set(frame.columns):
        raise KvmemError("plot_token_removal expects the frame of kvmem.experiments.token_removal")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    sides = frame.side if "side" in frame else pd.Series("positive", index=frame.index)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (name, marker), color in zip(zip(REMOVALS, "os^"), colors):
        for side, style in (("positive", "-"), ("negative", "--")):
            part = frame[sides.to_numpy() == side]
            if not len(part):
                continue
            if f"change_{name}_ci_low" in part:
                ax.fill_between(part.layer, 100 * part[f"change_{name}_ci_low"], 100 * part[f"change_{name}_ci_high"],
                                color=color, alpha=0.15)
            ax.plot(part.layer, 100 * part[f"change_{name}"], color=color, ls=style, marker=marker, ms=4,
                    label=f"{name} token removed ({side})")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean change of the coefficient (%)")
    ax.set_title(f"token removal ({frame.attrs.get('model', '?')})")
    ax.legend(fontsize="small")
    return ax
