"""The atlas's tables, built from a finished scan state (see :mod:`kvmem.schema` for their columns).

Each builder returns an Arrow table, or, for the two large tables, one layer's rows
(:func:`trigger_part`, :func:`sample_part`), so the writer can start on a layer while the next is built.
Rows come in table order (layer, neuron, ...), placed by counting rather than sorted.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvmem.models import Model
from kvmem.plan import TokenPlan, unpack
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.histogram import HIST_BINS
from kvmem.scanning.state import QUADRANTS, LayerState, ScanState
from kvmem.scanning.texts import context_columns
from kvmem.schema import TRIGGER_KINDS

__all__ = ["neurons_table", "histograms_table", "unigrams_table", "contexts_table", "trigger_part", "sample_part",
           "has_samples"]


def neurons_table(model: Model, layers: list[int], states: dict[int, LayerState]) -> pa.Table:
    columns: dict[str, list[np.ndarray]] = {}
    for layer in layers:
        s = states[layer]
        n = s.count
        total, total_sq = (t.cpu().numpy() for t in s.sums())
        with np.errstate(invalid="ignore", divide="ignore"):  # an empty shard: NaN statistics, count 0
            mean = total / n
            variance = np.maximum(total_sq / n - mean * mean, 0.0)
            frac_positive = s.positive.cpu().numpy() / n
        top, bottom = s.top.values, s.bottom.values
        gate = model.gate_keys(layer)
        part = {
            "layer": np.full(model.d_ff, layer, np.int16),
            "neuron": np.arange(model.d_ff, dtype=np.int32),
            "count": np.full(model.d_ff, n, np.int64),
            "mean": mean,
            "std": np.sqrt(variance),
            "min": bottom[0].cpu().numpy().astype(np.float32),
            "max": top[0].cpu().numpy().astype(np.float32),
            "frac_positive": frac_positive,
            "act_sum": total,
            "act_sq_sum": total_sq,
            "key_norm": model.keys(layer).float().norm(dim=1).cpu().numpy(),
            "gate_norm": (gate.float().norm(dim=1).cpu().numpy() if gate is not None
                          else np.full(model.d_ff, np.nan, np.float32)),
            "value_norm": model.written_values(layer).norm(dim=1).cpu().numpy(),  # what reaches the residual
        }
        part.update(_taxonomy_columns(s, model.d_ff))
        for name, values in part.items():
            columns.setdefault(name, []).append(values)
    return pa.table({name: _nullable(np.concatenate(parts)) for name, parts in columns.items()})


_NULL_INT = np.iinfo(np.int64).min  # marks a null int64 entry until the Arrow table is built


def _nullable(values: np.ndarray) -> pa.Array | np.ndarray:
    """int64 columns holding the null marker become Arrow arrays with nulls (float columns keep NaN)."""
    if values.dtype == np.int64 and (values == _NULL_INT).any():
        return pa.array(values, mask=values == _NULL_INT)
    return values


def _taxonomy_columns(s: LayerState, d_ff: int) -> dict[str, np.ndarray]:
    """The neurons table's taxonomy sums of one layer (null markers where the scan kept none)."""
    kept = s.position_product is not None
    none = np.full(d_ff, _NULL_INT, np.int64)
    out = {
        "position_act_sum": ((s.position_product[0] + s.position_product[1]).cpu().numpy() if kept
                             else np.full(d_ff, np.nan)),
        "position_sum": np.full(d_ff, s.position_total, np.int64) if kept else none,
        "position_sq_sum": np.full(d_ff, s.position_sq_total, np.int64) if kept else none,
    }
    quadrants = s.quadrants.cpu().numpy() if s.quadrants is not None else None
    for row, name in enumerate(QUADRANTS):
        out[f"quadrant_{name}"] = quadrants[row].astype(np.int64) if quadrants is not None else none
    return out


def unigrams_table(state: ScanState) -> pa.Table:
    """One row per vocabulary id with its count over the scored positions (no rows without the taxonomy sums)."""
    counts = state.unigrams.cpu().numpy() if state.unigrams is not None else np.empty(0, np.int64)
    return pa.table({"token_id": np.arange(len(counts), dtype=np.int32), "count": counts.astype(np.int64)})


def histograms_table(layers: list[int], states: dict[int, LayerState]) -> pa.Table:
    d_ff = states[layers[0]].histogram.shape[0]
    counts = np.concatenate([states[layer].histogram.cpu().numpy().reshape(-1) for layer in layers])
    return pa.table({
        "layer": np.repeat(np.asarray(layers, np.int16), d_ff),
        "neuron": np.tile(np.arange(d_ff, dtype=np.int32), len(layers)),
        "counts": pa.FixedSizeListArray.from_arrays(pa.array(counts, pa.int64()), HIST_BINS),
    })


def _trigger_layer(layer: int, state: LayerState) -> dict[str, np.ndarray]:
    """One layer's kept triggers, sorted by (neuron, kind, rank); empty entries dropped. ``context``
    [rows, C] float32 (NaN outside the window)."""
    sides = state.sides()
    k, d_ff = sides["top"].values.shape
    shape = (d_ff, len(sides), k)  # [F, kinds, k]: the table's row order
    values = np.stack([side.values.cpu().numpy().T for side in sides.values()], axis=1)
    codes = np.stack([side.codes.cpu().numpy().T for side in sides.values()], axis=1)
    keep = (codes >= 0).reshape(-1)
    every = bool(keep.all())  # a scan of more than k positions keeps every entry: no masking copies
    context = np.empty((*shape, sides["top"].width), np.float32)
    for j, side in enumerate(sides.values()):
        context[:, j] = side.neuron_context().cpu().numpy()
    context = context.reshape(len(keep), context.shape[-1])
    if not every:
        context = context[keep]

    def flat(array: np.ndarray) -> np.ndarray:
        array = np.broadcast_to(array, shape).reshape(-1)
        return array if every else array[keep]

    kinds = np.array([TRIGGER_KINDS.index(name) for name in sides], np.int64)
    width = context.shape[1] - state.extras  # gate, up after the context coefficients (or none)
    nan = np.full(len(context), np.nan, np.float32)
    return {"layer": np.full(len(context), layer, np.int16), "neuron": flat(np.arange(d_ff, dtype=np.int32)[:, None, None]),
            "kind": flat(kinds[None, :, None]), "rank": flat(np.arange(k, dtype=np.int16)[None, None, :]),
            "activation": flat(values), "code": flat(codes), "context": context[:, :width],
            "gate_pre": context[:, width] if state.extras else nan,
            "up_pre": context[:, width + 1] if state.extras else nan}


def contexts_table(model: Model, config: ScanConfig, plan: TokenPlan, state, codes: np.ndarray) -> pa.Table:
    """One row per distinct position in ``codes`` (sorted packed (doc, pos)): its text, cut from the
    window the model read (no second pass)."""
    doc, pos = unpack(codes)
    text = context_columns(state.texts, doc, pos, window=plan.window, before=config.context_before,
                           after=config.context_after, token_str=model.token_str, lead=plan.skip_first)
    following = text.next_token_id >= 0
    strings = model.token_texts(np.concatenate([text.token_id, text.next_token_id[following]]).tolist())
    next_token = np.full(len(codes), "", object)
    next_token[following] = strings[len(text.token_id):]
    piece_offsets = np.zeros(len(codes) + 1, np.int64)
    np.cumsum(text.piece_counts, out=piece_offsets[1:])
    return pa.table({
        "doc": np.asarray(doc, np.int64), "pos": np.asarray(pos, np.int32),
        "doc_id": pa.array(text.doc_id, pa.string()),
        "token_id": text.token_id,
        "token": pa.array(strings[:len(text.token_id)], pa.string()),
        "next_token_id": text.next_token_id,
        "next_token": pa.array(next_token, pa.string()),
        "context": pa.array(text.context, pa.string()),
        "span_start": text.span_start,
        "span_end": text.span_end,
        "context_tokens": pa.LargeListArray.from_arrays(pa.array(piece_offsets), pa.array(text.pieces, pa.string())),
        "context_trigger": text.trigger_index,
    })


def _list_column(matrix: np.ndarray, *, at: np.ndarray | None = None, rows: int | None = None) -> pa.Array:
    """[R, width] float32 with NaN outside the window -> list<float32> of the valid entries per row.
    ``at`` (ascending [R]) and ``rows``: the matrix holds rows ``at`` of a column of ``rows`` rows, the
    others are empty lists."""
    valid = ~np.isnan(matrix)
    counts = np.count_nonzero(valid, axis=1)
    if at is not None:
        placed = np.zeros(rows, np.int64)
        placed[at] = counts
        counts = placed
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = matrix.reshape(-1) if offsets[-1] == matrix.size else matrix[valid]
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float32()))


def _doc_pos(part: dict) -> dict[str, np.ndarray]:
    """The doc and pos columns from a part's packed codes (:func:`kvmem.plan.unpack`)."""
    doc, pos = unpack(part["code"])
    return {"doc": pa.array(doc, pa.int64()), "pos": pa.array(pos.astype(np.int32), pa.int32())}


def trigger_part(layer: int, state: LayerState) -> pa.Table:
    """The triggers table's rows of one layer: one row per kept trigger, sorted by (neuron, kind, rank);
    its text is the row (doc, pos) of the contexts table. The table is these parts in layer order."""
    part = _trigger_layer(layer, state)
    return pa.table({
        "layer": part["layer"], "neuron": part["neuron"],
        "kind": pc.take(pa.array(TRIGGER_KINDS, pa.string()), pa.array(part["kind"])),
        "rank": part["rank"], "activation": pa.array(part["activation"], pa.float32()),
        **_doc_pos(part),
        "context_activations": _list_column(part["context"]),
        "gate_pre": pa.array(part["gate_pre"], pa.float32()), "up_pre": pa.array(part["up_pre"], pa.float32()),
    })


def _sample_layer(layer: int, s: LayerState) -> dict[str, np.ndarray] | None:
    """One layer's samples in table order: neuron, then the random sample (rank order), then the bin
    samples (bin, rank); empty entries dropped. Rows are placed by counting, without a sort."""
    if s.random is None and s.bins is None:
        return None
    d_ff = (s.random.values.shape[1] if s.random is not None else s.bins.codes.shape[0])
    if s.random is not None:
        random_codes = s.random.codes.cpu().numpy()
        ranks = np.flatnonzero(random_codes >= 0)  # the kept entries of the shared random positions
        context = s.random.context.cpu().numpy()  # [S, F, C (+ gate, up)]
        width = context.shape[2] - s.extras
    else:
        random_codes, ranks, width = np.empty(0, np.int64), np.empty(0, np.int64), 0
    r = len(ranks)
    if s.bins is not None:
        bin_codes = s.bins.codes.cpu().numpy()  # [F, B, Q]
        kept = bin_codes >= 0
        flat = np.flatnonzero(kept)  # the kept entries in (neuron, bin, rank) order, as flat indices
        bins, q = bin_codes.shape[1:]
        b_neuron, cell = np.divmod(flat, bins * q)
        b_bin, b_rank = np.divmod(cell, q)
        per_neuron = np.count_nonzero(kept.reshape(d_ff, -1), axis=1)
    else:
        flat = b_neuron = b_bin = b_rank = np.empty(0, np.int64)
        per_neuron = np.zeros(d_ff, np.int64)
    rows = r + per_neuron  # [F] rows of each neuron: its random rows, then its bin rows
    start = np.zeros(d_ff + 1, np.int64)
    np.cumsum(rows, out=start[1:])
    total = int(start[-1])
    random_at = (start[:-1, None] + np.arange(r)[None, :]).reshape(-1)  # [F * r], (neuron, rank) order
    # the i-th kept bin entry follows the random rows of its neuron and of every neuron before it
    bin_at = np.arange(len(flat)) + r * (b_neuron + 1)

    out = {"layer": np.full(total, layer, np.int16), "neuron": np.repeat(np.arange(d_ff, dtype=np.int32), rows),
           "kind": np.ones(total, np.int64), "bin": np.empty(total, np.int16), "rank": np.empty(total, np.int16),
           "activation": np.empty(total, np.float32), "code": np.empty(total, np.int64),
           "context": np.empty((0, width), np.float32), "context_at": random_at}
    if r:
        out["kind"][random_at] = 0
        out["bin"][random_at] = -1
        out["rank"][random_at] = np.tile(ranks, d_ff)
        out["activation"][random_at] = s.random.values.cpu().numpy()[ranks].T.reshape(-1)
        out["code"][random_at] = np.tile(random_codes[ranks], d_ff)
        out["context"] = context[ranks, :, :width].transpose(1, 0, 2).reshape(d_ff * r, width)  # rows random_at
    if len(b_neuron):
        out["bin"][bin_at] = b_bin
        out["rank"][bin_at] = b_rank
        out["activation"][bin_at] = s.bins.values.cpu().numpy().reshape(-1)[flat]
        out["code"][bin_at] = bin_codes.reshape(-1)[flat]
    return out


def has_samples(state: ScanState) -> bool:
    """Whether the scan kept samples (else the atlas has no samples table)."""
    return any(s.random is not None or s.bins is not None for s in state.layer_states.values())


def sample_part(layer: int, s: LayerState) -> pa.Table | None:
    """The samples table's rows of one layer (None without samples): one row per sampled coefficient,
    sorted by (neuron, kind (random, then bin), bin, rank); text as for triggers."""
    part = _sample_layer(layer, s)
    if part is None:
        return None
    return pa.table({
        "layer": part["layer"], "neuron": part["neuron"],
        "kind": pc.take(pa.array(["random", "bin"], pa.string()), pa.array(part["kind"])),
        "bin": part["bin"], "rank": part["rank"], "activation": pa.array(part["activation"], pa.float32()),
        **_doc_pos(part),
        "context_activations": _list_column(part["context"], at=part["context_at"], rows=len(part["code"])),
    })
