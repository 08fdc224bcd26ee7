"""A layer's evidence as arrays: every chosen neuron side's examples at once, each atlas table read once.

:class:`LayerExamples` holds what :func:`kvmem.autointerp.evidence.sides_from_rows` builds one
:class:`~kvmem.autointerp.evidence.Example` at a time, for all chosen sides of one layer: the same
examples in the same order (a side's triggers, then the layer's random samples, then its bin
samples; a position kept twice is one example, the first), the same bands, activations, firing
flags and split. Contexts are not copied per example: an example points at a row of
:class:`Contexts`, the atlas's ``contexts`` table read once per run, whose tokens are integer ids
(of the raw token and of its :func:`~kvmem.autointerp.token_rules.normalize` form) padded to a width W.
:mod:`kvmem.autointerp.vectorised` explains and :mod:`kvmem.autointerp.array_scores` scores from these arrays;
:meth:`LayerExamples.sides` turns them back into ``SideEvidence`` for the LLM explainers and judges.

Atlas format 3 (``contexts.parquet``, :mod:`kvmem.schema`) is read directly;
:func:`read_layer` returns None for other formats (the caller then uses the per-neuron queries).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvmem.autointerp.evidence import ACTIVE_LEVELS, BANDS, Example, SideEvidence, split_written
from kvmem.autointerp.splits import held_out_mask, split_window
from kvmem.autointerp.token_rules import normalize
from kvmem.errors import KvmemError
from kvmem.experiments.signed_memories import SIDES

__all__ = ["Contexts", "LayerExamples", "read_contexts", "read_layer", "BAND_CODE"]

BAND_CODE = {band: i for i, band in enumerate(BANDS)}  # top 0, q0.999 1, q0.99 2, q0.9 3, below 4, random 5
_LEVEL_BAND = np.array([BAND_CODE["below"], BAND_CODE["q0.9"], BAND_CODE["q0.99"], BAND_CODE["q0.999"]], np.int8)
_NEEDS = {
    "triggers": ["layer", "neuron", "kind", "activation", "doc", "pos", "context_activations"],
    "samples": ["layer", "neuron", "kind", "bin", "activation", "doc", "pos", "context_activations"],
    "contexts": ["doc", "pos", "context_tokens", "context_trigger"],
    "histograms": ["layer", "neuron", "counts"],
    "values": ["layer", "neuron", "convention", "kind", "rank", "token_id", "token"],
}


_VALUE_TYPES = {"layer": pa.int64(), "neuron": pa.int64(), "convention": pa.string(), "kind": pa.string(),
                "rank": pa.int64(), "token_id": pa.int64(), "token": pa.string()}


def _codes(table) -> np.ndarray:
    doc = np.asarray(table.column("doc").to_numpy(), np.int64)
    return (doc << 32) | np.asarray(table.column("pos").to_numpy(), np.int64)


def _padded(column, width: int | None = None, fill=np.nan, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """A list column of an Arrow table as ([rows, W] values padded with ``fill``, [rows] lengths)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = np.asarray(column.offsets.to_numpy(), np.int64)
    lengths = np.diff(offsets)
    width = int(lengths.max(initial=0)) if width is None else width
    flat = column.flatten().to_numpy(zero_copy_only=False)
    out = np.full((len(lengths), width), fill, dtype)
    out[np.arange(width)[None, :] < lengths[:, None]] = flat  # row-major: the flat values in order
    return out, lengths


@dataclass(frozen=True, eq=False)
class Contexts:
    """The atlas's contexts, sorted by position code.

    codes [C];  raw, norm [C, W] int64 ids of each token and of its normalised form (-1 past the end);
    length [C];  trigger [C] the kept token's index;  tokens: [C] tuples of the token strings;
    vocab: normalised string of each norm id (ids follow sorted order of the strings)."""

    codes: np.ndarray
    raw: np.ndarray
    norm: np.ndarray
    length: np.ndarray
    trigger: np.ndarray
    tokens: list
    vocab: list

    @property
    def width(self) -> int:
        return self.raw.shape[1]

    def rows(self, codes) -> np.ndarray:
        """[n] the context row of each position code (every code must be there)."""
        at = np.searchsorted(self.codes, codes)
        at = np.minimum(at, max(len(self.codes) - 1, 0))
        if len(codes) and (not len(self.codes) or (self.codes[at] != codes).any()):
            raise KvmemError("some triggers or samples point at positions missing from the contexts table; "
                             "the atlas is damaged, scan again")
        return at


def _readable(atlas) -> bool:
    for table, columns in _NEEDS.items():
        if table == "values" and not atlas.holds(table):  # computed on demand (_layer_table)
            continue
        if not atlas.holds(table) or not set(columns) <= set(pq.ParquetFile(atlas.table_path(table)).schema_arrow.names):
            return False
    return not set(_NEEDS["contexts"][2:]) & set(pq.ParquetFile(atlas.table_path("triggers")).schema_arrow.names)


def read_contexts(atlas) -> Contexts | None:
    """The atlas's contexts table as :class:`Contexts`; None when the atlas is not of format 3."""
    if not _readable(atlas):
        return None
    table = pq.read_table(atlas.table_path("contexts"), columns=_NEEDS["contexts"])
    codes = _codes(table)
    order = np.argsort(codes, kind="stable")
    table = table.take(pa.array(order))
    column = table.column("context_tokens").combine_chunks()
    encoded = pc.dictionary_encode(column.flatten())
    strings = encoded.dictionary.to_pylist()  # distinct raw tokens
    normalised = [normalize(s) for s in strings]
    vocab, raw_to_norm = np.unique(np.asarray(normalised, dtype=object), return_inverse=True)
    ids = pa.LargeListArray.from_arrays(column.offsets, encoded.indices.cast(pa.int64()))
    raw, length = _padded(ids, fill=-1, dtype=np.int64)
    norm = np.where(raw >= 0, np.asarray(raw_to_norm, np.int64)[np.maximum(raw, 0)], -1)
    tokens = [tuple(t) for t in column.to_pylist()]
    return Contexts(codes=codes[order], raw=raw, norm=norm, length=length,
                    trigger=np.asarray(table.column("context_trigger").to_numpy(), np.int64), tokens=tokens,
                    vocab=[str(v) for v in vocab])


@dataclass(frozen=True, eq=False)
class LayerExamples:
    """The examples of S neuron sides of one layer (E examples, grouped by side, in each side's order).

    Sides [S]: ``neuron``, ``side`` (names), ``sign`` (+1 / -1), ``threshold``, ``writes`` / ``opposes``
    (explain-set token tuples), ``held_writes`` / ``held_opposes`` (held-out :class:`WrittenToken` tuples). Examples [E]: ``owner`` (the side), ``code``, ``band`` (index into
    :data:`~kvmem.autointerp.evidence.BANDS`), ``ctx`` (row of ``contexts``), ``index`` (the kept token),
    ``activation`` (side activation), ``src`` (its row of ``source_acts`` [rows, W], the stored context
    coefficients m_i of the layer's trigger and sample rows, float32 as stored, NaN past the end; read
    them through :meth:`side_acts`), ``has_acts`` (context coefficients stored), ``active``, ``held``.
    ``start`` [S + 1]: each side's examples are ``start[s]:start[s + 1]``."""

    layer: int
    neuron: np.ndarray
    side: list
    sign: np.ndarray
    threshold: np.ndarray
    writes: list
    opposes: list
    held_writes: list
    held_opposes: list
    owner: np.ndarray
    code: np.ndarray
    band: np.ndarray
    ctx: np.ndarray
    index: np.ndarray
    activation: np.ndarray
    src: np.ndarray
    source_acts: np.ndarray
    has_acts: np.ndarray
    active: np.ndarray
    held: np.ndarray
    start: np.ndarray
    contexts: Contexts
    convention: str

    def side_acts(self, rows, positions=None) -> np.ndarray:
        """Side activations (float64) of example ``rows`` at every context token [n, W], or at ``positions`` [n]."""
        sign = self.sign[self.owner[rows]]
        if positions is None:
            return sign[:, None] * self.source_acts[self.src[rows]].astype(np.float64)
        return sign * self.source_acts[self.src[rows], positions].astype(np.float64)

    def sides(self) -> list[SideEvidence]:
        """The same evidence as :class:`SideEvidence` objects, in side order (what LLM explainers read)."""
        out = []
        tokens, length = self.contexts.tokens, self.contexts.length
        for s in range(len(self.side)):
            examples = []
            for e in range(self.start[s], self.start[s + 1]):
                c = self.ctx[e]
                acts = tuple(self.side_acts([e])[0, :length[c]].tolist()) if self.has_acts[e] else None
                examples.append(Example(int(self.code[e]), BANDS[self.band[e]], tokens[c], int(self.index[e]),
                                        float(self.activation[e]), acts, bool(self.active[e]), bool(self.held[e])))
            out.append(SideEvidence(layer=self.layer, neuron=int(self.neuron[s]), side=self.side[s],
                                    examples=tuple(examples), writes=self.writes[s], opposes=self.opposes[s],
                                    threshold=float(self.threshold[s]), convention=self.convention,
                                    held_writes=self.held_writes[s], held_opposes=self.held_opposes[s]))
        return out


def _layer_table(atlas, table: str, layer: int, wanted: np.ndarray, convention: str | None = None) -> pa.Table:
    if table == "values" and not atlas.holds("values"):  # computed on demand, in neuron order
        return atlas.projection_rows(table, layer, wanted.tolist(), labels=[convention]).select(_NEEDS[table])
    rows = pq.read_table(atlas.table_path(table), columns=_NEEDS[table], filters=[("layer", "=", layer)])
    neuron = np.asarray(rows.column("neuron").to_numpy(), np.int64)
    keep = np.flatnonzero(np.isin(neuron, wanted))
    keep = keep[np.argsort(neuron[keep], kind="stable")]
    if len(keep) == rows.num_rows and (keep == np.arange(len(keep))).all():
        return rows  # already the wanted rows in neuron order
    return rows.take(pa.array(keep))


def _histogram_levels(counts: np.ndarray, low: np.ndarray, high: np.ndarray, sign: int):
    """([N, bins] band code of each bin, [N] threshold) of one side, as :func:`sides_from_rows` computes them."""
    cumulative = np.cumsum(counts, axis=1) / np.maximum(counts.sum(axis=1), 1.0)[:, None]
    beyond = np.concatenate([np.zeros((len(counts), 1)), cumulative[:, :-1]], axis=1) if sign > 0 else 1.0 - cumulative
    level = np.searchsorted(np.asarray(ACTIVE_LEVELS), beyond.ravel(), side="right").reshape(beyond.shape)
    edges = np.asarray(low, np.float64) if sign > 0 else -np.asarray(high, np.float64)
    firing = (level > 0) & (counts > 0)
    threshold = np.where(firing, edges[None, :], np.inf).min(axis=1, initial=np.inf)
    return _LEVEL_BAND[level], threshold


def read_layer(atlas, layer: int, neurons, *, sides, seed: int, held_out: float, convention: str,
               contexts: Contexts, written: bool = True) -> LayerExamples:
    """The evidence of ``sides`` (names, in order) of ``neurons`` (sorted, distinct) of ``layer``;
    ``written=False``: without what the values write (no projection is read or computed; writes empty)."""
    neurons = np.asarray(sorted({int(n) for n in neurons}), np.int64)
    trig = _layer_table(atlas, "triggers", layer, neurons)
    samp = _layer_table(atlas, "samples", layer, neurons)
    hist = _layer_table(atlas, "histograms", layer, neurons)
    vals = _layer_table(atlas, "values", layer, neurons, convention) if written else \
        pa.table({name: pa.array([], type) for name, type in _VALUE_TYPES.items()})
    edges = np.asarray([float(e) for e in atlas.manifest.histogram["edges"]])
    low, high = edges[:-1], edges[1:]
    counts = np.zeros((len(neurons), len(low)), np.float64)
    if hist.num_rows:
        column = hist.column("counts").combine_chunks()
        if isinstance(column, pa.FixedSizeListArray):
            hist_counts = np.asarray(column.flatten().to_numpy(), np.float64).reshape(len(column), -1)
        else:
            hist_counts, _ = _padded(column, width=len(low), fill=0, dtype=np.float64)
        counts[np.searchsorted(neurons, np.asarray(hist.column("neuron").to_numpy(), np.int64))] = hist_counts
    # the value's tokens, strongest first
    vconv = np.asarray(vals.column("convention").to_numpy(zero_copy_only=False), dtype=object)
    vrows = np.flatnonzero(vconv == convention)
    vneuron = np.asarray(vals.column("neuron").to_numpy(), np.int64)[vrows]
    vkind = np.asarray(vals.column("kind").to_numpy(zero_copy_only=False), dtype=object)[vrows]
    vrank = np.asarray(vals.column("rank").to_numpy(), np.int64)[vrows]
    vtoken = np.asarray(vals.column("token").to_numpy(zero_copy_only=False), dtype=object)[vrows]
    vid = np.asarray(vals.column("token_id").to_numpy(), np.int64)[vrows]
    order = np.lexsort((vrank, vkind, vneuron))
    promoted = {int(n): [] for n in neurons}
    suppressed = {int(n): [] for n in neurons}
    for n, k, i, t in zip(vneuron[order].tolist(), vkind[order].tolist(), vid[order].tolist(), vtoken[order].tolist()):
        if k in ("promote", "suppress"):
            (promoted if k == "promote" else suppressed)[n].append((i, t))
    # the source rows: the triggers, then the samples; every example points at one of them
    acts_t, len_t = _padded(trig.column("context_activations"), width=contexts.width, dtype=np.float32)
    acts_s, len_s = _padded(samp.column("context_activations"), width=contexts.width, dtype=np.float32)
    code = np.concatenate([_codes(trig), _codes(samp)])
    ctx = contexts.rows(code)
    acts_len = np.concatenate([len_t, len_s])
    source = dict(
        neuron=np.searchsorted(neurons, np.concatenate([np.asarray(x.column("neuron").to_numpy(), np.int64)
                                                        for x in (trig, samp)])),
        activation=np.concatenate([np.asarray(x.column("activation").to_numpy(), np.float64) for x in (trig, samp)]),
        code=code, ctx=ctx, has_acts=(acts_len == contexts.length[ctx]) & (acts_len > 0))
    n_trig = trig.num_rows
    trig_kind = np.asarray(trig.column("kind").to_numpy(zero_copy_only=False), dtype=object)
    samp_kind = np.asarray(samp.column("kind").to_numpy(zero_copy_only=False), dtype=object)
    samp_bin = np.asarray(samp.column("bin").to_numpy(), np.int64)
    with_context = contexts.length[ctx[n_trig:]] > 0
    unique_codes, inverse = np.unique(code, return_inverse=True)
    source["held"] = held_out_mask(unique_codes, seed=seed, held_out=held_out, window=split_window(atlas))[inverse]
    random_rows = n_trig + np.flatnonzero(with_context & (samp_kind == "random"))
    bin_rows = np.flatnonzero(with_context & (samp_kind == "bin"))
    parts, thresholds = [], []
    for k, side in enumerate(sides):
        kind, _, sign = SIDES[side]
        band_of_bin, threshold = _histogram_levels(counts, low, high, sign)
        thresholds.append(threshold)
        # a side's candidates in order (its triggers, the random samples, the bin samples; file order in each)
        cand = np.concatenate([np.flatnonzero(trig_kind == kind), random_rows, n_trig + bin_rows])
        n_pos = source["neuron"][cand]
        n_t, n_r = len(cand) - len(random_rows) - len(bin_rows), len(random_rows)
        band = np.concatenate([np.full(n_t, BAND_CODE["top"], np.int8), np.full(n_r, BAND_CODE["random"], np.int8),
                               band_of_bin[n_pos[n_t + n_r:], samp_bin[bin_rows]]])
        active = np.concatenate([np.ones(n_t, bool),
                                 sign * source["activation"][random_rows] >= threshold[n_pos[n_t:n_t + n_r]],
                                 band[n_t + n_r:] != BAND_CODE["below"]])
        # the first candidate of each (neuron, code), in the side's order
        order = np.argsort(n_pos, kind="stable")
        cand_code = code[cand]
        by_code = order[np.lexsort((np.arange(len(order)), cand_code[order], n_pos[order]))]
        first = np.ones(len(by_code), bool)
        first[1:] = (n_pos[by_code][1:] != n_pos[by_code][:-1]) | (cand_code[by_code][1:] != cand_code[by_code][:-1])
        rank_of = np.empty(len(order), np.int64)
        rank_of[order] = np.arange(len(order))
        chosen = order[np.sort(rank_of[by_code[first]])]
        parts.append(dict(owner=n_pos[chosen] * len(sides) + k, src=cand[chosen], band=band[chosen],
                          active=active[chosen]))
    merged = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    order = np.argsort(merged["owner"], kind="stable")
    merged = {name: value[order] for name, value in merged.items()}
    n_sides = len(neurons) * len(sides)
    side_sign = np.tile([SIDES[side][2] for side in sides], len(neurons)).astype(np.int64)
    src = merged["src"]
    writes, opposes, held_writes, held_opposes = [], [], [], []
    for n in neurons.tolist():
        up = split_written(promoted[n], seed=seed, held_out=held_out)
        down = split_written(suppressed[n], seed=seed, held_out=held_out)
        for side in sides:
            first, second = (up, down) if SIDES[side][2] > 0 else (down, up)
            writes.append(first[0])
            opposes.append(second[0])
            held_writes.append(first[1])
            held_opposes.append(second[1])
    example_ctx = source["ctx"][src]
    return LayerExamples(
        layer=int(layer), neuron=np.repeat(neurons, len(sides)), side=list(sides) * len(neurons), sign=side_sign,
        threshold=np.stack(thresholds, axis=1).ravel(), writes=writes, opposes=opposes, held_writes=held_writes,
        held_opposes=held_opposes,
        owner=merged["owner"], code=source["code"][src], band=merged["band"], ctx=example_ctx,
        index=contexts.trigger[example_ctx], activation=side_sign[merged["owner"]] * source["activation"][src],
        src=src, source_acts=np.concatenate([acts_t, acts_s]), has_acts=source["has_acts"][src],
        active=merged["active"], held=source["held"][src],
        start=np.searchsorted(merged["owner"], np.arange(n_sides + 1)), contexts=contexts, convention=convention)
