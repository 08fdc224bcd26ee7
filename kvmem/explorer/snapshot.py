"""The atlas as the explorer serves it: opened once with every table pinned, and a change on disk noticed.

A :class:`Snapshot` opens the atlas through :class:`kvmem.atlas.Atlas` and reads one row of each table,
which opens (and so pins) every parquet file: a scan with ``--overwrite`` that replaces the directory
leaves these open files as they were, so the server never reads half of one atlas and half of another.
It also records the directory's *identity* (every file's inode, size and modification time). Each
request checks the identity before and after it is answered (:meth:`Snapshot.check`); when it differs,
the request is refused with :class:`AtlasChanged`, saying what changed, until the atlas is reloaded.
Nothing here writes to the atlas.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvmem.atlas import Atlas
from kvmem.errors import KvmemError

__all__ = ["AtlasChanged", "NotFound", "Snapshot", "identity", "open_snapshot"]


class AtlasChanged(KvmemError):
    """The atlas directory changed on disk since the server opened it."""


class NotFound(KvmemError):
    """A layer, neuron or page that is not there (HTTP 404)."""


def identity(path: Path) -> tuple:
    """The directory's identity: its inode and, per entry, (name, inode, size, mtime); () if it is gone."""
    try:
        top = os.stat(path)
        entries = []
        with os.scandir(path) as listing:
            for entry in listing:
                if entry.name.startswith("."):
                    continue
                stat = entry.stat(follow_symlinks=False)
                entries.append((entry.name, stat.st_ino, stat.st_size, stat.st_mtime_ns))
    except OSError:
        return ()
    return (top.st_dev, top.st_ino, tuple(sorted(entries)))


def _difference(before: tuple, after: tuple) -> str:
    if not after:
        return "the directory is gone or unreadable (a scan may be replacing it)"
    if before[:2] != after[:2]:
        return "the directory was replaced (a new scan)"
    old, new = {e[0]: e[1:] for e in before[2]}, {e[0]: e[1:] for e in after[2]}
    parts = []
    for label, names in (("added", sorted(set(new) - set(old))), ("removed", sorted(set(old) - set(new))),
                         ("rewritten", sorted(n for n in set(old) & set(new) if old[n] != new[n]))):
        if names:
            parts.append(f"{label} {', '.join(names)}")
    return "; ".join(parts) or "its files changed"


@dataclass(frozen=True)
class LayerSummary:
    """Per-layer figures of the overview page (one entry per layer, in atlas order)."""

    layers: list[int]
    density: dict[str, list[float]]  # quantiles (q25, median, q75) of frac_positive per layer
    norms: dict[str, list[float]]  # median key / gate / value norm per layer
    classes: dict[str, list[int]]  # taxonomy flag -> neurons with it per layer
    scores: dict[str, list[float]]  # scorer -> mean score of the layer's scored explanations
    scored: dict[str, list[int]]  # scorer -> explanations scored per layer


class Snapshot:
    """One opened atlas: the :class:`Atlas`, its small tables (neurons, taxonomy, explanations) in memory,
    the per-layer summary, and the identity it was opened at."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).resolve()
        self.identity = identity(self.path)
        self.atlas = Atlas(self.path)
        self.opened_at = time.time()
        manifest_bytes = (self.path / "manifest.json").read_bytes()
        self.id = hashlib.sha256(manifest_bytes + repr(self.identity).encode()).hexdigest()[:16]
        self._pin()
        self.neurons = self.atlas.neurons  # one row per neuron, in (layer, neuron) order
        self._extras: dict | None = None
        self._extras_lock = threading.Lock()

    # ---- the tables read after start (their readers import torch: the server answers meanwhile) ----
    def warm(self) -> None:
        """Read what the first pages need: taxonomy, explanations, summary, the contexts of the triggers."""
        self._load_extras()
        self.atlas.triggers(self.layers[0], 0)

    def _load_extras(self) -> dict:
        with self._extras_lock:
            if self._extras is None:
                taxonomy, explanations = self._taxonomy(), self._explanations()
                self._extras = {"taxonomy": taxonomy, "explanations": explanations,
                                "rows": explanations.groupby(["layer", "neuron"]).indices if len(explanations) else {}}
                self._extras["summary"] = _summary(self.neurons, self.layers, taxonomy, explanations)
            return self._extras

    @property
    def taxonomy(self) -> pd.DataFrame | None:
        """The taxonomy table (None when the atlas has none)."""
        return self._load_extras()["taxonomy"]

    @property
    def explanations(self) -> pd.DataFrame:
        """The explanations table (empty when the atlas has none)."""
        return self._load_extras()["explanations"]

    def explanations_of(self, layer: int, neuron: int) -> pd.DataFrame:
        rows = self._load_extras()["rows"].get((layer, neuron))
        return self.explanations.iloc[rows if rows is not None else []].reset_index(drop=True)

    @property
    def summary(self) -> LayerSummary:
        return self._load_extras()["summary"]

    # ---- the atlas ----
    @property
    def manifest(self):
        return self.atlas.manifest

    @property
    def layers(self) -> list[int]:
        return self.atlas.layers

    @property
    def d_ff(self) -> int:
        return self.atlas.d_ff

    @property
    def n_neurons(self) -> int:
        return len(self.layers) * self.d_ff

    def flat(self, layer: int, neuron: int) -> int:
        """The row of (layer, neuron) in the neurons table (layer order times d_ff plus neuron)."""
        return self.layers.index(layer) * self.d_ff + neuron

    def has(self, table: str) -> bool:
        return self.atlas.holds(table)

    def check_neuron(self, layer: int, neuron: int | None = None) -> None:
        """:class:`NotFound` for a layer or neuron the atlas does not hold, with the atlas's own message."""
        try:
            self.atlas.check(layer, neuron)
        except KvmemError as error:
            raise NotFound(str(error)) from None

    def check(self) -> None:
        """Raise :class:`AtlasChanged` if the directory is no longer the one opened."""
        now = identity(self.path)
        if now != self.identity:
            raise AtlasChanged(f"the atlas at {self.path} changed on disk since this server opened it "
                               f"({_difference(self.identity, now)}); pages are not served from a mix of the old and "
                               f"new tables. Reload the atlas (the button on this page, POST /reload) or restart "
                               f"kvmem serve.")

    # ---- opening ----
    def _pin(self) -> None:
        """Open every table file by reading a little of it (the files stay open; see the module docstring)."""
        for table in ("neurons", "histograms", "values", "keys", "triggers", "contexts", "samples"):
            if self.has(table):
                next(iter(self.atlas.row_groups(table, [])), None)

    def _taxonomy(self) -> pd.DataFrame | None:
        from kvmem.taxonomy.table import FILE

        if not (self.path / FILE).exists():
            return None
        return self.atlas.taxonomy

    def _explanations(self) -> pd.DataFrame:
        from kvmem.autointerp.store import FILE, empty

        frame = self.atlas.explanations() if (self.path / FILE).exists() else empty()
        # the example codes (lists of positions) are most of the table's memory and no page shows them
        return frame.drop(columns=[c for c in frame.columns if c.endswith("_codes")])


TAXONOMY_FLAGS = ("prediction", "suppression", "entropy_candidate", "dead", "rare", "positional", "token_frequency")
SCORERS = ("detection", "fuzzing", "simulation")


def _summary(frame: pd.DataFrame, layers: list[int], taxonomy: pd.DataFrame | None,
             explanations: pd.DataFrame) -> LayerSummary:
    grouped = frame.groupby("layer", sort=True)
    density = {name: [float(v) for v in grouped["frac_positive"].quantile(q).reindex(layers)]
               for name, q in (("q25", 0.25), ("median", 0.5), ("q75", 0.75))}
    norms = {column: [float(v) for v in grouped[column].median().reindex(layers)]
             for column in ("key_norm", "gate_norm", "value_norm") if column in frame and frame[column].notna().any()}
    classes: dict[str, list[int]] = {}
    if taxonomy is not None:
        tax = taxonomy
        for flag in TAXONOMY_FLAGS:
            if flag in tax:
                counts = tax.groupby("layer")[flag].sum()
                classes[flag] = [int(counts.get(layer, 0)) for layer in layers]
    scores: dict[str, list[float]] = {}
    scored: dict[str, list[int]] = {}
    for scorer in SCORERS:
        if scorer in explanations and explanations[scorer].notna().any():
            part = explanations[np.isfinite(explanations[scorer].to_numpy(dtype=float))]
            by_layer = part.groupby("layer")[scorer]
            means, counts = by_layer.mean(), by_layer.size()
            scores[scorer] = [float(means.get(layer, np.nan)) for layer in layers]
            scored[scorer] = [int(counts.get(layer, 0)) for layer in layers]
    return LayerSummary(layers=list(layers), density=density, norms=norms, classes=classes, scores=scores,
                        scored=scored)


class Holder:
    """The snapshot being served, replaced whole by :meth:`reload` (requests keep the one they started with)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.snapshot = Snapshot(self.path)

    def reload(self) -> Snapshot:
        with self._lock:
            fresh = Snapshot(self.path)
            self.snapshot = fresh
            return fresh


def open_snapshot(path: str | os.PathLike) -> Holder:
    """A :class:`Holder` of the atlas at ``path`` (a one-line KvmemError if it is not a readable atlas)."""
    return Holder(path)
