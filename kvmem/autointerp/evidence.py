"""The evidence about one neuron side, split into what an explainer sees and what a scorer judges.

A side is one memory of a neuron (:data:`kvmem.experiments.common.SIDES`): ``positive`` reads m_i
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

Each position's split comes from :func:`kvmem.autointerp.splits.held_out_mask` on its code. Context
coefficients are stored for triggers and random samples (``activations``), not for bin samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmem.autointerp.splits import DEFAULT_HELD_OUT, DEFAULT_SEED, held_out_mask
from kvmem.errors import KvmemError
from kvmem.experiments.common import SIDES, memory_sides
from kvmem.plan import pack

__all__ = ["Example", "SideEvidence", "ACTIVE_LEVELS", "BANDS", "load_evidence", "neuron_sides"]

ACTIVE_LEVELS = (0.9, 0.99, 0.999)
BANDS = ("top", "q0.999", "q0.99", "q0.9", "below", "random")


@dataclass(frozen=True, kw_only=True)
class Example:
    """One kept position of one side.

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


@dataclass(frozen=True, kw_only=True)
class SideEvidence:
    """What the atlas knows about one side: its examples and what its memory writes.

    writes: tokens the side's memory promotes (the value's promoted tokens for positive, its
    suppressed tokens for negative), strongest first;  opposes: the tokens it pushes down;
    threshold: the side activation at which it counts as firing; convention: of ``writes``.
    """

    layer: int
    neuron: int
    side: str
    examples: tuple[Example, ...]
    writes: tuple[str, ...]
    opposes: tuple[str, ...]
    threshold: float
    convention: str

    def part(self, *, held_out: bool) -> list[Example]:
        return [e for e in self.examples if e.held_out == held_out]


def neuron_sides(atlas, sides=None) -> tuple[str, ...]:
    """The sides to explain for this atlas's FFN: positive only for ReLU/GELU, both when gated."""
    return memory_sides(bool(atlas.manifest.model.get("gated")), sides)


def _frame_examples(frame, sign: int, *, band, active, codes_split) -> list[Example]:
    out = []
    has_values = "context_activations" in frame.columns
    columns = [frame[c].tolist() for c in ("doc", "pos", "context_tokens", "context_trigger", "activation")]
    stored_all = frame["context_activations"].tolist() if has_values else [None] * len(frame)
    for doc, pos, tokens, trigger, activation, stored, band_name, is_active in zip(*columns, stored_all, band, active):
        tokens = tuple(str(t) for t in tokens)
        values = None if stored is None or len(stored) != len(tokens) or not len(tokens) else \
            tuple(float(a) for a in (np.asarray(stored, np.float64) * sign))
        code = (int(doc) << 32) | int(pos)
        out.append(Example(code=code, band=band_name, tokens=tokens, index=int(trigger), activation=float(sign * activation),
                           activations=values, active=bool(is_active), held_out=bool(codes_split[code])))
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
    samples = samples[samples.context_tokens.map(lambda t: t is not None and len(t) > 0)]
    triggers = atlas.triggers(layer, neuron)
    histogram = atlas.histogram(layer, neuron)
    values = atlas.values(layer, neuron, convention=convention)
    counts = histogram["count"].to_numpy().astype(np.float64)
    total = max(counts.sum(), 1.0)
    cumulative = np.cumsum(counts) / total
    codes = np.concatenate([pack(triggers.doc.to_numpy(np.int64), triggers.pos.to_numpy(np.int64)),
                            pack(samples.doc.to_numpy(np.int64), samples.pos.to_numpy(np.int64))])
    split = dict(zip(codes.tolist(), held_out_mask(codes, seed=seed, held_out=held_out).tolist()))
    promoted = tuple(values[values.kind == "promote"].sort_values("rank").token)
    suppressed = tuple(values[values.kind == "suppress"].sort_values("rank").token)
    out = []
    for side in sides:
        kind, _, sign = SIDES[side]
        # the fraction of positions beyond each bin, counted from the side's extreme
        beyond = np.concatenate([[0.0], cumulative[:-1]]) if sign > 0 else 1.0 - cumulative
        level = np.searchsorted(np.asarray(ACTIVE_LEVELS), beyond, side="right")  # 0: below 0.9
        band_of_bin = np.array(["below", *(f"q{v:g}" for v in ACTIVE_LEVELS)])[level]
        active_bins = np.flatnonzero((level > 0) & (counts > 0))
        if len(active_bins):
            edges = histogram.low.to_numpy() if sign > 0 else -histogram.high.to_numpy()
            threshold = float(edges[active_bins].min())
        else:
            threshold = float("inf")
        examples: dict[int, Example] = {}
        side_triggers = triggers[triggers.kind == kind]
        for e in _frame_examples(side_triggers, sign, band=["top"] * len(side_triggers),
                                 active=[True] * len(side_triggers), codes_split=split):
            examples.setdefault(e.code, e)
        random = samples[samples.kind == "random"]
        fired = (sign * random.activation.to_numpy()) >= threshold
        for e in _frame_examples(random, sign, band=["random"] * len(random), active=fired, codes_split=split):
            examples.setdefault(e.code, e)
        bins = samples[samples.kind == "bin"]
        bin_band = [str(b) for b in band_of_bin[bins["bin"].to_numpy()]] if len(bins) else []
        for e in _frame_examples(bins, sign, band=bin_band, active=[b != "below" for b in bin_band], codes_split=split):
            examples.setdefault(e.code, e)
        writes, opposes = (promoted, suppressed) if sign > 0 else (suppressed, promoted)
        out.append(SideEvidence(layer=layer, neuron=neuron, side=side, examples=tuple(examples.values()),
                                writes=writes, opposes=opposes, threshold=threshold, convention=convention))
    return out
