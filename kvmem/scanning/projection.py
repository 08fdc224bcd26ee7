"""Project value and key vectors through the vocabulary, in blocks (the full score matrix never exists),
and cache the resulting tables per model: they depend on the weights alone.

For GPT-2 small the values' score matrix would be 36,864 × 50,257 floats (7.4 GB); here at
most ``block`` rows × vocab are alive at once. Vectors and bases are projected in float32
whatever dtype the model runs in, by :func:`~kvmem.scanning.projection_screen.project_rows`: the
top and bottom n exactly (scores: float64 sums of the float32 products rounded to float32; ties by
token id), screened by a float32 GEMM with a proven error bound, the candidates the bound cannot
exclude rescored exactly (the scores, the tie rule and the bound with its proof:
:mod:`kvmem.scanning.projection_rules`). Each basis is prepared once per table (its column norms), not
once per layer. A neuron's rows alone (:class:`NeuronProjector`, what ``Atlas.values`` computes on demand)
are the whole table's rows of that neuron, to the bit.

The tables are written once under ``$KVMEM_CACHE/projections/`` and linked into every later atlas,
keyed by what is projected (:func:`projection_digest`: a sample of the float32 vectors of every
(layer, convention / key vector) and of both bases), the vocabulary, the layers, conventions, top_n, the
weights fingerprint and the device type; not by the scan's dtype, so a model whose weights are the same
in bfloat16 and float32 shares one cache entry, and a change in what a value means (a convention, a norm
folded in) changes the key by itself. Beside the tables, ``projection.json`` records the method that
computed them (the atlas manifest's ``projection.method``), its mean candidates per row and its rows
rescored in full.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from torch import Tensor

from kvmem.atomic import staged_directory, waited_lock
from kvmem.conventions import value_vectors
from kvmem.models import Model
from kvmem.projection_cache import RECORD, TABLES, complete_entry, entry_dir
from kvmem.scanning.parquet import write_parquet
from kvmem.scanning.projection_screen import METHOD, Basis, Projection, ProjectionStats, prepare_basis, project_rows

__all__ = ["Projection", "ProjectionStats", "ProjectionTables", "NeuronProjector", "project_rows", "key_vectors",
           "projected_vectors", "projection_digest", "projection_tables", "cached_projection_files",
           "projection_cache_key"]

_CACHE_VERSION = 4  # 2: keyed by the projected float32 content, not the dtype; 3: exact scores, ties by token id;
# 4: the content digest samples the vectors before the conventions are applied (same tables as 3)
_DIGEST_STRIDE = 16  # rows (of vectors) / columns (of bases) read into the content digest: 1 in 16


def key_vectors(model: Model, layer: int, rows=slice(None)) -> dict[str, Tensor]:
    """{'key': W1 / W_up rows, 'gate': W_gate rows (gated only)}, each [d_ff, d_model] (``rows``: only those)."""
    vectors = {"key": model.keys(layer)[rows]}
    gate = model.gate_keys(layer)
    if gate is not None:
        vectors["gate"] = gate[rows]
    return vectors


@dataclass(frozen=True)
class Projected:
    """What one atlas projects: (layer, label, vectors [d_ff, d_model] float32) for the values table
    (label = convention, basis W_U [d_model, vocab]) and for the keys table (label = key | gate,
    basis W_E^T [d_model, vocab]); float32 whatever dtype the model runs in."""

    values: list[tuple[int, str, Tensor]]
    keys: list[tuple[int, str, Tensor]]
    unembedding: Tensor
    embedding: Tensor
    neurons: Tensor | None = None  # the neurons the vectors are of (None: every neuron, in order)


def projected_vectors(model: Model, layers: list[int], config, neurons: Tensor | None = None) -> Projected:
    """The vectors and bases of an atlas's ``values`` and ``keys`` tables, in float32 (``neurons``: only
    those rows, ascending)."""
    rows = slice(None) if neurons is None else neurons
    values = [(layer, convention, value_vectors(model, layer, convention, rows).float())
              for layer in layers for convention in config.conventions]
    keys = [(layer, vector, vectors.float()) for layer in layers
            for vector, vectors in (key_vectors(model, layer, rows).items() if config.key_projections else ())]
    return Projected(values, keys, model.unembedding().float(), model.embedding().T.float(), neurons)


def projection_digest(model: Model, layers: list[int], config) -> str:
    """sha256 of what an atlas projects, sampled: shape and float32 bytes of every 16th vector of each
    (layer, convention) value and (layer, key vector), and of every 16th row in memory order (of the
    transpose for a transposed weight) of both bases, in table order.

    The weights fingerprint in the cache key covers the weight files; this digest covers how they
    are read (dtype rounding, conventions, what a value is), changes that touch every row. Only the
    sampled vectors are built (the conventions applied to 1 in 16 rows), so a scan that finds its
    tables cached never builds the full float32 vectors."""
    digest = hashlib.sha256()
    sample = slice(None, None, _DIGEST_STRIDE)

    def add(label: str, rows: Tensor, shape: tuple) -> None:
        digest.update(f"{label}:{shape};".encode())
        digest.update(np.ascontiguousarray(rows.detach().float().cpu().numpy()).tobytes())  # numpy: one thread

    def add_basis(label: str, matrix: Tensor) -> None:
        if not matrix.is_contiguous() and matrix.T.is_contiguous():  # a transposed weight: sample its rows
            matrix, label = matrix.T, f"{label}^T"
        add(label, matrix[sample], tuple(matrix.shape))

    for layer in layers:
        for convention in config.conventions:
            add(f"values/{layer}/{convention}", value_vectors(model, layer, convention, sample), (model.d_ff, model.d_model))
    if config.key_projections:
        for layer in layers:
            for vector, rows in key_vectors(model, layer).items():
                add(f"keys/{layer}/{vector}", rows[sample], tuple(rows.shape))
    add_basis("unembedding", model.unembedding())
    add_basis("embedding", model.embedding().T)
    return digest.hexdigest()


@dataclass(frozen=True)
class ProjectionTables:
    """The ``values`` and ``keys`` tables (see kvmem.schema.COLUMNS) and how they were computed."""

    values: pa.Table
    keys: pa.Table
    stats: ProjectionStats
    seconds: float


def projection_tables(model: Model, layers: list[int], config, *, bar=None, projected: Projected | None = None,
                      bases: tuple[Basis, Basis | None] | None = None, vocab: pa.Array | None = None
                      ) -> ProjectionTables:
    """The ``values`` and ``keys`` tables (of ``projected``'s neurons; default every neuron), computed now;
    ``bases``, ``vocab``: prepared once for many calls (:func:`prepare_bases`, the vocabulary's strings)."""
    started = time.perf_counter()
    n = min(config.top_n, model.vocab_size)
    projected = projected or projected_vectors(model, layers, config)
    unembedding, embedding = bases or prepare_bases(projected)
    value_parts, key_parts, stats = [], [], ProjectionStats(METHOD)
    for layer in layers:
        for parts, basis, label_vectors in ((value_parts, unembedding, projected.values),
                                            (key_parts, embedding, projected.keys)):
            for at, label, vectors in label_vectors:
                if at == layer:
                    projection = project_rows(vectors, basis, n)
                    stats += projection.stats
                    parts.append(_rows(layer, projection, label, projected.neurons))
        if bar is not None:
            bar.update()
    vocab = vocab if vocab is not None else pa.array(model.vocab_strings, pa.string())
    return ProjectionTables(_table(value_parts, "convention", vocab), _table(key_parts, "vector", vocab), stats,
                            time.perf_counter() - started)


def prepare_bases(projected: Projected) -> tuple[Basis, Basis | None]:
    """The unembedding's and (with key projections) the embedding's prepared bases, each once (tied weights:
    the same tensor, prepared once)."""
    unembedding = prepare_basis(projected.unembedding)  # once for every layer and convention
    if not projected.keys:
        return unembedding, None
    same = _same_tensor(projected.embedding, projected.unembedding)
    return unembedding, unembedding if same else prepare_basis(projected.embedding)


class NeuronProjector:
    """A neuron's rows of the ``values`` and ``keys`` tables on demand, equal to the whole tables' rows of that
    neuron (ids, ranks, tie order, scores): each row's projection depends on that row alone. The bases and the
    vocabulary's strings are prepared once, on the first call."""

    def __init__(self, model: Model, config):
        self.model, self.config = model, config
        self._prepared: tuple | None = None

    def tables(self, layer: int, neurons, *, only: str | None = None, labels=None) -> ProjectionTables:
        """The rows of ``neurons`` (ints, any order) of ``layer``, sorted as the whole tables sort them;
        ``only``: "values" or "keys" computes that table alone (the other is then empty); ``labels``: only
        these conventions and key vectors (None: all)."""
        import torch

        if only not in (None, "values", "keys"):
            raise ValueError(f"only must be None, 'values' or 'keys', got {only!r}")
        rows = torch.tensor(sorted(set(int(n) for n in neurons)), dtype=torch.int64)
        projected = projected_vectors(self.model, [layer], self.config, rows)
        if self._prepared is None:  # both bases, whichever table this call asks for
            self._prepared = (prepare_bases(projected), pa.array(self.model.vocab_strings, pa.string()))
        bases, vocab = self._prepared
        if only is not None:
            projected = replace(projected, **{"keys" if only == "values" else "values": []})
        if labels is not None:
            projected = replace(projected, values=[v for v in projected.values if v[1] in labels],
                                keys=[k for k in projected.keys if k[1] in labels])
        return projection_tables(self.model, [layer], self.config, projected=projected, bases=bases, vocab=vocab)


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def _rows(layer: int, projection: Projection, label: str, neurons: Tensor | None) -> dict:
    ids = np.stack([projection.top_ids.numpy(), projection.bottom_ids.numpy()], axis=1)  # [F, 2, n]
    scores = np.stack([projection.top_scores.numpy(), projection.bottom_scores.numpy()], axis=1)
    neuron = np.arange(len(ids), dtype=np.int32) if neurons is None else neurons.numpy().astype(np.int32)
    return {"layer": layer, "label": label, "ids": ids, "scores": scores, "neurons": neuron}


def _table(parts: list[dict], label_name: str, vocab: pa.Array) -> pa.Table:
    """Rows sorted by (layer, neuron, label, kind, rank)."""
    from kvmem.schema import arrow_schema

    schema = arrow_schema("values" if label_name == "convention" else "keys")
    if not parts:  # e.g. key projections switched off: an empty table with the same columns
        return schema.empty_table()
    by_layer: dict[int, list[dict]] = {}
    for part in parts:
        by_layer.setdefault(part["layer"], []).append(part)
    columns: dict[str, list] = {}
    for layer, group in by_layer.items():
        ids = np.stack([g["ids"] for g in group], axis=1)  # [F, labels, 2, n]
        scores = np.stack([g["scores"] for g in group], axis=1)
        d_ff, labels, _, n = ids.shape
        shape = ids.shape
        label_index = np.broadcast_to(np.arange(labels)[None, :, None, None], shape).reshape(-1)
        kind_index = np.broadcast_to(np.arange(2)[None, None, :, None], shape).reshape(-1)
        pieces = {
            "layer": np.full(ids.size, layer, np.int16),
            "neuron": np.broadcast_to(group[0]["neurons"][:, None, None, None], shape).reshape(-1),
            label_name: pc.take(pa.array([g["label"] for g in group], pa.string()), pa.array(label_index)),
            "kind": pc.take(pa.array(["promote", "suppress"], pa.string()), pa.array(kind_index)),
            "rank": np.broadcast_to(np.arange(n, dtype=np.int16)[None, None, None, :], shape).reshape(-1),
            "token_id": ids.reshape(-1).astype(np.int32),
            "token": pc.take(vocab, pa.array(ids.reshape(-1))),
            "score": scores.reshape(-1).astype(np.float32),
        }
        for name, values in pieces.items():
            columns.setdefault(name, []).append(values)
    merged = {name: (pa.concat_arrays(parts) if isinstance(parts[0], pa.Array) else pa.array(np.concatenate(parts)))
              for name, parts in columns.items()}
    return pa.table([merged[name] for name in schema.names], schema=schema)


def projection_cache_key(model: Model, layers: list[int], config) -> str | None:
    """The per-model cache's key of ``model``'s tables for ``layers`` and ``config`` (:mod:`kvmem.projection_cache`);
    None when the weights have no reliable fingerprint (then nothing is cached)."""
    if not model.fingerprint or model.fingerprint.endswith(("unknown", "None")):
        return None
    from kvmem.schema import arrow_schema

    vocab = model.vocab_digest  # names the decoded vocabulary without decoding it
    # the tables' own schema, not the atlas format: a change elsewhere in the atlas keeps the cache
    tables = hashlib.sha256(str([arrow_schema(name) for name in ("values", "keys")]).encode()).hexdigest()
    key = {"cache": _CACHE_VERSION, "tables": tables, "fingerprint": model.fingerprint, "vocab": vocab,
           "content": projection_digest(model, layers, config), "device": str(model.device).split(":")[0], "layers": list(layers),
           "conventions": list(config.conventions), "top_n": config.top_n, "keys": config.key_projections,
           "scores": "exact"}  # as every exact method wrote it (their numbers are the same to the bit)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def cached_projection_files(model: Model, layers: list[int], config, *, bar=None) -> dict:
    """{'files': {'values': path, 'keys': path}, 'cached': bool, 'method': str}: parquet files to link
    into an atlas, read from the per-model cache or computed (and cached) now; ``method``: the
    projection method that computed them (recorded beside the cached tables). Processes that need the
    same entry at once compute it once: the others wait on its lock, then read it."""
    key = projection_cache_key(model, layers, config)
    if key is None:
        return _computed(model, layers, config, bar=bar)
    directory = entry_dir(key)
    if (found := complete_entry(key, len(layers), bar)) is not None:
        return found
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(waited_lock(directory.parent / f".{key}.lock"))
        except OSError:  # a read-only cache: compute every time
            return _computed(model, layers, config, bar=bar)
        if (found := complete_entry(key, len(layers), bar)) is not None:  # computed while we waited
            return found
        tables = projection_tables(model, layers, config, bar=bar)
        try:
            with staged_directory(directory) as tmp:
                _write(tmp, tables)
        except OSError:  # the cache cannot be written: the files go to a temporary directory
            return _computed(model, layers, config, tables=tables)
        return {"files": {name: directory / f"{name}.parquet" for name in TABLES}, "cached": False, "method": METHOD}


def _computed(model: Model, layers: list[int], config, *, bar=None, tables=None) -> dict:
    """Projection files written to a fresh temporary directory (no cache); ``tables`` if already computed."""
    if tables is None:
        tables = projection_tables(model, layers, config, bar=bar)
    directory = Path(tempfile.mkdtemp(prefix="kvmem-projections-"))
    _write(directory, tables)
    return {"files": {name: directory / f"{name}.parquet" for name in TABLES}, "cached": False,
            "method": tables.stats.method}


def _write(directory: Path, tables: ProjectionTables) -> None:
    for name in TABLES:
        write_parquet(directory / f"{name}.parquet", getattr(tables, name))
    record = {**tables.stats.to_dict(), "seconds": round(tables.seconds, 2)}
    (directory / RECORD).write_text(json.dumps(record, sort_keys=True) + "\n")
