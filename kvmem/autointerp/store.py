"""``explanations.parquet`` in an atlas: one row per (layer, neuron, side, explainer), typed, merged by key.

Writes go to a temporary file in the atlas that replaces the old one by rename, so a reader (or a
killed run) sees the old table or the new one, never half of it. Rows are merged by key: rows
already there are kept as they are unless the caller replaces them (scores of a rescored row).
The manifest gains an ``explanations`` entry (file, rows, explainers, schema version, columns).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pandas as pd

from kvmem.errors import KvmemError

__all__ = ["FILE", "SCHEMA_VERSION", "KEY", "COLUMNS", "SCORE_FIELDS", "arrow_schema", "empty", "read", "write",
           "upsert", "Storer"]

FILE = "explanations.parquet"
SCHEMA_VERSION = 2
KEY = ("layer", "neuron", "side", "explainer")
SCORER_NAMES = ("detection", "fuzzing", "simulation", "output", "intervention", "embedding")

BASE: dict[str, str] = {
    "layer": "int16, FFN layer",
    "neuron": "int32, neuron within the layer",
    "side": "string: positive (+v, top triggers) | negative (-v, bottom triggers)",
    "explainer": "string, the explainer spec (tokens, hf:PATH, openai:URL, or user:FILE for a user's file)",
    "explainer_model": "string, the model that wrote the text ('' for tokens and user files)",
    "explainer_fingerprint": "string, its fingerprint (weights hash, or the endpoint's model id)",
    "prompt_version": "string, the explain prompt's version ('' without a prompt)",
    "prompt_hash": "string, sha256 prefix of that prompt (kvmem.autointerp.prompts)",
    "text": "string, the explanation",
    "rule": "string, a rule a program applies (JSON, kvmem.autointerp.token_rules), '' when none",
    "explain_score": "float64, the explainer's own balanced accuracy on the examples it saw (NaN if none)",
    "explain_codes": "list<int64>, position codes (doc << 32 | pos) of the examples the explainer saw",
    "split_seed": "int64, seed of the explain / held-out split (kvmem.autointerp.splits)",
    "held_out": "float64, fraction of positions held out",
    "split_window": "int32, tokens per split unit: the scanned window (every position of a window in one set; -1: "
                    "split per position by an earlier kvmem, explain again)",
}
# per scorer S: S (the score), S_low / S_high (95% interval), S_p (p-value under the side's permutation null),
# S_n (examples), S_n_quiet (non-activating ones), S_status, S_protocol, S_metrics, S_judge, S_codes (held-out
# position codes), S_baseline* (scored with another neuron's explanation), S_baseline_from (that neuron),
# S_diff_low / S_diff_high (paired interval of S minus S_baseline), S_random_init* (the same neuron side of a
# random-init copy). kvmem.autointerp.tidy.score_table gives the same as one row per side and scorer.
SCORE_FIELDS: dict[str, str] = {
    "": "float64, score: balanced accuracy (detection, fuzzing, output), Pearson r (simulation), share of steered "
        "continuations picked (intervention), AUC (embedding); NaN if unscored or not scorable (see S_status)",
    "_low": "float64, lower end of its 95% interval (bootstrap over examples; simulation: the permutation null's "
            "spread around the score)",
    "_high": "float64, upper end",
    "_p": "float64, one-sided p-value of the score under a permutation null built for this side (scorers/nulls.py)",
    "_n": "int32, held-out examples scored (-1 if unscored)",
    "_n_quiet": "int32, of them non-activating (detection; -1 where not counted)",
    "_status": "string: ok | few-quiet (fewer non-activating examples than min_quiet: not scored) | few-examples | "
               "'' (unscored)",
    "_protocol": "string: kvmem | delphi | neuron-explainer (how the examples were built and the metric computed)",
    "_metrics": "string, JSON of the protocol's other numbers (precision, recall, f1, auc; rsquared, "
                "absolute_dev_explained)",
    "_judge": "string, who judged: tokens, hf:PATH or openai:URL, with its prompt versions",
    "_codes": "list<int64>, position codes of the held-out examples",
    "_baseline": "float64, the same examples judged with another neuron's explanation (seeded derangement in the layer)",
    "_baseline_low": "float64", "_baseline_high": "float64",
    "_baseline_from": "int32, the neuron whose explanation the baseline used (-1 if none)",
    "_diff_low": "float64, 95% interval of the score minus the baseline, paired on the same examples",
    "_diff_high": "float64, upper end",
    "_random_init": "float64, the score of this neuron side in a random-init copy of the model (same pipeline; "
                    "compare distributions, not rows)",
    "_random_init_low": "float64", "_random_init_high": "float64", "_random_init_p": "float64",
}
COLUMNS: dict[str, str] = {**BASE, **{f"{s}{suffix}": text for s in SCORER_NAMES for suffix, text in SCORE_FIELDS.items()}}


def _type(description: str):
    import pyarrow as pa

    head = description.split(",")[0].split(":")[0].strip()
    return {"int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(),
            "string": pa.string(), "list<int64>": pa.large_list(pa.int64())}[head]


def arrow_schema():
    import pyarrow as pa

    return pa.schema([(name, _type(text)) for name, text in COLUMNS.items()])


def _defaults() -> dict:
    out = {}
    for name, text in COLUMNS.items():
        head = text.split(",")[0].split(":")[0].strip()
        out[name] = {"float64": float("nan"), "string": "", "list<int64>": None}.get(head, -1)
    return out


def empty() -> pd.DataFrame:
    return arrow_schema().empty_table().to_pandas()


def complete(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every column of :data:`COLUMNS` (missing ones at their 'unscored' default), in order."""
    missing = {name: [value if value is not None else [] for _ in range(len(frame))]
               for name, value in _defaults().items() if name not in frame.columns}
    if missing:
        frame = pd.concat([frame.reset_index(drop=True), pd.DataFrame(missing)], axis=1).set_axis(frame.index)
    return frame[list(COLUMNS)].copy()


def read(atlas_path) -> pd.DataFrame:
    """The atlas's explanations (an empty frame with every column when there are none)."""
    from kvmem.atomic import read_replaced_parquet

    path = Path(atlas_path) / FILE
    try:
        table = read_replaced_parquet(path)
    except FileNotFoundError:
        return empty()
    except Exception as error:  # pyarrow raises several types for a damaged file
        raise KvmemError(f"{path} is corrupt ({error}); delete it and explain again") from None
    return complete(table.to_pandas())


def upsert(existing: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """Rows of ``existing`` whose key is not in ``new``, plus ``new``; sorted by key."""
    new = complete(new)
    if len(existing):
        keep = ~pd.MultiIndex.from_frame(existing[list(KEY)]).isin(pd.MultiIndex.from_frame(new[list(KEY)]))
        frames = [f for f in (complete(existing)[keep], new) if len(f)]
        new = pd.concat(frames, ignore_index=True) if frames else new
    return new.sort_values(list(KEY), kind="stable").reset_index(drop=True)


def write(atlas_path, frame: pd.DataFrame) -> Path:
    """Replace the atlas's explanations with ``frame`` (atomically) and record it in the manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    atlas_path = Path(atlas_path)
    frame = complete(frame)
    table = pa.Table.from_pandas(frame, schema=arrow_schema(), preserve_index=False)
    target = atlas_path / FILE
    handle, tmp = tempfile.mkstemp(prefix=f".{FILE}.", dir=atlas_path)
    os.close(handle)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _record_in_manifest(atlas_path, frame)
    return target


def _record_in_manifest(atlas_path: Path, frame: pd.DataFrame) -> None:
    """Add or refresh the manifest's ``explanations`` entry (the rest of the manifest is kept byte for byte
    in meaning; the file is replaced by rename)."""
    path = atlas_path / "manifest.json"
    data = json.loads(path.read_text())
    data["explanations"] = {
        "file": FILE, "schema_version": SCHEMA_VERSION, "rows": int(len(frame)),
        "explainers": sorted(set(frame.explainer)), "key": list(KEY),
        "columns": {name: text for name, text in COLUMNS.items()},
    }
    handle, tmp = tempfile.mkstemp(prefix=".manifest.", dir=atlas_path)
    with os.fdopen(handle, "w") as out:
        out.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class Storer:
    """Rows into the atlas's explanations as a command produces them: at most every ``every`` seconds, and at
    :meth:`store` (the command's end). Each store rewrites the whole file, so storing after every layer would
    cost a command quadratic time in its rows; a killed command keeps what was last stored, and a rerun
    finds those rows done. Rows handed over later replace earlier ones of the same key."""

    def __init__(self, path, every: float = 20.0):
        if isinstance(every, bool) or not isinstance(every, (int, float)) or not every >= 0:
            raise KvmemError(f"store_every must be a number of seconds >= 0, got {every!r}")
        self.path, self.every = Path(path), float(every)
        self.pending: list[pd.DataFrame] = []
        self.last = time.monotonic()

    def add(self, rows: pd.DataFrame) -> None:
        self.pending.append(rows)
        if time.monotonic() - self.last >= self.every:
            self.store()

    def store(self) -> None:
        if self.pending:
            rows = pd.concat(self.pending, ignore_index=True)
            rows = rows[~rows.duplicated(list(KEY), keep="last")]
            write(self.path, upsert(read(self.path), rows))
            self.pending = []
        self.last = time.monotonic()
