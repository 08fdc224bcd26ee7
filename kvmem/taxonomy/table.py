"""The taxonomy table: its typed Arrow schema (one definition), assembly, and atomic reading and writing.

One row per (layer, neuron). Columns come from three sources, named in :data:`COLUMNS`:

- ``weights``: from the model's weights alone (``kvmem taxonomy --model M``);
- ``atlas``: exact functions of an atlas's tables (null in a weights-only table);
- ``scan``: functions of the scan's streaming sums (atlas format 4; null in a weights-only table and for an
  atlas without the sums, the sidecar's ``scan_columns`` saying why). :data:`PENDING` lists columns not
  yet computed (none now).

The file carries its own provenance (thresholds, conventions, kvmem version, model fingerprint) twice: in
the parquet schema metadata under ``kvmem.taxonomy`` and in a JSON sidecar beside it (``taxonomy.json``),
so it never depends on the atlas manifest to be read.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from kvmem import __version__
from kvmem.atomic import read_replaced_parquet
from kvmem.conventions import CONVENTIONS
from kvmem.errors import KvmemError
from kvmem.taxonomy.thresholds import THRESHOLD_SOURCES, Thresholds

__all__ = ["COLUMNS", "FILE", "PENDING", "SCHEMA", "SIDECAR", "arrow_schema", "build_taxonomy", "read_taxonomy",
           "read_taxonomy_metadata", "write_taxonomy"]

SCHEMA = "kvmem.taxonomy/1"
FILE = "taxonomy.parquet"
SIDECAR = "taxonomy.json"
_META_KEY = b"kvmem.taxonomy"

# column -> (arrow type, source, meaning); the order is the column order on disk
COLUMNS: dict[str, tuple[str, str, str]] = {
    "layer": ("int16", "weights", "FFN layer"),
    "neuron": ("int32", "weights", "neuron i within the layer"),
    "key_norm": ("float32", "weights", "‖k_i‖ (W1 row; W_up row when gated)"),
    "gate_norm": ("float32", "weights", "‖g_i‖ (W_gate row); NaN for a plain FFN"),
    "value_norm": ("float32", "weights", "‖v_i‖, v_i = what neuron i writes into the residual stream per unit m_i"),
    "cos_key_value": ("float32", "weights", "cos(k_i, v_i): > 0 enrichment, < 0 depletion (Gerstner & Schütze 2025)"),
    "cos_gate_value": ("float32", "weights", "cos(g_i, v_i) for gated FFNs, NaN otherwise"),
    "null_space_fraction": ("float32", "weights", "‖P v_i‖² / ‖v_i‖², P the projector on W_U's k smallest left "
                                                  "singular directions (Stolfo et al. 2024)"),
    "vocab_mean": ("float32", "weights", "mean over tokens t of c_t = cos(W_U[:, t], v_i)"),
    "vocab_std": ("float32", "weights", "population standard deviation of c_t"),
    "vocab_skew": ("float32", "weights", "skewness of c_t: m3 / m2^1.5 (Gurnee et al. 2024)"),
    "vocab_kurtosis": ("float32", "weights", "excess kurtosis of c_t: m4 / m2² − 3 (Gurnee et al. 2024)"),
    "prediction": ("bool", "weights", "vocab_kurtosis > kurtosis threshold and vocab_skew > 0"),
    "suppression": ("bool", "weights", "vocab_kurtosis > kurtosis threshold and vocab_skew < 0"),
    "entropy_candidate": ("bool", "weights", "value_norm >= its layer's entropy_norm_quantile and "
                                             "null_space_fraction >= entropy_null_fraction"),
    "positions": ("int64", "atlas", "positions scanned"),
    "frac_positive": ("float64", "atlas", "share of positions with m_i > 0 (neurons table)"),
    "freq_weak": ("float64", "atlas", "share of positions with |m_i| >= weak_edge (histogram, exact)"),
    "freq_active": ("float64", "atlas", "share of positions with |m_i| >= active_edge (histogram, exact)"),
    "freq_strong": ("float64", "atlas", "share of positions with |m_i| >= strong_edge (histogram, exact)"),
    "freq_positive_active": ("float64", "atlas", "share of positions with m_i >= active_edge (histogram, exact)"),
    "max_abs": ("float32", "atlas", "max |m_i| seen (neurons table min, max)"),
    "dead": ("bool", "atlas", "no position with |m_i| >= weak_edge"),
    "rare": ("bool", "atlas", "not dead and freq_active < rare_frequency"),
    "detector_score": ("float64", "atlas", "share of the kept top triggers' mass Σ max(m, 0) on their most common "
                                           "token (Voita et al. 2024's token detectors)"),
    "detector_token_id": ("int32", "atlas", "that token (-1: no positive top trigger)"),
    "detector_token": ("string", "atlas", "its text"),
    "detector_triggers": ("int32", "atlas", "kept top triggers the score is over"),
    "top_trigger_token_id": ("int32", "atlas", "token at the neuron's rank-0 top trigger"),
    "top_trigger_token": ("string", "atlas", "its text"),
    "self_suppression_rank": ("int32", "atlas", "rank (0 = most suppressed) of top_trigger_token_id among the "
                                                "value's kept suppressed tokens (values table), -1 if not kept"),
    "position_correlation": ("float64", "scan", "Pearson r of m_i with p, the position in the window (Voita et al. "
                                                "2024's positional neurons), from Σm, Σm², Σp, Σp², Σm·p"),
    "positional": ("bool", "scan", "|position_correlation| >= positional_correlation"),
    "quadrant_pp": ("float64", "scan", "gated: share of positions with gate pre-activation > 0 and up > 0 "
                                       "(GLUScope, arXiv 2602.23826); NaN for a plain FFN"),
    "quadrant_pn": ("float64", "scan", "gated: share with gate > 0 and up <= 0"),
    "quadrant_np": ("float64", "scan", "gated: share with gate <= 0 and up > 0"),
    "quadrant_nn": ("float64", "scan", "gated: share with gate <= 0 and up <= 0"),
    "unigram_alignment": ("float64", "scan", "Pearson r over the corpus's tokens of W_U^T v_i with log unigram "
                                             "frequency (Stolfo et al. 2024's token-frequency neurons)"),
    "token_frequency": ("bool", "scan", "|unigram_alignment| >= unigram_alignment threshold"),
}

# columns not yet computed, with the reason (none: every column of issue 21 is computed)
PENDING: dict[str, str] = {}

_ARROW = {"int16": "int16", "int32": "int32", "int64": "int64", "float32": "float32", "float64": "float64",
          "bool": "bool_", "string": "string"}
_NUMPY = {"int16": np.int16, "int32": np.int32, "int64": np.int64, "float32": np.float32, "float64": np.float64}


def arrow_schema(metadata: dict | None = None):
    """The Arrow schema of the taxonomy table (with ``metadata`` under ``kvmem.taxonomy``)."""
    import pyarrow as pa

    fields = [pa.field(name, getattr(pa, _ARROW[kind])(), nullable=True,
                       metadata={"source": source, "meaning": meaning})
              for name, (kind, source, meaning) in COLUMNS.items()]
    return pa.schema(fields, metadata=None if metadata is None else {_META_KEY: json.dumps(metadata).encode()})


def _to_arrow(frame: pd.DataFrame, metadata: dict):
    """``frame`` as an Arrow table of the taxonomy schema; atlas columns absent from it are null."""
    import pyarrow as pa

    extra = sorted(set(frame.columns) - set(COLUMNS))
    if extra:
        raise KvmemError(f"taxonomy frame has columns {extra} that kvmem.taxonomy.table.COLUMNS does not define")
    schema = arrow_schema(metadata)
    arrays = []
    for name, (kind, source, _) in COLUMNS.items():
        if name not in frame.columns:
            if source == "weights":
                raise KvmemError(f"taxonomy frame lacks the weight column {name!r}")
            arrays.append(pa.nulls(len(frame), schema.field(name).type))
            continue
        column = frame[name]
        if kind in _NUMPY:
            arrays.append(pa.array(column.to_numpy(_NUMPY[kind]), type=schema.field(name).type))
        elif kind == "bool":
            arrays.append(pa.array(column.to_numpy(bool), type=pa.bool_()))
        else:
            arrays.append(pa.array([v if isinstance(v, str) else None for v in column.tolist()], type=pa.string()))
    return pa.Table.from_arrays(arrays, schema=schema)


def build_taxonomy(model, *, atlas=None, thresholds: Thresholds | None = None, convention: str | None = None,
                   block: int = 512) -> tuple[pd.DataFrame, dict]:
    """The taxonomy (DataFrame, metadata). Without ``atlas``: every layer of ``model``, weight columns only.

    With ``atlas``: its layers, plus the atlas columns; ``convention`` names the value projection the
    self-suppression rank reads (default: the atlas's default convention). ``block``: neurons per block of
    the vocabulary-wide statistics.
    """
    from kvmem.taxonomy.exact_columns import evidence_columns
    from kvmem.taxonomy.streaming import scan_columns
    from kvmem.taxonomy.weights import VALUE_CONVENTION, value_vectors, weight_statistics

    thresholds = thresholds or Thresholds()
    timing: dict = {}
    start = time.perf_counter()
    layers = None if atlas is None else atlas.layers
    frame = weight_statistics(model, layers=layers, thresholds=thresholds, block=block, timing=timing)
    metadata = {
        "schema": SCHEMA, "kvmem_version": __version__,
        "model": {"name": model.name, "fingerprint": model.fingerprint, "d_model": model.d_model,
                  "d_ff": model.d_ff, "vocab_size": model.vocab_size, "gated": model.gated},
        "value_convention": {"name": VALUE_CONVENTION, "formula": CONVENTIONS[VALUE_CONVENTION].formula,
                             "meaning": "v_i as kvmem.conventions.value_vectors(model, layer, 'raw') returns it: "
                                        "what neuron i writes into the residual stream; W_U = model.unembedding()"},
        "null_space_dim": thresholds.null_space_dim(model.d_model),
        "thresholds": thresholds.to_dict(), "threshold_sources": THRESHOLD_SOURCES,
        "atlas": None, "self_suppression_convention": None, "scan_columns": None,
        "pending_columns": PENDING,
    }
    if atlas is not None:
        convention = convention or atlas.default_convention
        t0 = time.perf_counter()
        scanned = model if model.fingerprint == atlas.manifest.model.get("fingerprint") else None
        evidence = evidence_columns(atlas, thresholds, convention=convention, model=scanned)
        timing["atlas"] = time.perf_counter() - t0
        frame = frame.merge(evidence, on=["layer", "neuron"], how="left", validate="one_to_one")
        manifest = atlas.manifest
        metadata["atlas"] = {"corpus": manifest.corpus.get("spec"), "tokens": manifest.tokens,
                             "top_k": manifest.scan.get("top_k"), "top_n": manifest.projection.get("top_n",
                                                                                                  manifest.scan.get("top_n")),
                             "atlas_kvmem_version": manifest.kvmem_version,
                             "model_fingerprint": manifest.model.get("fingerprint")}
        metadata["self_suppression_convention"] = {"name": convention,
                                                   "formula": CONVENTIONS[convention].formula if convention in CONVENTIONS else ""}
        t0 = time.perf_counter()
        streamed, metadata["scan_columns"] = scan_columns(atlas, model, thresholds, value_vectors=value_vectors)
        timing["scan"] = time.perf_counter() - t0
        if streamed is not None:
            frame = frame.merge(streamed, on=["layer", "neuron"], how="left", validate="one_to_one")
    timing["total"] = time.perf_counter() - start
    metadata["timing_seconds"] = {k: round(v, 3) for k, v in timing.items()}
    return frame, metadata


def _replace_atomically(path: Path, write) -> None:
    """Call ``write(tmp)`` on a hidden sibling of ``path``, then rename it over ``path``."""
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.writing-", dir=path.parent)
    os.close(handle)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_taxonomy(frame: pd.DataFrame, metadata: dict, path: str | os.PathLike) -> Path:
    """Write ``frame`` to ``path`` (parquet, typed schema, metadata inside) and ``metadata`` to the JSON sidecar
    beside it (``<stem>.json``); each file is replaced by rename, so a reader sees the old or the new one."""
    import pyarrow.parquet as pq

    path = Path(path)
    if path.suffix != ".parquet":
        raise KvmemError(f"taxonomy output {path} must end in .parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    table = _to_arrow(frame.sort_values(["layer", "neuron"]).reset_index(drop=True), metadata)
    _replace_atomically(path, lambda tmp: pq.write_table(table, tmp))
    _replace_atomically(path.with_suffix(".json"),
                        lambda tmp: tmp.write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n"))
    return path


def read_taxonomy(path: str | os.PathLike) -> pd.DataFrame:
    """The taxonomy table as a DataFrame (``frame.attrs['kvmem.taxonomy']`` holds its metadata)."""

    path = Path(path)
    if not path.exists():
        raise KvmemError(f"{path} does not exist; write it with kvmem taxonomy")
    try:
        table = read_replaced_parquet(path)
    except Exception as error:  # pyarrow raises several types for a damaged file
        raise KvmemError(f"{path} is not a readable taxonomy table ({error}); write it again with kvmem taxonomy") from None
    meta = table.schema.metadata or {}
    if _META_KEY not in meta:
        raise KvmemError(f"{path} is not a kvmem taxonomy table (no kvmem.taxonomy metadata); write it with kvmem taxonomy")
    frame = table.to_pandas()
    frame.attrs["kvmem.taxonomy"] = json.loads(meta[_META_KEY])
    return frame


def read_taxonomy_metadata(path: str | os.PathLike) -> dict:
    """The metadata stored in a taxonomy parquet file (thresholds, conventions, versions, fingerprint)."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    if _META_KEY not in meta:
        raise KvmemError(f"{path} is not a kvmem taxonomy table (no kvmem.taxonomy metadata)")
    return json.loads(meta[_META_KEY])
