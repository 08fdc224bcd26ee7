"""What an experiment reads: the atlas and some of its columns and layers, the model and corpus paired with it
(the fingerprint checked), and each value's top tokens.

Shapes use kvmem's vocabulary: ``layer``, ``d_model``, ``d_ff``, ``vocab``, ``batch``, ``pos``.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from kvmem import loading
from kvmem.atlas_origin import FingerprintWarning, check_model, load_scanned_model, scanned_corpus
from kvmem.corpus import open_corpus
from kvmem.errors import KvmemError
from kvmem.models import Model
from kvmem.tracing import project

if TYPE_CHECKING:
    from kvmem.atlas import Atlas
    from kvmem.corpus import Corpus

__all__ = ["FingerprintWarning", "as_atlas", "atlas_layers", "check_fingerprint", "model_for_atlas", "read_columns",
           "resolve_corpus", "value_top_tokens"]


def as_atlas(atlas: Atlas | str | os.PathLike) -> Atlas:
    """An :class:`~kvmem.atlas.Atlas`, opening a directory path if given one."""
    from kvmem.atlas import Atlas

    return atlas if isinstance(atlas, Atlas) else Atlas(atlas)


def read_columns(atlas: Atlas, table: str, columns: list[str], filters: list | None = None) -> pd.DataFrame:
    """A few columns of an atlas table (through :meth:`Atlas.table`), rows kept where every filter holds.

    ``filters``: (column, op, value) triples, op one of ``=``, ``<``, ``<=``, ``>``, ``>=``, ``in``.
    """
    ops = {"=": np.equal, "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal}
    filters = list(filters or [])
    frame = atlas.table(table, sorted(set(columns) | {f[0] for f in filters}))
    keep = np.ones(len(frame), bool)
    for column, op, value in filters:
        data = frame[column].to_numpy()
        keep &= np.isin(data, list(value)) if op == "in" else ops[op](data, value)
    return frame.loc[keep, list(columns)].reset_index(drop=True)


def atlas_layers(atlas: Atlas, layers: Any = None) -> list[int]:
    """The requested layers (None: all the atlas holds), each checked against the atlas."""
    if layers is None:
        return atlas.layers
    chosen = sorted({int(layer) for layer in layers})
    missing = [layer for layer in chosen if layer not in atlas.layers]
    if missing or not chosen:
        raise KvmemError(f"layer(s) {missing or '(none)'} not in atlas {atlas.path}; it holds layers "
                         f"{atlas.layers[0]}..{atlas.layers[-1]}")
    return chosen


def check_fingerprint(atlas: Atlas, model: Model) -> bool:
    """True when ``model`` has the weights the atlas was scanned with; warns (FingerprintWarning) when not:
    the experiments' side of the one fingerprint policy (:func:`kvmem.atlas_origin.check_model`)."""
    return check_model(atlas, model, on_mismatch="warn", stacklevel=3)


def model_for_atlas(atlas: Atlas | str | os.PathLike, model: Model | str | os.PathLike | None = None, *,
                    device: Any = None) -> Model:
    """The model to pair with an atlas: ``model`` if given (a Model or a name / path to load), else the atlas's own
    (:func:`kvmem.atlas_origin.load_scanned_model`: name, dtype and hub revision from the manifest).

    The fingerprint is checked (:func:`check_fingerprint`) either way.
    """

    atlas = as_atlas(atlas)
    if model is None:
        return load_scanned_model(atlas, device=device, on_mismatch="warn")
    if not isinstance(model, Model):
        model = loading.load_model(model, device=device)
    check_fingerprint(atlas, model)
    return model


def resolve_corpus(atlas: Atlas | None, corpus: Any, unit: str) -> Corpus:
    """The text an experiment reads: the atlas's corpus (``corpus`` overrides where the manifest's cannot
    be reopened), else ``corpus`` opened with ``unit``."""

    if atlas is not None:
        return scanned_corpus(atlas, corpus)
    if corpus is None:
        raise KvmemError("pass a corpus (a built-in name, a path, a list of strings, ...) or an atlas to take it from")
    return open_corpus(corpus, unit=unit)


# atlas -> {(layer, convention): (top [d_ff], bottom [d_ff])}, its values' rank-0 tokens
_VALUE_TOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> {(layer, convention): (argmax [d_ff], argmin [d_ff])}: the vocabulary pass is the slow part
_TOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def value_top_tokens(model: Model | None, layer: int, convention: str, *, atlas: Atlas | None = None,
                     block: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Per neuron of ``layer``: the token its value promotes most and the one it suppresses most.

    Returns (top [d_ff], bottom [d_ff]) int64 token ids, argmax and argmin of the value's vocabulary
    scores under ``convention``. Read from the values table's rank-0 rows where they are at hand: the atlas's
    table, or the scanned model's rows kept in the per-model projection cache by an earlier command
    (:meth:`~kvmem.atlas_projections.OnDemandProjections.kept`). Otherwise computed from ``model`` (default: the
    atlas's scanned model) in blocks of ``block`` neurons: an argmax needs no ranked table.
    """
    if atlas is not None and layer in atlas.layers and convention in atlas.conventions:
        kept = _VALUE_TOPS.setdefault(atlas, {})
        if (layer, convention) not in kept:
            rows = None
            if atlas.holds("values"):
                rows = atlas.projection_rows("values", layer, range(atlas.d_ff), labels=[convention])
            elif model is None or model.fingerprint == atlas.manifest.model["fingerprint"]:
                if model is not None:
                    atlas.projections.use_model(model)
                rows = atlas.projections.kept("values", layer, convention)
            if rows is not None:
                rows = rows.filter(pc.equal(rows.column("rank"), 0))
                out = []
                for kind in ("promote", "suppress"):
                    part = rows.filter(pc.equal(rows.column("kind"), kind))
                    ids = np.full(atlas.d_ff, -1, np.int64)
                    ids[part.column("neuron").to_numpy()] = part.column("token_id").to_numpy()
                    out.append(ids)
                kept[(layer, convention)] = (out[0], out[1])
            elif model is None:
                model = atlas.projections.model  # the scanned model (fingerprint checked), or a one-line error
        if (layer, convention) in kept:
            return kept[(layer, convention)]
    if model is None:
        raise KvmemError(f"layer {layer} / convention {convention!r} is not in the atlas; pass the model to compute it")
    cache = _TOPS.setdefault(model, {})
    if (layer, convention) not in cache:
        import torch

        values = model.written_values(layer)  # [d_ff, d_model] what each neuron writes into the residual
        tops, bottoms = [], []
        with torch.inference_mode():
            for start in range(0, values.shape[0], block):
                scores = project(model, values[start:start + block], convention=convention)  # [block, vocab]
                tops.append(scores.argmax(dim=1))
                bottoms.append(scores.argmin(dim=1))
        cache[(layer, convention)] = (torch.cat(tops).cpu().numpy(), torch.cat(bottoms).cpu().numpy())
    return cache[(layer, convention)]
