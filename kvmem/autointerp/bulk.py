"""The evidence of many neurons of one layer at once: each atlas table read once per layer.

Atlases of format 3 (a ``contexts`` table) are read by :func:`kvmem.autointerp.layertable.read_layer`.
For format 2 (texts in every trigger row, ``sample_contexts`` for the samples):
:func:`kvmem.autointerp.evidence.load_evidence` asks the atlas's per-neuron queries, which read a
whole row group (``ROW_GROUP_NEURONS`` neurons) to return one neuron; over a layer that reads every
group that many times. Here the layer's rows of ``triggers``, ``samples`` (joined once to
``sample_contexts``), ``histograms`` and ``values`` are read in one filtered pass each, as the atlas
format documents them (:mod:`kvmem.schema`), and cut per neuron; each neuron's sides are then built
by the same :func:`~kvmem.autointerp.evidence.sides_from_rows`. A test checks that both paths
give equal evidence. If the files do not hold the columns this reads (another atlas format), it
falls back to the per-neuron queries.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from kvmem.autointerp.evidence import ROW_COLUMNS, load_evidence, neuron_sides, sides_from_rows
from kvmem.autointerp.layertable import read_contexts, read_layer
from kvmem.autointerp.splits import split_window

__all__ = ["layer_evidence"]

_NEEDS = {
    "triggers": ["neuron", "kind", "rank", "activation", "doc", "pos", "context_tokens", "context_trigger",
                 "context_activations"],
    "samples": ["neuron", "kind", "bin", "rank", "activation", "doc", "pos", "context_activations"],
    "sample_contexts": ["doc", "pos", "context_tokens", "context_trigger"],
    "histograms": ["neuron", "counts"],
    "values": ["neuron", "convention", "kind", "rank", "token_id", "token"],
}


def _readable(atlas) -> bool:
    for table, columns in _NEEDS.items():
        path = atlas.path / f"{table}.parquet"
        if table == "values" and not path.exists():  # the model's cached tables (Atlas.table_path)
            continue
        if not path.exists() or not set(columns) <= set(pq.ParquetFile(path).schema_arrow.names):
            return False
    return True


def _layer_rows(atlas, table: str, layer: int, wanted: set[int]):
    frame = pq.read_table(atlas.table_path(table), columns=_NEEDS[table],
                          filters=[("layer", "=", layer)]).to_pandas()
    frame = frame[frame.neuron.isin(wanted)]
    return frame.sort_values("neuron", kind="stable").reset_index(drop=True)


def _cuts(frame) -> dict[int, slice]:
    neurons = frame.neuron.to_numpy()
    if not len(neurons):
        return {}
    starts = np.flatnonzero(np.r_[True, neurons[1:] != neurons[:-1]])
    stops = np.r_[starts[1:], len(neurons)]
    return {int(neurons[a]): slice(int(a), int(b)) for a, b in zip(starts, stops)}


def layer_evidence(atlas, layer: int, neurons, *, sides=None, seed: int, held_out: float,
                   convention: str | None = None, contexts=None) -> dict[int, list]:
    """neuron -> its sides' :class:`~kvmem.autointerp.evidence.SideEvidence`, for ``neurons`` of ``layer``.
    ``contexts``: :func:`~kvmem.autointerp.layertable.read_contexts` of the atlas, if the caller has it."""
    neurons = sorted({int(n) for n in neurons})
    for n in neurons:
        atlas.check(layer, n)
    convention = convention or atlas.default_convention
    chosen = neuron_sides(atlas, sides)
    contexts = contexts or read_contexts(atlas)
    if contexts is not None:
        table = read_layer(atlas, layer, neurons, sides=chosen, seed=seed, held_out=held_out, convention=convention,
                           contexts=contexts)
        found = table.sides()
        return {n: found[i * len(chosen):(i + 1) * len(chosen)] for i, n in enumerate(neurons)}
    if not _readable(atlas):
        return {n: load_evidence(atlas, layer, n, sides=chosen, seed=seed, held_out=held_out, convention=convention)
                for n in neurons}
    wanted = set(neurons)
    triggers = _layer_rows(atlas, "triggers", layer, wanted)
    samples = _layer_rows(atlas, "samples", layer, wanted)
    contexts = pq.read_table(atlas.path / "sample_contexts.parquet", columns=_NEEDS["sample_contexts"]).to_pandas()
    samples = samples.merge(contexts, on=["doc", "pos"], how="left")
    samples = samples.sort_values("neuron", kind="stable").reset_index(drop=True)
    histograms = _layer_rows(atlas, "histograms", layer, wanted)
    values = _layer_rows(atlas, "values", layer, wanted)
    values = values[values.convention == convention].sort_values(["neuron", "kind", "rank"], kind="stable")
    values = values.reset_index(drop=True)
    edges = np.asarray([float(e) for e in atlas.manifest.histogram["edges"]])
    low, high = edges[:-1], edges[1:]
    cut_t, cut_s, cut_h, cut_v = _cuts(triggers), _cuts(samples), _cuts(histograms), _cuts(values)
    trigger_rows, sample_rows = _lists(triggers), _lists(samples)
    tokens, kinds = list(zip(values.token_id.astype(int).tolist(), values.token.tolist())), values.kind.tolist()
    empty = slice(0, 0)
    out = {}
    for n in neurons:
        v = cut_v.get(n, empty)
        counts = histograms.counts.iloc[cut_h[n]].iloc[0] if n in cut_h else np.zeros(len(low), np.int64)
        out[n] = sides_from_rows(
            layer, n, triggers={c: col[cut_t.get(n, empty)] for c, col in trigger_rows.items()},
            samples={c: col[cut_s.get(n, empty)] for c, col in sample_rows.items()}, counts=np.asarray(counts),
            low=low, high=high, promoted=tuple(t for t, k in zip(tokens[v], kinds[v]) if k == "promote"),
            suppressed=tuple(t for t, k in zip(tokens[v], kinds[v]) if k == "suppress"),
            sides=chosen, seed=seed, held_out=held_out, window=split_window(atlas), convention=convention)
    return out


def _lists(frame) -> dict[str, list]:
    """The columns :func:`sides_from_rows` reads, as Python lists (nested lists for the context columns)."""
    out = {}
    for column in ROW_COLUMNS:
        if column not in frame.columns:
            out[column] = [-1 if column == "bin" else None] * len(frame)
        elif column in ("context_tokens", "context_activations"):
            out[column] = [None if v is None else (v.tolist() if hasattr(v, "tolist") else list(v))
                           for v in frame[column].tolist()]
        else:
            out[column] = frame[column].tolist()
    return out
