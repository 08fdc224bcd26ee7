"""The evidence about one neuron side, split into what an explainer sees and what a scorer judges.

A side is one memory of a neuron (:data:`kvmem.experiments.signed_memories.SIDES`): ``positive`` reads m_i
with +v_i, ``negative`` reads -m_i with -v_i (gated FFNs). Every number here is the *side
activation* ``a = sign * m_i``, so "fires" always means a large ``a``.

Examples of a side (one kept position each, with its stored context):

- ``top``: the side's triggers (top triggers for positive, bottom triggers for negative);
- ``q0.9``, ``q0.99``, ``q0.999``: bin samples whose histogram bin lies wholly above the side's
  0.9, 0.99, 0.999 quantile level (bins are assigned to levels by the count before them, as
  :meth:`kvmem.atlas.Atlas.quantile_samples` does);
- ``below``: the other bin samples (non-activating; the explainer sees them, scorers do not);
- ``random``: the layer's uniform random sample; activating when ``a`` reaches the side's
  threshold (the lower edge of its first ``q0.9`` bin), else non-activating.

A position kept twice is one example: a trigger first, then a random sample (its context
coefficients are stored), then a bin sample.

Each position's split comes from :func:`kvmem.autointerp.splits.held_out_mask` on its code (the whole
window the scan read it in goes to one set). Context
coefficients are stored for triggers and random samples (``activations``), not for bin samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvmem.autointerp.splits import DEFAULT_HELD_OUT, DEFAULT_SEED, held_out_mask, held_out_tokens, split_window
from kvmem.errors import KvmemError
from kvmem.experiments.signed_memories import SIDES, memory_sides

__all__ = ["Example", "SideEvidence", "WrittenToken", "split_written", "ACTIVE_LEVELS", "BANDS", "load_evidence", "neuron_sides", "sides_from_rows",
           "frame_rows", "ROW_COLUMNS"]

ACTIVE_LEVELS = (0.9, 0.99, 0.999)
BANDS = ("top", "q0.999", "q0.99", "q0.9", "below", "random")


class Example(NamedTuple):
    """One kept position of one side (a NamedTuple: a layer holds about a hundred per neuron side).

    code: ``doc << 32 | pos``;  band: one of :data:`BANDS`;  tokens: [T] the stored context;
    index: the kept token in ``tokens``;  activation: side activation at the kept token;
    activations: [T] side activations at every token, or None (bin samples store none);
    active: the neuron side fires here;  held_out: the position is in the held-out set.
    """

    code: int
    band: str
    tokens: tuple[str, ...]
    index: int
    activation: float
    activations: tuple[float, ...] | None
    active: bool
    held_out: bool


class WrittenToken(NamedTuple):
    """A token of a value's projection: its vocabulary id, text and rank (0: strongest)."""

    id: int
    token: str
    rank: int


def split_written(pairs, *, seed: int, held_out: float) -> tuple[tuple[str, ...], tuple[WrittenToken, ...]]:
    """(explain-set tokens, held-out :class:`WrittenToken`) of (token_id, token) pairs, strongest first, split by
    :func:`~kvmem.autointerp.splits.held_out_tokens`."""
    pairs = list(pairs)
    held = held_out_tokens([i for i, _ in pairs], seed=seed, held_out=held_out) if pairs else []
    return (tuple(t for (_, t), h in zip(pairs, held) if not h),
            tuple(WrittenToken(int(i), t, r) for r, ((i, t), h) in enumerate(zip(pairs, held)) if h))


@dataclass(frozen=True, kw_only=True)
class SideEvidence:
    """What the atlas knows about one side: its examples and what its memory writes.

    writes: tokens the side's memory promotes (the value's promoted tokens for positive, its
    suppressed tokens for negative), strongest first, of the explain set (what explainers see);
    opposes: the tokens it pushes down, likewise;  held_writes, held_opposes: the held-out ones
    (:func:`split_written`; the output scorer's);  threshold: the side activation at which it counts as
    firing; convention: of the written tokens.
    """

    layer: int
    neuron: int
    side: str
    examples: tuple[Example, ...]
    writes: tuple[str, ...]
    opposes: tuple[str, ...]
    threshold: float
    convention: str
    held_writes: tuple[WrittenToken, ...] = ()
    held_opposes: tuple[WrittenToken, ...] = ()

    def part(self, *, held_out: bool) -> list[Example]:
        return [e for e in self.examples if e.held_out == held_out]


def neuron_sides(atlas, sides=None) -> tuple[str, ...]:
    """The sides to explain for this atlas's FFN: positive only for ReLU/GELU, both when gated."""
    return memory_sides(bool(atlas.manifest.model.get("gated")), sides)


ROW_COLUMNS = ("kind", "doc", "pos", "activation", "context_tokens", "context_trigger", "context_activations", "bin")


def frame_rows(frame) -> dict[str, list]:
    """Columns of a triggers or samples frame as Python lists (``bin`` is -1 for triggers)."""
    rows = {c: frame[c].tolist() for c in ROW_COLUMNS if c in frame.columns}
    rows.setdefault("bin", [-1] * len(frame))
    rows.setdefault("context_activations", [None] * len(frame))
    return rows


def _examples(rows: dict, keep: list[int], sign: int, *, band, active, split) -> list[Example]:
    out = []
    tokens_all, values_all = rows["context_tokens"], rows["context_activations"]
    docs, poss, triggers, acts = rows["doc"], rows["pos"], rows["context_trigger"], rows["activation"]
    for i, band_name, is_active in zip(keep, band, active):
        tokens = tuple(tokens_all[i])
        stored = values_all[i]
        values = None if stored is None or len(stored) != len(tokens) or not tokens else \
            (tuple(stored) if sign > 0 else tuple(-v for v in stored))
        code = (int(docs[i]) << 32) | int(poss[i])
        out.append(Example(code, band_name, tokens, int(triggers[i]), float(sign * acts[i]), values, bool(is_active),
                           split[code]))
    return out


def load_evidence(atlas, layer: int, neuron: int, *, sides=None, seed: int = DEFAULT_SEED,
                  held_out: float = DEFAULT_HELD_OUT, convention: str | None = None) -> list[SideEvidence]:
    """The evidence of each side of one neuron, from the atlas's public queries."""
    atlas.check(layer, neuron)
    sides = neuron_sides(atlas, sides)
    convention = convention or atlas.default_convention
    try:
        samples = atlas.samples(layer, neuron)
    except KvmemError as error:
        raise KvmemError(f"explanations are scored against non-activating samples and {error}") from None
    histogram = atlas.histogram(layer, neuron)
    values = atlas.values(layer, neuron, convention=convention)
    promoted = [(int(i), t) for i, t in values[values.kind == "promote"].sort_values("rank")[["token_id", "token"]]
                .itertuples(index=False)]
    suppressed = [(int(i), t) for i, t in values[values.kind == "suppress"].sort_values("rank")[["token_id", "token"]]
                  .itertuples(index=False)]
    return sides_from_rows(layer, neuron, triggers=frame_rows(atlas.triggers(layer, neuron)), samples=frame_rows(samples),
                             counts=histogram["count"].to_numpy(), low=histogram.low.to_numpy(),
                             high=histogram.high.to_numpy(), promoted=promoted, suppressed=suppressed, sides=sides,
                             seed=seed, held_out=held_out, window=split_window(atlas), convention=convention)


def sides_from_rows(layer: int, neuron: int, *, triggers: dict, samples: dict, counts, low, high, promoted, suppressed,
                    sides, seed: int, held_out: float, window: int, convention: str) -> list[SideEvidence]:
    """The sides' evidence from one neuron's rows: ``triggers`` and ``samples`` as :func:`frame_rows` of the frames
    :meth:`Atlas.triggers` and :meth:`Atlas.samples` return, its histogram ``counts`` [bins] with bin edges ``low``,
    ``high`` [bins], and the value's promoted and suppressed tokens ((token_id, token) pairs, strongest first); ``window``: tokens per split
    unit (:func:`~kvmem.autointerp.splits.held_out_mask`)."""
    counts = np.asarray(counts, np.float64)
    cumulative = np.cumsum(counts) / max(counts.sum(), 1.0)
    codes = np.asarray([(int(d) << 32) | int(p) for d, p in zip(triggers["doc"] + samples["doc"],
                                                                triggers["pos"] + samples["pos"])], np.int64)
    split = dict(zip(codes.tolist(), held_out_mask(codes, seed=seed, held_out=held_out, window=window).tolist()))
    with_context = [i for i, t in enumerate(samples["context_tokens"]) if t is not None and len(t) > 0]
    sample_kind = samples["kind"]
    random_rows = [i for i in with_context if sample_kind[i] == "random"]
    bin_rows = [i for i in with_context if sample_kind[i] == "bin"]
    random_values = np.asarray([samples["activation"][i] for i in random_rows], np.float64)
    out = []
    for side in sides:
        kind, _, sign = SIDES[side]
        # the fraction of positions beyond each bin, counted from the side's extreme
        beyond = np.concatenate([[0.0], cumulative[:-1]]) if sign > 0 else 1.0 - cumulative
        level = np.searchsorted(np.asarray(ACTIVE_LEVELS), beyond, side="right")  # 0: below 0.9
        band_of_bin = np.array(["below", *(f"q{v:g}" for v in ACTIVE_LEVELS)])[level]
        active_bins = np.flatnonzero((level > 0) & (counts > 0))
        if len(active_bins):
            edges = np.asarray(low) if sign > 0 else -np.asarray(high)
            threshold = float(edges[active_bins].min())
        else:
            threshold = float("inf")
        examples: dict[int, Example] = {}
        side_triggers = [i for i, k in enumerate(triggers["kind"]) if k == kind]
        for e in _examples(triggers, side_triggers, sign, band=["top"] * len(side_triggers),
                           active=[True] * len(side_triggers), split=split):
            examples.setdefault(e.code, e)
        fired = (sign * random_values) >= threshold
        for e in _examples(samples, random_rows, sign, band=["random"] * len(random_rows), active=fired, split=split):
            examples.setdefault(e.code, e)
        bin_band = [str(band_of_bin[samples["bin"][i]]) for i in bin_rows]
        for e in _examples(samples, bin_rows, sign, band=bin_band, active=[b != "below" for b in bin_band],
                           split=split):
            examples.setdefault(e.code, e)
        writes, opposes = (promoted, suppressed) if sign > 0 else (suppressed, promoted)
        writes, held_writes = split_written(writes, seed=seed, held_out=held_out)
        opposes, held_opposes = split_written(opposes, seed=seed, held_out=held_out)
        out.append(SideEvidence(layer=layer, neuron=neuron, side=side, examples=tuple(examples.values()),
                                writes=writes, opposes=opposes, threshold=threshold, convention=convention,
                                held_writes=held_writes, held_opposes=held_opposes))
    return out
