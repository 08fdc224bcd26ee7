"""Merge shard atlases into exactly what one scan of the whole corpus gives.

Top-k lists merge by re-ranking their union; sums, counts and histograms add. Shards see
disjoint documents (``--shard i/N`` keeps documents with index % N == i), with global indices.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from kvmem.atlas import open_atlas
from kvmem.errors import KvmemError

__all__ = ["merge"]

_SAME = ("format_version", "model", "layers", "tokenization", "projection")


def merge(atlases: list, *, out, overwrite: bool = False):
    """Merge shard atlases (paths or Atlas objects) into ``out``; returns the merged Atlas."""
    from kvmem.scanning.writer import write_tables

    if len(atlases) < 2:
        raise KvmemError("merge needs at least two atlases")
    opened = [a if hasattr(a, "manifest") else open_atlas(a) for a in atlases]
    target = Path(out)
    if target.exists() and not overwrite:
        raise KvmemError(f"output directory {target} already exists; pass --overwrite or another --out")
    first = opened[0].manifest
    for atlas in opened[1:]:
        for key in _SAME:
            if atlas.manifest[key] != first[key]:
                raise KvmemError(f"cannot merge {atlas.path} with {opened[0].path}: their {key!r} differ")
        scan_a = {k: v for k, v in atlas.manifest["scan"].items() if k not in ("shard", "checkpoint_every")}
        scan_b = {k: v for k, v in first["scan"].items() if k not in ("shard", "checkpoint_every")}
        if scan_a != scan_b:
            differ = sorted(k for k in scan_a if scan_a[k] != scan_b.get(k))
            raise KvmemError(f"cannot merge {atlas.path}: scan settings differ ({', '.join(differ)})")
        if atlas.manifest["corpus"]["spec"] != first["corpus"]["spec"]:
            raise KvmemError(f"cannot merge {atlas.path}: it scanned another corpus")
    shards = [s for a in opened for s in a.manifest["shards"]]
    seen = {(s["index"], s["count"]) for s in shards}
    if len(seen) != len(shards):
        raise KvmemError("the same shard appears twice; merge each shard once")
    k = first["scan"]["top_k"]

    neurons = pd.concat([a.table("neurons") for a in opened])
    merged = neurons.groupby(["layer", "neuron"], sort=True).agg(
        count=("count", "sum"), min=("min", "min"), max=("max", "max"), act_sum=("act_sum", "sum"),
        act_sq_sum=("act_sq_sum", "sum"), key_norm=("key_norm", "first"), gate_norm=("gate_norm", "first"),
        value_norm=("value_norm", "first")).reset_index()
    positives = neurons.assign(p=neurons.frac_positive * neurons["count"]).groupby(["layer", "neuron"], sort=True).p.sum()
    merged["mean"] = merged.act_sum / merged["count"]
    merged["std"] = np.sqrt(np.maximum(merged.act_sq_sum / merged["count"] - merged["mean"] ** 2, 0.0))
    merged["frac_positive"] = np.rint(positives.to_numpy()) / merged["count"]
    neurons_out = merged[list(opened[0].table("neurons").columns)]

    hist = pd.concat([a.table("histograms") for a in opened])
    counts = np.stack(hist.counts.to_numpy())
    keys = hist.layer.to_numpy().astype(np.int64) * (1 << 32) + hist.neuron.to_numpy()
    uniq, inverse = np.unique(keys, return_inverse=True)
    summed = np.zeros((len(uniq), counts.shape[1]), np.int64)
    np.add.at(summed, inverse, counts)
    histograms = pa.table({"layer": (uniq >> 32).astype(np.int16), "neuron": (uniq & 0xFFFFFFFF).astype(np.int32),
                           "counts": pa.FixedSizeListArray.from_arrays(pa.array(summed.reshape(-1)), counts.shape[1])})

    triggers = pd.concat([a.table("triggers") for a in opened], ignore_index=True)
    triggers["_desc"] = np.where(triggers.kind.str.startswith("top"), -triggers.activation, triggers.activation)
    triggers = triggers.sort_values(["layer", "neuron", "kind", "_desc", "doc", "pos"], kind="stable")
    triggers = triggers.groupby(["layer", "neuron", "kind"], sort=False).head(k).copy()
    triggers["rank"] = triggers.groupby(["layer", "neuron", "kind"], sort=False).cumcount().astype(np.int16)
    kind_order = {"top": 0, "bottom": 1, "top_doc": 2, "bottom_doc": 3}
    triggers["_kind"] = triggers.kind.map(kind_order)
    triggers = triggers.sort_values(["layer", "neuron", "_kind", "rank"], kind="stable").drop(columns=["_desc", "_kind"])
    schema = opened[0]._file("triggers").schema_arrow
    triggers_out = pa.Table.from_pandas(triggers, schema=schema, preserve_index=False)

    tables = {"neurons": pa.Table.from_pandas(neurons_out, schema=opened[0]._file("neurons").schema_arrow,
                                              preserve_index=False),
              "triggers": triggers_out,
              "values": opened[0]._file("values").read(), "keys": opened[0]._file("keys").read(),
              "histograms": histograms}
    manifest = dict(first)
    manifest["shards"] = sorted(shards, key=lambda s: s["index"])
    manifest["tokens"] = sum(a.manifest["tokens"] for a in opened)
    manifest["windows"] = sum(a.manifest["windows"] for a in opened)
    manifest["corpus"] = {**first["corpus"], "documents": sum(a.manifest["corpus"]["documents"] for a in opened),
                          "sha256_chain": None}
    manifest["scan"] = {**first["scan"], "shard": [0, 1]}
    manifest["merged_from"] = [os.fspath(a.path) for a in opened]
    manifest["timing"] = {"scan_seconds": sum(a.manifest["timing"]["scan_seconds"] for a in opened),
                          "tokens_per_second": None}
    write_tables(target, tables, manifest, overwrite=overwrite)
    return open_atlas(target)
