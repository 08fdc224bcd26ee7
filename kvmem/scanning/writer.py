"""Turn a finished scan into atlas tables and write them atomically (see :mod:`kvmem.schema`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvmem.atomic import staged_directory
from kvmem.corpus import Corpus
from kvmem.models import Model
from kvmem.scanning.accumulator import LayerState, ordered, unpack
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.contexts import context_activations, trigger_texts
from kvmem.scanning.histogram import HIST_BINS, bin_edges
from kvmem.scanning.projection import key_vectors, project_rows, value_vectors
from kvmem.schema import CONVENTIONS, FORMAT_VERSION, ROW_GROUP_NEURONS

__all__ = ["write_atlas", "write_tables", "build_manifest", "neurons_table", "histograms_table", "projection_tables"]

TOKENIZATION_RULE = ("each document is tokenized alone without special tokens; window k holds tokens "
                     "[k*window, (k+1)*window); the model reads [BOS] + window when prepend_bos (BOS never scored)")


def write_atlas(target: Path, model: Model, corpus: Corpus, config: ScanConfig, state, *, overwrite: bool,
                progress: bool) -> None:
    layers = state.layers
    tables = {
        "neurons": neurons_table(model, layers, state.layer_states),
        "triggers": triggers_table(model, corpus, config, state),
        **projection_tables(model, layers, config),
        "histograms": histograms_table(layers, state.layer_states),
    }
    manifest = build_manifest(model, corpus, config, state)
    write_tables(target, tables, manifest, overwrite=overwrite)


def write_tables(target: Path, tables: dict[str, pa.Table], manifest: dict, *, overwrite: bool) -> None:
    """Write into a hidden sibling directory, then rename it into place: a crash leaves no half atlas."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(target)
    with staged_directory(target) as tmp:
        for name, table in tables.items():
            _write_parquet(tmp / f"{name}.parquet", table)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _write_parquet(path: Path, table: pa.Table) -> None:
    """Row groups never span a layer and hold at most ROW_GROUP_NEURONS neurons."""
    layer = table.column("layer").to_numpy().astype(np.int64)
    neuron = table.column("neuron").to_numpy().astype(np.int64)
    group = layer * (1 << 24) + neuron // ROW_GROUP_NEURONS
    cuts = np.flatnonzero(np.diff(group)) + 1 if len(group) else np.array([], np.int64)
    bounds = [0, *cuts.tolist(), len(group)]
    with pq.ParquetWriter(path, table.schema, compression="zstd") as writer:
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if stop > start or len(group) == 0:
                writer.write_table(table.slice(start, stop - start), row_group_size=max(stop - start, 1))


def neurons_table(model: Model, layers: list[int], states: dict[int, LayerState]) -> pa.Table:
    columns: dict[str, list[np.ndarray]] = {}
    for layer in layers:
        s = states[layer]
        n = s.count
        mean = (s.total / n).cpu().numpy()
        variance = np.maximum((s.total_sq / n).cpu().numpy() - mean * mean, 0.0)
        top, _ = ordered(s.top_values, s.top_codes, largest=True)
        bottom, _ = ordered(s.bottom_values, s.bottom_codes, largest=False)
        gate = model.gate_keys(layer)
        part = {
            "layer": np.full(model.d_ff, layer, np.int16),
            "neuron": np.arange(model.d_ff, dtype=np.int32),
            "count": np.full(model.d_ff, n, np.int64),
            "mean": mean,
            "std": np.sqrt(variance),
            "min": bottom[0].cpu().numpy().astype(np.float32),
            "max": top[0].cpu().numpy().astype(np.float32),
            "frac_positive": s.positive.cpu().numpy() / n,
            "act_sum": s.total.cpu().numpy(),
            "act_sq_sum": s.total_sq.cpu().numpy(),
            "key_norm": model.keys(layer).float().norm(dim=1).cpu().numpy(),
            "gate_norm": (gate.float().norm(dim=1).cpu().numpy() if gate is not None
                          else np.full(model.d_ff, np.nan, np.float32)),
            "value_norm": model.values(layer).float().norm(dim=1).cpu().numpy(),
        }
        for name, values in part.items():
            columns.setdefault(name, []).append(values)
    return pa.table({name: np.concatenate(parts) for name, parts in columns.items()})


def histograms_table(layers: list[int], states: dict[int, LayerState]) -> pa.Table:
    d_ff = states[layers[0]].histogram.shape[0]
    counts = np.concatenate([states[layer].histogram.cpu().numpy().reshape(-1) for layer in layers])
    return pa.table({
        "layer": np.repeat(np.asarray(layers, np.int16), d_ff),
        "neuron": np.tile(np.arange(d_ff, dtype=np.int32), len(layers)),
        "counts": pa.FixedSizeListArray.from_arrays(pa.array(counts, pa.int64()), HIST_BINS),
    })


def _trigger_arrays(layers: list[int], states: dict[int, LayerState]) -> dict[str, np.ndarray]:
    """Flatten kept triggers, sorted by (layer, neuron, kind, rank); empty slots dropped."""
    parts: dict[str, list[np.ndarray]] = {}
    for layer in layers:
        s = states[layer]
        kinds = [("top", s.top_values, s.top_codes, True), ("bottom", s.bottom_values, s.bottom_codes, False)]
        if s.doc_top_values is not None:
            kinds += [("top_doc", s.doc_top_values, s.doc_top_codes, True),
                      ("bottom_doc", s.doc_bottom_values, s.doc_bottom_codes, False)]
        k, d_ff = s.top_values.shape
        values = np.stack([ordered(v, c, largest=lg)[0].cpu().numpy() for _, v, c, lg in kinds])  # [kinds, k, F]
        codes = np.stack([ordered(v, c, largest=lg)[1].cpu().numpy() for _, v, c, lg in kinds])
        values, codes = values.transpose(2, 0, 1), codes.transpose(2, 0, 1)  # [F, kinds, k]
        kind_names = np.broadcast_to(np.array([name for name, *_ in kinds], object)[None, :, None], values.shape)
        ranks = np.broadcast_to(np.arange(k, dtype=np.int16)[None, None, :], values.shape)
        neurons = np.broadcast_to(np.arange(d_ff, dtype=np.int32)[:, None, None], values.shape)
        keep = (codes >= 0).reshape(-1)
        for name, array in (("neuron", neurons), ("kind", kind_names), ("rank", ranks), ("activation", values),
                            ("code", codes)):
            parts.setdefault(name, []).append(array.reshape(-1)[keep])
        parts.setdefault("layer", []).append(np.full(int(keep.sum()), layer, np.int16))
    return {name: np.concatenate(p) for name, p in parts.items()}


def triggers_table(model: Model, corpus: Corpus, config: ScanConfig, state) -> pa.Table:
    arrays = _trigger_arrays(state.layers, state.layer_states)
    codes, inverse = np.unique(arrays["code"], return_inverse=True)
    import torch

    doc_u, pos_u = (t.numpy() for t in unpack(torch.from_numpy(codes)))
    texts = trigger_texts(model, corpus, set(zip(doc_u.tolist(), pos_u.tolist())), window=state.window,
                          before=config.context_before, after=config.context_after, shard=config.shard)
    infos = [texts[(int(d), int(p))] for d, p in zip(doc_u, pos_u)]
    vocab = model.vocab_strings

    def take(values, type_=None) -> pa.Array:
        return pc.take(pa.array(values, type_), pa.array(inverse))

    piece_lengths = np.array([len(t.pieces) for t in infos], np.int64)
    flat_pieces = pa.array([p for t in infos for p in t.pieces], pa.string())
    starts = np.concatenate([[0], np.cumsum(piece_lengths)[:-1]])[inverse]
    lengths = piece_lengths[inverse]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    context_tokens = pa.LargeListArray.from_arrays(pa.array(offsets), pc.take(flat_pieces, pa.array(gather)))

    if config.context_activations:
        unique = np.stack([doc_u, pos_u], axis=1)
        matrix, act_lengths = context_activations(
            model, corpus, texts, unique, inverse, arrays["layer"].astype(np.int64), arrays["neuron"].astype(np.int64),
            prepend_bos=config.prepend_bos, batch_size=config.batch_size)
        flat = matrix[np.arange(matrix.shape[1])[None] < act_lengths[:, None]]
        act_offsets = np.concatenate([[0], np.cumsum(act_lengths)]).astype(np.int64)
    else:
        flat, act_offsets = np.empty(0, np.float32), np.zeros(len(inverse) + 1, np.int64)
    context_acts = pa.LargeListArray.from_arrays(pa.array(act_offsets), pa.array(flat.astype(np.float32)))

    token_ids = np.array([t.token_id for t in infos], np.int32)
    next_ids = np.array([t.next_token_id for t in infos], np.int32)
    return pa.table({
        "layer": arrays["layer"],
        "neuron": arrays["neuron"],
        "kind": pa.array(arrays["kind"].tolist(), pa.string()),
        "rank": arrays["rank"],
        "activation": arrays["activation"].astype(np.float32),
        "doc": doc_u[inverse].astype(np.int64),
        "doc_id": take([t.doc_id for t in infos], pa.string()),
        "pos": pos_u[inverse].astype(np.int32),
        "token_id": token_ids[inverse],
        "token": take([vocab[i] for i in token_ids], pa.string()),
        "next_token_id": next_ids[inverse],
        "next_token": take([vocab[i] if i >= 0 else "" for i in next_ids], pa.string()),
        "context": take([t.context for t in infos], pa.string()),
        "span_start": np.array([t.span[0] for t in infos], np.int32)[inverse],
        "span_end": np.array([t.span[1] for t in infos], np.int32)[inverse],
        "context_tokens": context_tokens,
        "context_trigger": np.array([t.trigger_index for t in infos], np.int16)[inverse],
        "context_activations": context_acts,
    })


def projection_tables(model: Model, layers: list[int], config: ScanConfig) -> dict[str, pa.Table]:
    vocab = np.array(model.vocab_strings, dtype=object)
    n = min(config.top_n, model.vocab_size)
    value_parts, key_parts = [], []
    unembedding, embedding = model.unembedding(), model.embedding().T  # [d_model, vocab] each
    for layer in layers:
        for convention in config.conventions:
            value_parts.append(_projection_rows(layer, project_rows(value_vectors(model, layer, convention), unembedding, n),
                                                "convention", convention))
        for vector, rows in (key_vectors(model, layer).items() if config.key_projections else ()):
            key_parts.append(_projection_rows(layer, project_rows(rows, embedding, n), "vector", vector))
    return {"values": _projection_table(value_parts, "convention", vocab),
            "keys": _projection_table(key_parts, "vector", vocab)}


def _projection_rows(layer: int, projection, label_name: str, label: str) -> dict[str, np.ndarray]:
    d_ff, n = projection.top_ids.shape
    ids = np.stack([projection.top_ids.numpy(), projection.bottom_ids.numpy()], axis=1)  # [F, 2, n]
    scores = np.stack([projection.top_scores.numpy(), projection.bottom_scores.numpy()], axis=1)
    return {"layer": layer, "d_ff": d_ff, "n": n, label_name: label, "ids": ids, "scores": scores}


def _projection_table(parts: list[dict], label_name: str, vocab: np.ndarray) -> pa.Table:
    """Rows sorted by (layer, neuron, label, kind, rank)."""
    order = ["layer", "neuron", label_name, "kind", "rank", "token_id", "token", "score"]
    if not parts:  # e.g. key projections switched off: an empty table with the same columns
        types = [pa.int16(), pa.int32(), pa.string(), pa.string(), pa.int16(), pa.int32(), pa.string(), pa.float32()]
        return pa.table({name: pa.array([], t) for name, t in zip(order, types)})
    by_layer: dict[int, list[dict]] = {}
    for part in parts:
        by_layer.setdefault(part["layer"], []).append(part)
    columns: dict[str, list[np.ndarray]] = {}
    for layer, group in by_layer.items():
        d_ff, n = group[0]["d_ff"], group[0]["n"]
        ids = np.stack([g["ids"] for g in group], axis=1)  # [F, labels, 2, n]
        scores = np.stack([g["scores"] for g in group], axis=1)
        shape = ids.shape
        labels = np.array([g[label_name] for g in group], object)
        pieces = {
            "layer": np.full(ids.size, layer, np.int16),
            "neuron": np.broadcast_to(np.arange(d_ff, dtype=np.int32)[:, None, None, None], shape).reshape(-1),
            label_name: np.broadcast_to(labels[None, :, None, None], shape).reshape(-1),
            "kind": np.broadcast_to(np.array(["promote", "suppress"], object)[None, None, :, None], shape).reshape(-1),
            "rank": np.broadcast_to(np.arange(n, dtype=np.int16)[None, None, None, :], shape).reshape(-1),
            "token_id": ids.reshape(-1).astype(np.int32),
            "score": scores.reshape(-1).astype(np.float32),
        }
        for name, values in pieces.items():
            columns.setdefault(name, []).append(values)
    merged = {name: np.concatenate(values) for name, values in columns.items()}
    merged["token"] = vocab[merged["token_id"]]
    return pa.table({name: (pa.array(merged[name].tolist(), pa.string()) if merged[name].dtype == object
                            else merged[name]) for name in order})


def build_manifest(model: Model, corpus: Corpus, config: ScanConfig, state) -> dict:
    import torch
    import transformer_lens
    import transformers

    from kvmem import __version__
    from kvmem.anatomy import ffn_params

    return {
        "format_version": FORMAT_VERSION,
        "kvmem_version": __version__,
        "model": model.describe(),
        "anatomy": {"ffn_params_per_layer": ffn_params(model.d_model, model.d_ff, gated=model.gated, bias=model.has_bias)},
        "corpus": {**corpus.describe(), "documents": state.documents, "sha256_chain": state.corpus_digest},
        "tokens": state.tokens,
        "windows": state.windows_done,
        "layers": list(state.layers),
        "tokenization": {"window": state.window, "prepend_bos": config.prepend_bos,
                         "bos_token_id": model.bos_token_id if config.prepend_bos else None, "rule": TOKENIZATION_RULE},
        "scan": config.to_dict(),
        "shards": [{"index": config.shard[0], "count": config.shard[1], "tokens": state.tokens,
                    "sha256_chain": state.corpus_digest}],
        "histogram": {"bins": HIST_BINS, "edges": [e if np.isfinite(e) else ("inf" if e > 0 else "-inf")
                                                   for e in bin_edges()]},
        "projection": {"conventions": {c: CONVENTIONS[c] for c in config.conventions}, "top_n": config.top_n,
                       "keys": "score = W_E[token] . k (input embedding, no norm)"},
        "timing": {"scan_seconds": round(state.seconds, 3),
                   "tokens_per_second": round(state.tokens / state.seconds, 1) if state.seconds else None},
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "transformer_lens": getattr(transformer_lens, "__version__", "unknown"),
                        "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch.")},
    }
