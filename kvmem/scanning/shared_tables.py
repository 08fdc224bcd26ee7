"""The atlas's tables that no single statistic owns, built from a finished scan state (see
:mod:`kvmem.schema` for their columns): the neurons table (every statistic's columns beside the
weights' norms, in the schema's order) and the contexts table (the text of every kept position).
The statistics' own tables are theirs (:mod:`kvmem.scanning.statistics`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvmem.models import Model
from kvmem.plan import TokenPlan, unpack
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.statistics import ScanState
from kvmem.scanning.texts import context_columns
from kvmem.schema import COLUMNS

__all__ = ["neurons_table", "contexts_table"]

_NULL_INT = np.iinfo(np.int64).min  # marks a null int64 entry until the Arrow table is built


def neurons_table(model: Model, state: ScanState) -> pa.Table:
    """One row per (layer, neuron): the columns of every statistic the scan kept, the weights' norms; a column
    no statistic gave is null (NaN for floats)."""
    columns: dict[str, list[np.ndarray]] = {}
    for layer in state.layers:
        gate = model.gate_keys(layer)
        part = {
            "layer": np.full(model.d_ff, layer, np.int16),
            "neuron": np.arange(model.d_ff, dtype=np.int32),
            **state.layer_states[layer].neuron_columns(model.d_ff),
            "key_norm": model.keys(layer).float().norm(dim=1).cpu().numpy(),
            "gate_norm": (gate.float().norm(dim=1).cpu().numpy() if gate is not None
                          else np.full(model.d_ff, np.nan, np.float32)),
            "value_norm": model.written_values(layer).norm(dim=1).cpu().numpy(),  # what reaches the residual
        }
        for name, description in COLUMNS["neurons"].items():
            if name not in part:
                part[name] = (np.full(model.d_ff, _NULL_INT, np.int64) if description.startswith("int")
                              else np.full(model.d_ff, np.nan))
        for name in COLUMNS["neurons"]:
            columns.setdefault(name, []).append(part[name])
    return pa.table({name: _nullable(np.concatenate(parts)) for name, parts in columns.items()})


def _nullable(values: np.ndarray) -> pa.Array | np.ndarray:
    """int64 columns holding the null marker become Arrow arrays with nulls (float columns keep NaN)."""
    if values.dtype == np.int64 and (values == _NULL_INT).any():
        return pa.array(values, mask=values == _NULL_INT)
    return values


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
