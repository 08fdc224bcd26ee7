"""Turn a finished scan into atlas tables and write them atomically (see :mod:`kvmem.schema`)."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvmem.atomic import staged_directory
from kvmem.conventions import CONVENTIONS, DEFAULT_CONVENTION
from kvmem.manifest import Manifest
from kvmem.models import Model
from kvmem.plan import TokenPlan, pack, unpack
from kvmem.scanning.checkpoint import save_state
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.histogram import HIST_BINS, bin_edges
from kvmem.scanning.parquet import write_parquet
from kvmem.scanning.projection import cached_projection_files
from kvmem.scanning.state import QUADRANTS, LayerState, ScanState
from kvmem.scanning.texts import trigger_texts
from kvmem.schema import FORMAT_VERSION, TRIGGER_KINDS, conform

__all__ = ["write_atlas", "write_tables", "build_manifest", "neurons_table", "histograms_table", "triggers_table",
           "samples_table", "contexts_table", "unigrams_table", "STATE_DIR"]

STATE_DIR = "state"  # inside a shard atlas: its mergeable scan state (see kvmem.scanning.checkpoint)


def write_atlas(target: Path, model: Model, corpus: dict, config: ScanConfig, plan: TokenPlan, state: ScanState, *,
                overwrite: bool, phases, backend: str, world: int = 1, keep_state: bool = False,
                run: dict | None = None) -> None:
    """Tables from a finished (merged) scan state, projections from the per-model cache, manifest last.
    ``backend``: the name of the streaming backend that produced the state."""
    layers = state.layers
    with phases.phase("texts", total=3) as bar:
        triggers = triggers_table(state)
        bar.update()
        samples = samples_table(state)
        bar.update()
        codes = [pack(t.column("doc").to_numpy(), t.column("pos").to_numpy()) for t in (triggers, samples) if t is not None]
        contexts = contexts_table(model, config, plan, state, np.unique(np.concatenate(codes)))
        bar.update()
    tables = {"neurons": neurons_table(model, layers, state.layer_states), "triggers": triggers, "contexts": contexts,
              "histograms": histograms_table(layers, state.layer_states), "unigrams": unigrams_table(state),
              **({"samples": samples} if samples is not None else {})}
    with phases.phase("projections", total=len(layers)) as bar:
        projections = cached_projection_files(model, layers, config, bar=bar)

    def manifest() -> dict:
        timing = {"phases": phases.so_far(), "total_seconds": phases.elapsed(),
                  "stream_tokens_per_second": round(state.tokens / state.seconds, 1) if state.seconds else None,
                  "world_size": world, "batches": state.batches, "shard": list(config.shard),
                  "projections_cached": projections["cached"], **(run or {})}
        return build_manifest(model, corpus, config, plan, state, timing, backend=backend,
                              projection_method=projections["method"])

    with phases.phase("write", total=len(tables) + 2) as bar:
        write_tables(target, tables, manifest, overwrite=overwrite, copy=projections["files"], bar=bar,
                     state=state if keep_state else None)


def write_tables(target: Path, tables: dict[str, pa.Table], manifest, *, overwrite: bool, copy: dict | None = None,
                 bar=None, state=None) -> None:
    """Write into a hidden sibling directory, then rename it into place: a crash leaves no half atlas.

    ``manifest``: a :class:`~kvmem.manifest.Manifest`, or a function returning one (called last, so
    it can time the writing);
    ``copy``: table name -> an already written parquet file to link (or copy) in; ``state``: a scan state to
    keep beside the tables (shard atlases, for ``kvmem merge``).
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(target)
    with staged_directory(target) as tmp:
        def write(name: str) -> None:
            write_parquet(tmp / f"{name}.parquet", conform(tables[name], name))

        # parquet encoding and compression release the GIL: the tables are written side by side,
        # the largest first (on 2 cores the triggers table alone then sets the time)
        by_size = sorted(tables, key=lambda name: -tables[name].nbytes)
        with ThreadPoolExecutor(max_workers=min(4, len(by_size)) or 1) as pool:
            for done in as_completed([pool.submit(write, name) for name in by_size]):
                done.result()
                if bar is not None:
                    bar.update()
        for name, source in (copy or {}).items():
            _link_or_copy(Path(source), tmp / f"{name}.parquet")
        if state is not None:
            save_state(tmp / STATE_DIR, state, {"shard": True}, tensor_file="state.safetensors")
        if bar is not None:
            bar.update()
        (manifest() if callable(manifest) else manifest).write(tmp / "manifest.json")


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link to a cached file (no bytes rewritten), else a copy (another file system, no links).

    The atlas stays self-contained: deleting it, or the cache, leaves the other's file intact, and
    neither is ever written in place (the cache and atlases are replaced by renaming directories)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


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


def _trigger_arrays(layers: list[int], states: dict[int, LayerState]) -> dict[str, np.ndarray]:
    """Flatten kept triggers, sorted by (layer, neuron, kind, rank); empty entries dropped."""
    parts: dict[str, list[np.ndarray]] = {}
    for layer in layers:
        sides = states[layer].sides()
        k, d_ff = sides["top"].values.shape
        values = np.stack([side.values.cpu().numpy() for side in sides.values()]).transpose(2, 0, 1)  # [F, kinds, k]
        codes = np.stack([side.codes.cpu().numpy() for side in sides.values()]).transpose(2, 0, 1)
        context = np.stack([side.context.cpu().numpy() for side in sides.values()]).transpose(2, 0, 1, 3)
        extras = states[layer].extras  # gate, up after the context coefficients (or none)
        width = context.shape[-1] - extras
        kind_names = np.broadcast_to(np.array([TRIGGER_KINDS.index(name) for name in sides], np.int64)[None, :, None],
                                     values.shape)
        ranks = np.broadcast_to(np.arange(k, dtype=np.int16)[None, None, :], values.shape)
        neurons = np.broadcast_to(np.arange(d_ff, dtype=np.int32)[:, None, None], values.shape)
        keep = (codes >= 0).reshape(-1)
        for name, array in (("neuron", neurons), ("kind", kind_names), ("rank", ranks), ("activation", values),
                            ("code", codes)):
            parts.setdefault(name, []).append(array.reshape(-1)[keep])
        rows = context.reshape(len(keep), context.shape[-1])[keep]
        parts.setdefault("context", []).append(rows[:, :width])
        nan = np.full(len(rows), np.nan, np.float32)
        parts.setdefault("gate_pre", []).append(rows[:, width] if extras else nan)
        parts.setdefault("up_pre", []).append(rows[:, width + 1] if extras else nan)
        parts.setdefault("layer", []).append(np.full(int(keep.sum()), layer, np.int16))
    return {name: np.concatenate(p) for name, p in parts.items()}


def contexts_table(model: Model, config: ScanConfig, plan: TokenPlan, state, codes: np.ndarray) -> pa.Table:
    """One row per distinct position in ``codes`` (sorted packed (doc, pos)): its text, cut from the
    window the model read (no second pass)."""
    doc, pos = unpack(codes)
    infos = trigger_texts(state.texts, doc, pos, window=plan.window, before=config.context_before,
                          after=config.context_after, token_str=model.token_str)
    vocab = model.vocab_strings
    piece_offsets = np.concatenate([[0], np.cumsum([len(t.pieces) for t in infos])]).astype(np.int64)
    token_ids = np.array([t.token_id for t in infos], np.int32)
    next_ids = np.array([t.next_token_id for t in infos], np.int32)
    return pa.table({
        "doc": np.asarray(doc, np.int64), "pos": np.asarray(pos, np.int32),
        "doc_id": pa.array([t.doc_id for t in infos], pa.string()),
        "token_id": token_ids,
        "token": pa.array([vocab[i] for i in token_ids.tolist()], pa.string()),
        "next_token_id": next_ids,
        "next_token": pa.array([vocab[i] if i >= 0 else "" for i in next_ids.tolist()], pa.string()),
        "context": pa.array([t.context for t in infos], pa.string()),
        "span_start": np.array([t.span[0] for t in infos], np.int32),
        "span_end": np.array([t.span[1] for t in infos], np.int32),
        "context_tokens": pa.LargeListArray.from_arrays(pa.array(piece_offsets),
                                                        pa.array([p for t in infos for p in t.pieces], pa.string())),
        "context_trigger": np.array([t.trigger_index for t in infos], np.int16),
    })


def _list_column(matrix: np.ndarray, rows: int) -> pa.Array:
    """[T, width] float32 with NaN outside the window -> list<float32> of the valid entries per row."""
    if matrix.shape[1]:
        valid = ~np.isnan(matrix)
        lengths, flat = valid.sum(axis=1), matrix[valid]
    else:
        lengths, flat = np.zeros(rows, np.int64), np.empty(0, np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(np.float32)))


def triggers_table(state) -> pa.Table:
    """One row per kept trigger; its text is the row (doc, pos) of the contexts table."""
    arrays = _trigger_arrays(state.layers, state.layer_states)
    doc, pos = unpack(arrays["code"])
    return pa.table({
        "layer": arrays["layer"], "neuron": arrays["neuron"],
        "kind": pc.take(pa.array(TRIGGER_KINDS, pa.string()), pa.array(arrays["kind"])),
        "rank": arrays["rank"], "activation": arrays["activation"].astype(np.float32),
        "doc": np.asarray(doc, np.int64), "pos": np.asarray(pos, np.int32),
        "context_activations": _list_column(arrays["context"], len(arrays["code"])),
        "gate_pre": arrays["gate_pre"].astype(np.float32), "up_pre": arrays["up_pre"].astype(np.float32),
    })


def _sample_arrays(layers: list[int], states: dict[int, LayerState]) -> dict[str, np.ndarray] | None:
    """Flatten samples, sorted by (layer, neuron, kind (random, then bin), bin, rank); empty entries dropped."""
    parts: dict[str, list[np.ndarray]] = {}

    def add(**columns):
        for name, values in columns.items():
            parts.setdefault(name, []).append(values)

    for layer in layers:
        s = states[layer]
        pieces = []
        if s.random is not None:
            codes = s.random.codes.cpu().numpy()
            values = s.random.values.cpu().numpy().T  # [F, S]
            context = s.random.context.cpu().numpy().transpose(1, 0, 2)  # [F, S, C (+ gate, up)]
            context = context[:, :, :context.shape[2] - s.extras]
            d_ff, size = values.shape
            keep = np.broadcast_to(codes >= 0, (d_ff, size)).reshape(-1)
            pieces.append(dict(
                neuron=np.repeat(np.arange(d_ff, dtype=np.int32), size)[keep], kind=np.zeros(keep.sum(), np.int8),
                bin=np.full(keep.sum(), -1, np.int16), rank=np.tile(np.arange(size, dtype=np.int16), d_ff)[keep],
                activation=values.reshape(-1)[keep], code=np.tile(codes, d_ff)[keep],
                context=context.reshape(d_ff * size, -1)[keep]))
        if s.bins is not None:
            codes = s.bins.codes.cpu().numpy()  # [F, B, Q]
            neuron, bin_, rank = np.nonzero(codes >= 0)
            width = pieces[0]["context"].shape[1] if pieces else 0
            pieces.append(dict(
                neuron=neuron.astype(np.int32), kind=np.ones(len(neuron), np.int8), bin=bin_.astype(np.int16),
                rank=rank.astype(np.int16), activation=s.bins.values.cpu().numpy()[neuron, bin_, rank],
                code=codes[neuron, bin_, rank], context=np.full((len(neuron), width), np.nan, np.float32)))
        if not pieces:
            return None
        merged = {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}
        order = np.lexsort((merged["rank"], merged["bin"], merged["kind"], merged["neuron"]))
        add(layer=np.full(len(order), layer, np.int16), **{name: values[order] for name, values in merged.items()})
    return {name: np.concatenate(p) for name, p in parts.items()}


def samples_table(state) -> pa.Table | None:
    """One row per sampled coefficient (None when the scan kept no samples); text as for triggers."""
    arrays = _sample_arrays(state.layers, state.layer_states)
    if arrays is None:
        return None
    doc, pos = unpack(arrays["code"])
    return pa.table({
        "layer": arrays["layer"], "neuron": arrays["neuron"],
        "kind": pc.take(pa.array(["random", "bin"], pa.string()), pa.array(arrays["kind"].astype(np.int64))),
        "bin": arrays["bin"], "rank": arrays["rank"], "activation": arrays["activation"].astype(np.float32),
        "doc": np.asarray(doc, np.int64), "pos": np.asarray(pos, np.int32),
        "context_activations": _list_column(arrays["context"], len(arrays["code"])),
    })


def build_manifest(model: Model, corpus: dict, config: ScanConfig, plan: TokenPlan, state: ScanState, timing: dict,
                   *, backend: str, projection_method: str | None = None) -> Manifest:
    """The manifest of an atlas. Everything but ``timing`` is the same whether one process or many scanned.
    ``projection_method``: the method that computed the projection tables (see
    :mod:`kvmem.scanning.projection_screen`)."""
    import torch
    import transformer_lens
    import transformers

    from kvmem import __version__
    from kvmem.anatomy import ffn_params

    position = state.position
    plan_data = {**plan.to_dict(), "shard": [0, 1]}
    scan = {**config.to_dict(), "shard": [0, 1]}
    return Manifest(
        format_version=FORMAT_VERSION,
        kvmem_version=__version__,
        model=model.describe(),
        anatomy={"ffn_params_per_layer": ffn_params(model.d_model, model.d_ff, gated=model.gated, bias=model.has_bias)},
        corpus={**corpus, "documents": position.documents, "sha256_chain": position.corpus_digest},
        tokens=state.tokens,
        windows=state.windows,
        layers=list(state.layers),
        tokenization=plan_data,
        scan=scan,
        histogram={"bins": HIST_BINS, "edges": [e if np.isfinite(e) else ("inf" if e > 0 else "-inf")
                                                for e in bin_edges()]},
        projection={"conventions": {c: CONVENTIONS[c].formula for c in config.conventions},
                       "default_convention": DEFAULT_CONVENTION if DEFAULT_CONVENTION in config.conventions
                       else config.conventions[0], "top_n": config.top_n,
                    "keys": "score = W_E[token] . k (input embedding, no norm)",
                    "method": projection_method or "unknown",
                    "order": "top: score descending, bottom: score ascending; ties by token id ascending"},
        timing=timing,
        engine={"backend": backend, "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch.")},
        environment={"torch": torch.__version__, "transformers": transformers.__version__,
                     "transformer_lens": getattr(transformer_lens, "__version__", "unknown"),
                     "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch.")},
    )
