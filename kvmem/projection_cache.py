"""The per-model projection cache on disk, and the keys of an atlas's entries remembered without its model.

Layout under ``$KVMEM_CACHE/projections/`` (what :mod:`kvmem.scanning.projection` writes):

- ``KEY/values.parquet``, ``KEY/keys.parquet`` and ``KEY/projection.json``: a model's whole tables for an
  atlas's layers and settings (an eager scan, ``kvmem project``, a query over every neuron's projection);
- ``layers/KEY-TABLE-LABELS/TABLE.parquet``: one layer's rows of one table, of some conventions (values) or
  vectors (keys), or ``all``, kept by the command that computed them (``explain``, ``score``, a value query);
- ``remembered/DESCRIPTION``: the KEY of an atlas's entry, named by what the atlas says of its model.

A KEY is computed from the model itself (:func:`kvmem.scanning.projection.projection_cache_key`: its weights'
fingerprint, its vocabulary, a digest of the vectors it projects, the device type and the settings), which
means loading the model: seconds that a command whose rows are all kept needs for nothing else. So each key
computed for an atlas with the model its manifest names is remembered under a description of that model (the
manifest's fingerprint, name, dtype and revision, the device type, the layers and settings, and the versions
of kvmem, torch and transformers, which decide how weights are read), and a later command reads its rows with
no model. A model the caller passes in is always keyed by its own weights, and never remembered (it may have
been edited in memory). This module imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvmem import __version__
from kvmem.atomic import staged_directory
from kvmem.builtin import cache_dir

__all__ = ["TABLES", "RECORD", "entry_dir", "complete_entry", "layer_rows", "kept_layer_rows", "describe",
           "remembered_key", "remember_key"]

TABLES = ("values", "keys")
RECORD = "projection.json"  # beside an entry's tables: the method that computed them, and its counts


def _root() -> Path:
    return cache_dir() / "projections"


def entry_dir(key: str) -> Path:
    """Where the whole tables of entry ``key`` live."""
    return _root() / key


def complete_entry(key: str | None, layers: int, bar=None) -> dict | None:
    """{'files': {'values': path, 'keys': path}, 'cached': True, 'method': str} when entry ``key`` holds both tables
    (``bar`` advanced by ``layers``), else None."""
    if key is None:
        return None
    directory = entry_dir(key)
    if not all((directory / f"{name}.parquet").exists() for name in TABLES):
        return None
    if bar is not None:
        bar.update(layers)
    try:
        recorded = json.loads((directory / RECORD).read_text())["method"]
    except (OSError, ValueError, KeyError):
        recorded = "unknown"
    return {"files": {name: directory / f"{name}.parquet" for name in TABLES}, "cached": True, "method": recorded}


def _layer_dir(key: str, table: str, labels: tuple | None) -> Path:
    return _root() / "layers" / f"{key}-{table}-{'+'.join(labels) if labels else 'all'}"


def kept_layer_rows(key: str | None, table: str, labels: tuple | None) -> pa.Table | None:
    """A whole layer's rows of ``table`` (of ``labels``; None: all) under layer key ``key``, if some command kept
    them (:func:`layer_rows`), else None: nothing is computed. A damaged file counts as absent."""
    if key is None:
        return None
    path = _layer_dir(key, table, labels) / f"{table}.parquet"
    try:
        return pq.read_table(path) if path.exists() else None
    except (OSError, pa.ArrowException):
        return None


def layer_rows(key: str | None, table: str, labels: tuple | None, compute) -> pa.Table:
    """A whole layer's rows of ``table`` (of ``labels``; None: all) kept under layer key ``key``, or ``compute()``d
    and kept now (so the next command that reads the layer, an explain then a score, does not compute it again).
    Each is a directory renamed into place whole; an unreadable one is computed again; a read-only or full
    cache keeps nothing and still returns the rows."""
    if (rows := kept_layer_rows(key, table, labels)) is not None:
        return rows
    rows = compute()
    if key is not None:
        from kvmem.scanning.parquet import write_parquet  # kvmem.scanning imports torch, as compute() did

        try:
            with staged_directory(_layer_dir(key, table, labels)) as tmp:
                write_parquet(tmp / f"{table}.parquet", rows)
        except OSError:
            pass
    return rows


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe(model: dict, config, layers: list[int], device: str) -> str:
    """The name an atlas's key is remembered under: sha256 of the manifest's ``model`` fields that fix the weights
    (fingerprint, name, dtype, revision), the device type, ``layers``, the projection settings of ``config`` and
    the versions of kvmem, torch and transformers."""
    text = json.dumps({"fingerprint": model.get("fingerprint"), "name": model.get("name"), "dtype": model.get("dtype"),
                       "revision": model.get("revision"), "device": str(device).split(":")[0],
                       "layers": [int(layer) for layer in layers], "conventions": list(config.conventions),
                       "top_n": config.top_n, "keys": config.key_projections, "kvmem": __version__,
                       "torch": _version("torch"), "transformers": _version("transformers")}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def remembered_key(description: str) -> str | None:
    """The key remembered under ``description`` (:func:`describe`), or None."""
    try:
        key = (_root() / "remembered" / description).read_text().strip()
    except OSError:
        return None
    return key if len(key) == 32 and all(c in "0123456789abcdef" for c in key) else None


def remember_key(description: str, key: str | None) -> None:
    """Remember ``key`` under ``description``: written whole (a temporary file renamed into place), or not at all
    where the cache cannot be written."""
    if key is None:
        return
    folder = _root() / "remembered"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=f".{description}-", dir=folder)
        with os.fdopen(handle, "w") as out:
            out.write(key)
        os.replace(tmp, folder / description)
    except OSError:
        pass
