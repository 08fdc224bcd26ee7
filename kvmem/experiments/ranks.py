"""Rank of a trigger's next token in its memory's vocabulary distribution (Geva et al. 2021, fig. 5).

For each neuron and each of its kept triggers (pooled, as the released code does: one rank per
trigger example), the next token's score under the memory (+v for the top triggers; -v for the
bottom triggers of a signed slot, see :func:`~kvmem.experiments.signed_memories.memory_sides`) is compared
with every vocabulary score: rank = 1 + number of tokens scored strictly higher (1 = the memory's
top token). The pooled rank and the top-1 trigger's rank are both summarised, under every
convention asked for (``raw`` is Geva et al.'s). A rank is a count of the scores above the token's,
over the value's vocabulary scores computed block by block (``block`` slots × vocab at a time; the slots
× vocab matrix never exists), counted in one pass over each row (no sort of the vocabulary).

Baseline: the same triggers ranked under another neuron's value of the layer (a seeded random
derangement), compared per neuron with a paired Wilcoxon signed-rank test and a sign test. A
uniform random token's median rank is about |V| / 2 (a reference). Alignment diagnostic
(``self_rank``): the rank of the trigger's own token, the token at the firing position.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from kvmem.buffers import Buffers
from kvmem.conventions import convention_vectors
from kvmem.errors import KvmemError
from kvmem.experiments.argument_checks import check_positive, check_seed, conventions_for
from kvmem.experiments.atlas_inputs import as_atlas, atlas_layers, check_fingerprint, read_columns
from kvmem.experiments.result_provenance import provenance
from kvmem.experiments.signed_memories import SIDES, memory_sides, trigger_kind
from kvmem.experiments.stats import bootstrap_ci, sign_test, single_cycle, wilcoxon_signed_rank

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
    "convention": "value projection convention",
    "side": "positive (top triggers, +v) or negative (bottom triggers, -v)",
    "layer": "FFN layer",
    "neuron": "neuron (memory slot) index",
    "trigger": "trigger order among the neuron's triggers with a next token (0 = the strongest)",
    "next_token_id": "the token after the trigger",
    "token_id": "the trigger's own token",
    "token_rank": "1 + number of vocabulary tokens the memory scores strictly higher than next_token_id (1 = top)",
    "shuffled_rank": "the same rank under another neuron's value of the same layer (seeded derangement; -1: none)",
    "self_rank": "alignment diagnostic: the rank of the trigger's own token",
}

SUMMARY_COLUMNS = {
    "convention": "value projection convention",
    "side": "memory side",
    "layer": "FFN layer",
    "neurons": "neurons ranked",
    "triggers": "ranked (neuron, trigger) pairs, pooled",
    "median": "median token_rank over all kept triggers of all neurons (pooled, as the released code)",
    "median_ci_low": "bootstrap 95% interval of the pooled median, resampling neurons (low end)",
    "median_ci_high": "its high end",
    "q1": "first quartile of the pooled token_rank",
    "q3": "third quartile",
    "median_top1": "median token_rank of each neuron's top-1 trigger",
    "median_top1_ci_low": "bootstrap 95% interval over neurons (low end)",
    "median_top1_ci_high": "its high end",
    "top1": "fraction of pooled pairs with token_rank == 1 (the memory's top token is the next token)",
    "median_shuffled": "pooled median of shuffled_rank (baseline)",
    "wilcoxon_n": "neurons with a non-zero paired difference (per neuron: median shuffled_rank - median token_rank)",
    "wilcoxon_w_plus": "Wilcoxon signed-rank statistic: sum of the ranks of the positive differences",
    "wilcoxon_z": "its normal approximation (tie-corrected); > 0: the own value ranks the next token better",
    "wilcoxon_p": "two-sided p-value",
    "sign_p": "exact two-sided sign test p-value on the same differences",
    "median_self": "alignment diagnostic: pooled median self_rank (the trigger's own token)",
}


def pair_ranks(vectors: Tensor, basis: Tensor, slots: np.ndarray, tokens: np.ndarray, *,
               signs: np.ndarray | None = None, block: int = 256, work: Buffers | None = None) -> np.ndarray:
    """Rank of ``tokens[p]`` among the scores ``signs[p] * vectors[slots[p]] @ basis`` for each pair p.

    vectors [rows, d_model], basis [d_model, vocab], slots, tokens and signs (+1 / -1, default +1)
    [pairs]. Returns ranks [pairs] int64, 1 + #(scores strictly above the token's score): tokens tied
    with it do not count, so tied tokens share the best rank among them, as after a full sort. The
    scores are float32 (one GEMM of up to 512 MiB of scores); the ranks of all pairs of ``block`` rows are
    counted in one pass over those rows (:func:`_count_beyond`: exactly the count over the row, whatever the
    number of pairs). ``work``: scratch tensors kept between calls.
    """
    import torch

    slots = np.asarray(slots, np.int64)
    tokens = np.asarray(tokens, np.int64)
    signs = np.ones(len(slots), np.int64) if signs is None else np.asarray(signs, np.int64)
    out = np.zeros(len(slots), np.int64)
    if len(slots) == 0:
        return out
    if tokens.min() < 0 or tokens.max() >= basis.shape[1]:
        raise KvmemError(f"token ids must lie in 0..{basis.shape[1] - 1}, got {tokens.min()}..{tokens.max()}")
    if not np.isin(signs, (-1, 1)).all():
        raise KvmemError("signs must be +1 or -1")
    order = np.argsort(slots, kind="stable")
    sorted_slots = slots[order]
    basis = basis.float()
    work = work if work is not None else Buffers()  # the scratch tensors, reused
    # a float32 GEMM runs faster on many rows, the count on few: the scores of several blocks come from one product
    # (no larger than _GEMM_BYTES), and each block is counted on its own; a row's scores do not depend on its
    # neighbours (checked bit for bit against one product per block in the tests)
    vocab = basis.shape[1]
    span = max(block, min(vectors.shape[0], _GEMM_BYTES // (4 * vocab)) // block * block)
    starts = np.unique(sorted_slots // block) * block
    with torch.inference_mode():
        for chunk in np.unique(starts // span) * span:
            mine = starts[(starts >= chunk) & (starts < chunk + span)]
            first, last = int(mine[0]), int(min(mine[-1] + block, vectors.shape[0]))
            rows = vectors[first:last].float()
            product = torch.matmul(rows, basis, out=work.get("scores", (rows.shape[0], vocab), torch.float32)).numpy()
            for start in mine:
                lo, hi = np.searchsorted(sorted_slots, [start, start + block])
                members = order[lo:hi]
                scores = product[start - first:start - first + block]  # [block, vocab]
                out[members] = _count_beyond(scores, slots[members] - start, tokens[members], signs[members],
                                             work=work) + 1
    return out


_GEMM_BYTES = 512 << 20  # the largest score product pair_ranks computes at once
_BINS = 4096  # uniform bins between a row's least and greatest needed score (see _count_beyond)


def _count_beyond(scores: np.ndarray, rows: np.ndarray, tokens: np.ndarray, signs: np.ndarray, *,
                  work: Buffers | None = None) -> np.ndarray:
    """Per pair p: how many of the scores [rows[p], :] lie strictly above its token's score
    t = scores[rows[p], tokens[p]] (signs[p] = +1) or strictly below it (-1, the rank under -v).

    Exact counts in linear time, no sort of the vocabulary. A row's distinct needed scores, ascending,
    are its thresholds T_0 < ... < T_{W-1}; every score s has ``left(s)`` = #{T_j < s} and ``right(s)``
    = #{T_j <= s}, so #{s > T_j} = #{s: left(s) > j} and #{s < T_j} = #{s: right(s) <= j}: histograms of
    left and right summed from either end. left and right come from a monotone bin of each score
    (``_BINS`` uniform bins over the thresholds' range, and two outer bins): in a bin that holds no
    threshold both equal the number of thresholds in lower bins (a lower bin is a smaller value), so
    those scores are counted per bin; only the scores sharing a bin with thresholds are compared with
    them one by one. Float comparisons throughout (-0.0 equals 0.0); NaN scores never count, and a NaN
    token score has no score beyond it, as with ``np.count_nonzero(line > score)``. ``work``: scratch tensors
    kept between calls."""
    import torch

    work = work if work is not None else Buffers()

    used, at = np.unique(rows, return_inverse=True)
    needed = scores[rows, tokens]
    # the thresholds: each row's distinct needed scores, ascending (NaN as +inf, counted 0 at the end)
    key = np.where(np.isnan(needed), np.inf, needed).astype(np.float32)
    order = np.lexsort((key, at))  # by row, then score
    row_sorted, key_sorted = at[order], key[order]
    starts = np.ones(len(order), bool)
    starts[1:] = (row_sorted[1:] != row_sorted[:-1]) | (key_sorted[1:] != key_sorted[:-1])
    distinct = np.cumsum(starts) - 1  # a global index of each distinct (row, score)
    first = np.searchsorted(row_sorted, np.arange(len(used)))  # each row's first pair in the order
    row_first = distinct[first]  # the index of each row's first distinct score
    place = np.empty(len(rows), np.int64)  # each pair's threshold index j within its row
    place[order] = distinct - row_first[row_sorted]
    width = int(place.max()) + 1
    thresholds = np.full((len(used), width), np.inf, np.float32)
    thresholds[at, place] = key
    real = np.zeros((len(used), width), bool)
    real[at, place] = True
    with np.errstate(all="ignore"):
        finite = np.where(real & np.isfinite(thresholds), thresholds, np.nan)
        finite[~np.isfinite(finite).any(axis=1)] = 0.0  # a row without finite thresholds: bins around 0
        low, high = np.nanmin(finite, axis=1).astype(np.float32), np.nanmax(finite, axis=1).astype(np.float32)
        span = high.astype(np.float64) - low
        scale = np.where(span > 0, np.minimum((_BINS - 1) / np.where(span > 0, span, 1.0), 1e30), 1.0)
    low_t, scale_t = torch.from_numpy(low)[:, None], torch.from_numpy(scale.astype(np.float32))[:, None]
    bins = _BINS + 2

    def bin_of(values: torch.Tensor, name: str) -> torch.Tensor:
        """Monotone in the value (a lower bin holds smaller values): floor((s - low) * scale) + 1 in 0..bins-1
        (clamped first, so truncation is the floor), int32. ``values`` hold no NaN."""
        x = torch.sub(values, low_t, out=work.get(name, values.shape, torch.float32))
        x.mul_(scale_t).add_(1).clamp_(0, bins - 1)
        return work.get(name, values.shape, torch.int32).copy_(x)

    with torch.inference_mode():
        line = torch.from_numpy(scores)  # [U, V]: the rows with pairs
        if len(used) < scores.shape[0]:
            line = line.index_select(0, torch.from_numpy(used))
        u = line.shape[0]
        nan = torch.isnan(line)
        has_nan = bool(nan.any())
        t = torch.from_numpy(thresholds)
        in_bin = torch.zeros((u, bins), dtype=torch.int64).scatter_add_(1, bin_of(t, "t").long(),
                                                                        torch.from_numpy(real).long())
        below = in_bin.cumsum(1) - in_bin  # real thresholds in lower bins
        s_bin = bin_of(line.masked_fill(nan, 0) if has_nan else line, "line")  # [U, V]
        offset = (torch.arange(u, dtype=torch.int32) * bins)[:, None]
        flat = s_bin.add_(offset).view(-1)
        per_bin = torch.bincount(flat[~nan.view(-1)] if has_nan else flat, minlength=u * bins).view(u, bins)
        # scores in bins without thresholds: left = right = the thresholds below, counted a bin at a time
        quiet = torch.where(in_bin == 0, per_bin, 0)
        left_hist = torch.zeros((u, width + 1), dtype=torch.int64).scatter_add_(1, below, quiet)
        right_hist = left_hist.clone()
        # the others, each compared with the thresholds of its bin
        special = (in_bin > 0).view(-1).index_select(0, flat)
        if has_nan:
            special &= ~nan.view(-1)
        at_flat = special.nonzero().squeeze(1)
        if at_flat.numel():
            r = at_flat // line.shape[1]
            s = line.view(-1).index_select(0, at_flat)
            cell = flat.index_select(0, at_flat)
            base, count = below.view(-1).index_select(0, cell), in_bin.view(-1).index_select(0, cell)
            left_s, right_s = base.clone(), base.clone()
            for k in range(int(count.max())):  # distinct thresholds: few share a bin
                active = count > k
                value = t[r, (base + k).clamp_(max=width - 1)]
                left_s += (active & (value < s)).long()
                right_s += (active & (value <= s)).long()
            left_hist.view(-1).index_add_(0, r * (width + 1) + left_s, torch.ones_like(r))
            right_hist.view(-1).index_add_(0, r * (width + 1) + right_s, torch.ones_like(r))
        above = left_hist.flip(1).cumsum(1).flip(1)  # above[:, q] = #{left >= q}
        under = right_hist.cumsum(1)  # under[:, q] = #{right <= q}
        row, j = torch.from_numpy(at), torch.from_numpy(place)
        counts = torch.where(torch.from_numpy(signs) > 0, above[row, j + 1], under[row, j]).numpy().copy()
    counts[np.isnan(needed)] = 0
    return counts


def next_token_ranks(atlas: Atlas | str | os.PathLike, model: Model, *, convention: str | Sequence[str] | None = None,
                     sides: str | Sequence[str] | None = None, triggers: int | None = None, kind: str = "top",
                     layers: Sequence[int] | None = None, seed: int = 0, block: int = 256) -> pd.DataFrame:
    """One row per (convention, side, neuron, trigger): the next token's rank (:data:`RANK_COLUMNS`).

    ``triggers``: how many of each neuron's triggers with a next token to rank (None: every kept one,
    pooled as in the released code). ``convention``: one or several (None: raw and final_norm).
    ``sides``: None reads gated FFNs as two memories per neuron, ReLU/GELU as one.
    """
    atlas = as_atlas(atlas)
    conventions = conventions_for(convention)
    check_positive("triggers", triggers, allow_none=True)
    check_seed(seed)
    check_positive("block", block)
    chosen_sides = memory_sides(model.gated, sides)
    chosen = atlas_layers(atlas, layers)
    match = check_fingerprint(atlas, model)
    unembedding = model.unembedding()  # [d_model, vocab]
    frames = {}
    for side in chosen_sides:
        frame = read_columns(atlas, "triggers", ["layer", "neuron", "rank", "token_id", "next_token_id"],
                             [("kind", "=", trigger_kind(side, kind)), ("next_token_id", ">=", 0), ("layer", "in", chosen)])
        frame = frame.sort_values(["layer", "neuron", "rank"], kind="stable")
        frame = frame.assign(trigger=frame.groupby(["layer", "neuron"]).cumcount().to_numpy())
        frames[side] = frame[frame.trigger.to_numpy() < triggers] if triggers is not None else frame
    parts = []
    work = Buffers()  # the scores and the count's scratch, shared by every layer and convention
    for layer in chosen:
        laid = []  # per side: its rows of this layer, their shuffled partners and tokens
        for side in chosen_sides:
            here = frames[side][frames[side].layer.to_numpy() == layer]
            neuron = here.neuron.to_numpy().astype(np.int64)
            neurons = np.unique(neuron)
            sigma = single_cycle(len(neurons), np.random.default_rng([seed, layer]))
            partner = dict(zip(neurons.tolist(), neurons[sigma].tolist()))
            laid.append((side, here, neuron, np.array([partner[n] for n in neuron.tolist()], np.int64),
                         here.next_token_id.to_numpy().astype(np.int64), here.token_id.to_numpy().astype(np.int64),
                         len(neurons)))
        # both sides' pairs in one call per convention: the same value vectors, so one product and one sort
        slots = np.concatenate([np.concatenate([neuron, other, neuron]) for _, _, neuron, other, *_ in laid])
        wanted = np.concatenate([np.concatenate([tokens, tokens, own]) for *_, tokens, own, _ in laid])
        signs = np.concatenate([np.full(3 * len(neuron), SIDES[side][2]) for side, _, neuron, *_ in laid])
        for name in conventions:
            vectors = convention_vectors(model, model.written_values(layer), name)  # [d_ff, d_model]
            ranks = pair_ranks(vectors, unembedding, slots, wanted, signs=signs, block=block, work=work)
            at = 0
            for side, here, neuron, _, tokens, own_tokens, distinct in laid:
                n = len(neuron)
                mine, at = ranks[at:at + 3 * n], at + 3 * n
                parts.append(pd.DataFrame({
                    "convention": name, "side": side, "layer": layer, "neuron": neuron,
                    "trigger": here.trigger.to_numpy(), "next_token_id": tokens, "token_id": own_tokens,
                    "token_rank": mine[:n], "shuffled_rank": mine[n:2 * n] if distinct > 1 else -1,
                    "self_rank": mine[2 * n:]}))
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(RANK_COLUMNS))
    if len(out):  # side, then convention, then layer: the order of agreement's rows
        order = np.lexsort((out.layer.to_numpy(), pd.Categorical(out.convention, categories=conventions).codes,
                            pd.Categorical(out.side, categories=list(chosen_sides)).codes))
        out = out.iloc[order].reset_index(drop=True)
    out.attrs = provenance("next_token_rank", model=model, atlas=atlas, convention=conventions[0], settings={
        "conventions": conventions, "sides": list(chosen_sides), "triggers": triggers, "kind": kind, "layers": chosen,
        "seed": seed, "rank": "1 + number of tokens scored strictly higher (1 = top)",
        "pooled": "every kept trigger with a next token" if triggers is None else f"the top {triggers} per neuron"})
    out.attrs["fingerprint_match"] = match
    out.attrs["random_median"] = (model.vocab_size + 1) / 2
    return out


def _groups(frame: pd.DataFrame) -> list[str]:
    return [c for c in ("convention", "side", "layer") if c in frame]


def summarize_ranks(ranks: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per (convention, side, layer): pooled and top-1 medians with bootstrap intervals, quartiles, and the
    paired per-neuron test against the shuffled baseline (:data:`SUMMARY_COLUMNS`) of :func:`next_token_ranks`'s
    rows. Rows without a ``trigger`` column count as top-1 triggers."""
    if not {"layer", "token_rank"} <= set(ranks.columns):
        raise KvmemError(f"summarize_ranks needs columns layer and token_rank, got {list(ranks.columns)}")
    check_positive("n_boot", n_boot)
    rows = []
    keys = _groups(ranks)
    for key, part in ranks.groupby(keys, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        r = part.token_rank.to_numpy().astype(np.float64)
        neuron = part.neuron.to_numpy() if "neuron" in part else np.arange(len(part))
        first = part.trigger.to_numpy() == 0 if "trigger" in part else np.ones(len(part), bool)
        shuffled = part.shuffled_rank.to_numpy().astype(np.float64) if "shuffled_rank" in part else np.full(len(r), -1.0)
        row = dict(zip(keys, key))
        row["layer"] = int(row["layer"])
        row.update(neurons=len(np.unique(neuron)), triggers=len(r), median=float(np.median(r)))
        row["median_ci_low"], row["median_ci_high"] = bootstrap_ci(r, groups=neuron, statistic="median",
                                                                   n_boot=n_boot, seed=seed)
        row.update(q1=float(np.quantile(r, 0.25)), q3=float(np.quantile(r, 0.75)),
                   median_top1=float(np.median(r[first])) if first.any() else float("nan"))
        row["median_top1_ci_low"], row["median_top1_ci_high"] = bootstrap_ci(r[first], statistic="median",
                                                                             n_boot=n_boot, seed=seed)
        row["top1"] = float(np.mean(r == 1))
        has_baseline = shuffled.min() >= 1
        row["median_shuffled"] = float(np.median(shuffled)) if has_baseline else float("nan")
        if has_baseline:
            per = pd.DataFrame({"neuron": neuron, "own": r, "other": shuffled}).groupby("neuron").median()
            test = wilcoxon_signed_rank(per.other.to_numpy(), per.own.to_numpy())
            sign = sign_test(per.other.to_numpy(), per.own.to_numpy())
        else:
            test = {"n": 0, "w_plus": float("nan"), "z": float("nan"), "p_value": float("nan")}
            sign = {"p_value": float("nan")}
        row.update(wilcoxon_n=test["n"], wilcoxon_w_plus=test["w_plus"], wilcoxon_z=test["z"],
                   wilcoxon_p=test["p_value"], sign_p=sign["p_value"])
        row["median_self"] = float(np.median(part.self_rank)) if "self_rank" in part else float("nan")
        rows.append(row)
    out = pd.DataFrame(rows, columns=[c for c in SUMMARY_COLUMNS if c in keys or c not in ("convention", "side")])
    out.attrs = {**ranks.attrs, "summary": {"n_boot": n_boot, "seed": seed,
                                            "bootstrap": "pooled median: neurons resampled with all their triggers"}}
    return out


def next_token_rank(atlas: Atlas | str | os.PathLike, model: Model, *, convention: str | Sequence[str] | None = None,
                    sides: str | Sequence[str] | None = None, triggers: int | None = None, kind: str = "top",
                    layers: Sequence[int] | None = None, seed: int = 0, n_boot: int = 1000,
                    block: int = 256) -> pd.DataFrame:
    """Per convention, side and layer: the median rank of the triggers' next tokens in the memory's vocabulary
    distribution, pooled over all kept triggers and for the top-1 trigger, with bootstrap intervals and a
    paired test against shuffled values (Geva et al.: 10k-15k in low layers, under 2k at the top for WikiLM).

    Needs the model (full vocabulary scores, computed in blocks). Columns :data:`SUMMARY_COLUMNS`;
    provenance in ``frame.attrs`` (``random_median`` = (|V| + 1) / 2, a reference). Per-trigger rows:
    :func:`next_token_ranks`.
    """
    return summarize_ranks(next_token_ranks(atlas, model, convention=convention, sides=sides, triggers=triggers,
                                            kind=kind, layers=layers, seed=seed, block=block), n_boot=n_boot, seed=seed)


def plot_next_token_rank(frame: pd.DataFrame, *, ax=None, convention: str | None = None):
    """Pooled median rank per layer and side (line) with its bootstrap band, the top-1 trigger's median (thin),
    the shuffled baseline (dashed) and |V|/2 (dotted); log scale; one convention (default raw)."""
    from kvmem.experiments.value_agreement import side_panels

    if not {"layer", "median", "median_ci_low", "median_ci_high"} <= set(frame.columns):
        raise KvmemError("plot_next_token_rank expects the frame of kvmem.experiments.next_token_rank")
    frame, convention, ax, panels = side_panels(frame, convention, ax)
    for color, side, part in panels:
        ax.fill_between(part.layer, part.median_ci_low, part.median_ci_high, color=color, alpha=0.2)
        ax.plot(part.layer, part["median"], color=color, marker="o", ms=3, label=f"{side}: median, all triggers")
        ax.plot(part.layer, part.median_top1, color=color, lw=0.8, label=f"{side}: median, top-1 trigger")
        ax.plot(part.layer, part.median_shuffled, color=color, ls="--", lw=1, label=f"{side}: shuffled values")
    random_median = frame.attrs.get("random_median")
    if random_median:
        ax.axhline(random_median, ls=":", color="tab:gray", lw=1, label="random token (|V|/2, reference)")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("rank in the memory's distribution (1 = top)")
    ax.set_title(f"next-token rank ({frame.attrs.get('model', '?')}, {convention})")
    ax.legend(fontsize="small")
    return ax
