"""An atlas's value and key projections when it holds no projection tables (a scan with
``projections="lazy"``, the default): a neuron's rows computed on demand from the scanned model, and the
whole tables written into the atlas (:func:`project_atlas`, ``kvmem project``).

The rows computed on demand are the rows the tables would hold (token ids, ranks, tie order, scores, to
the bit: :class:`kvmem.scanning.projection.NeuronProjector`), from the model the manifest names (loaded
with its fingerprint checked, :func:`kvmem.atlas_origin.load_scanned_model`) or one passed in (checked the
same way). A query that needs a whole table (``top_neurons(by="value")``, the taxonomy, the experiments) reads the
model's tables from the per-model projection cache, computed once with the scanned model
(:meth:`OnDemandProjections.cached_file`); where the model cannot load it says in one line how to write them.
Rows on demand are read from those tables when some command wrote them, and a whole layer's rows computed
on demand are kept in the same cache for the next command
(:func:`~kvmem.projection_cache.layer_rows`). The cache's keys of an atlas's entries are remembered, so rows
that are kept answer without loading the model (:mod:`kvmem.projection_cache`). torch is imported only when a
projection
is computed.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvmem.atlas_origin import check_model, load_scanned_model
from kvmem.devices import resolve_device
from kvmem.errors import KvmemError
from kvmem.projection_cache import complete_entry, describe, kept_layer_rows, layer_rows, remember_key, remembered_key

if TYPE_CHECKING:
    from kvmem.models import Model

__all__ = ["TABLES", "OnDemandProjections", "missing_table_message", "project_atlas"]

_RECENT = 4  # on-demand answers kept per atlas

TABLES = ("values", "keys")


def missing_table_message(path: Path, table: str, why: str = "") -> str:
    """The one line a reader of a whole projection table says when the atlas holds none."""
    return (f"atlas {path} holds no {table} table (its projections are computed per neuron on demand){why}; "
            f"write the tables with: kvmem project --atlas {path}  (or Atlas.project())")


class OnDemandProjections:
    """A neuron's rows of the ``values`` and ``keys`` tables, computed from the model (see the module docstring).
    ``model``: the scanned model (checked by fingerprint); None: loaded from the manifest on first use."""

    def __init__(self, atlas, model: Model | None = None):
        self.atlas = atlas
        self._model: Model | None = None
        self._projector = None
        self._files: dict | None = None
        self._entry: dict | None = None
        self._recent: OrderedDict[tuple, pa.Table] = OrderedDict()  # (table, layer, neurons) -> rows
        self._keys: dict[tuple, str | None] = {}  # layers -> the per-model cache's key
        self._passed = False  # a model from the caller: keyed by its own weights, never remembered
        if model is not None:
            self.use_model(model)

    def use_model(self, model: Model) -> None:
        """Compute with ``model`` (refused unless it has the scanned weights)."""
        check_model(self.atlas, model)
        if model is not self._model:
            self._model, self._projector, self._entry = model, None, None
            self._recent.clear()
            self._keys.clear()
        self._passed = True

    @property
    def model(self) -> Model:
        if self._model is None:
            try:
                self._model = load_scanned_model(self.atlas)
            except KvmemError as error:
                raise KvmemError(f"atlas {self.atlas.path} holds no projection tables, and computing projections needs "
                                 f"the scanned model, which cannot load here ({error}); pass it (kvmem.open(PATH, "
                                 f"model=...), --model) or write the tables where it loads: kvmem project --atlas "
                                 f"{self.atlas.path}") from None
        return self._model

    @property
    def loaded(self) -> bool:
        """Whether the scanned model is at hand (passed in, or loaded for an earlier projection)."""
        return self._model is not None

    def _key(self, layers: list[int]) -> str | None:
        """The per-model cache's key for ``layers`` (the atlas's, or one): remembered for the model the manifest names
        when no model is at hand (:mod:`kvmem.projection_cache`), else computed from the model, and remembered when
        that model was loaded from the manifest."""
        scope = tuple(layers)
        if scope not in self._keys:
            config = self.atlas.manifest.config
            description = None
            if not self._passed:
                # a model loaded from the manifest goes where load_scanned_model puts it
                device = str(self._model.device) if self._model is not None else resolve_device(None)
                description = describe(self.atlas.manifest.model, config, list(layers), device)
                if self._model is None and (key := remembered_key(description)) is not None:
                    self._keys[scope] = key
                    return key
            from kvmem.scanning.projection import projection_cache_key

            key = projection_cache_key(self.model, list(layers), config)
            if description is not None:
                remember_key(description, key)
            self._keys[scope] = key
        return self._keys[scope]

    def _cached_entry(self) -> dict | None:
        """The per-model cache's whole tables for this atlas, if some command wrote them (looked up once)."""
        if self._entry is None:
            self._entry = {"found": complete_entry(self._key(self.atlas.layers), len(self.atlas.layers))}
        return self._entry["found"]

    def cached_file(self, table: str) -> Path:
        """The parquet file of the whole ``table`` (values | keys) for this atlas's layers and settings, from the
        per-model projection cache, computed with the scanned model on first use."""
        if self._files is None:
            try:
                found = self._cached_entry()  # written by an earlier command: no model needed where its key is known
                if found is not None:
                    self._files = {name: Path(path) for name, path in found["files"].items()}
                    return self._files[table]
                model = self.model
            except KvmemError as error:
                raise KvmemError(missing_table_message(self.atlas.path, table, f"; the scanned model is needed to "
                                                       f"compute it and does not load here ({error})")) from None
            from kvmem.scanning.projection import cached_projection_files

            self._files = {name: Path(path) for name, path in
                           cached_projection_files(model, self.atlas.layers, self.atlas.manifest.config)["files"].items()}
            self._entry = None  # the tables are there now: rows on demand read them
        return self._files[table]

    def kept(self, table: str, layer: int, label: str) -> pa.Table | None:
        """A whole layer's rows of ``table`` for one ``label`` (convention or vector) if they are at hand without
        computing: answered before, in the per-model cache's whole tables, or kept there for the layer (by an
        explain, a score, an earlier analysis); else None."""
        neurons = tuple(range(self.atlas.d_ff))
        column = "convention" if table == "values" else "vector"
        for labels in ((label,), None):
            if (rows := self._recent.get((table, int(layer), neurons, labels))) is not None:
                return rows if labels else rows.filter(pc.equal(rows.column(column), label))
        if (cached := self._cached_entry()) is not None:
            rows = _read_rows(cached["files"][table], int(layer), neurons)
            return rows.filter(pc.equal(rows.column(column), label))
        for labels in ((label,), None):
            if (rows := kept_layer_rows(self._key([int(layer)]), table, labels)) is not None:
                return rows if labels else rows.filter(pc.equal(rows.column(column), label))
        return None

    def convention_rows(self, convention: str, columns: list[str], model: Model | None = None) -> pa.Table:
        """Every layer's ``values`` rows under ``convention`` (``columns``), a layer at a time (:meth:`rows`): read from
        the per-model cache's tables or a layer's kept rows, or computed for this one convention and kept; the keys
        and the other conventions are not computed."""
        return pa.concat_tables([self.rows("values", layer, range(self.atlas.d_ff), model, labels=(convention,))
                                 .select(columns) for layer in self.atlas.layers])

    def rows(self, table: str, layer: int, neurons, model: Model | None = None, *, labels=None) -> pa.Table:
        """The rows of ``table`` (values | keys) of ``neurons`` of ``layer``, in the table's order; ``labels``:
        only these conventions (values) or vectors (keys) are computed (None: all). The last few answers are
        kept (an analysis reads a layer's values more than once)."""
        if model is not None:
            self.use_model(model)
        key = (table, int(layer), tuple(sorted({int(n) for n in neurons})),
               None if labels is None else tuple(sorted(set(labels))))
        if key not in self._recent:
            cached = self._cached_entry()
            if cached is not None:  # the whole tables of this model and settings are in the per-model cache
                rows = _read_rows(cached["files"][table], key[1], key[2])
                if labels is not None:
                    label = rows.column("convention" if table == "values" else "vector")
                    rows = rows.filter(pc.is_in(label, pa.array(key[3], pa.string())))
                self._recent[key] = rows
            else:
                def compute():
                    from kvmem.scanning.projection import NeuronProjector

                    if self._projector is None:
                        self._projector = NeuronProjector(self.model, self.atlas.manifest.config)
                    return getattr(self._projector.tables(layer, key[2], only=table, labels=key[3]), table)

                if len(key[2]) == self.atlas.d_ff:  # a whole layer (explain, score): kept in the per-model cache
                    self._recent[key] = layer_rows(self._key([int(layer)]), table, key[3], compute)
                else:
                    self._recent[key] = compute()
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
        self._recent.move_to_end(key)
        return self._recent[key]


def _read_rows(path, layer: int, neurons: tuple) -> pa.Table:
    """The rows of ``neurons`` of ``layer`` in a whole projection table's file, in its order (the order of the rows
    computed on demand)."""
    rows = pq.read_table(path, filters=[("layer", "=", layer)])
    return rows.filter(pc.is_in(rows.column("neuron"), pa.array(neurons, rows.schema.field("neuron").type)))


def project_atlas(atlas, *, model: Model | None = None, progress: bool = False) -> dict[str, Any]:
    """Write the atlas's ``values`` and ``keys`` tables (from the per-model cache, or computed now), as a scan
    with ``projections="eager"`` writes them, and record it in the manifest. Each file and the manifest are
    replaced by one rename; an atlas that holds them already is left as it is. -> what was done."""
    from kvmem.scanning.progress import Phases
    from kvmem.scanning.projection import cached_projection_files
    from kvmem.scanning.writer import link_or_copy

    if all((atlas.path / f"{name}.parquet").exists() for name in TABLES):
        return {"written": False, "method": atlas.manifest.projection.get("method")}
    model = model if model is not None else atlas.projections.model
    check_model(atlas, model)
    phases = Phases(progress)
    with phases.phase("projections", total=len(atlas.layers)) as bar:
        found = cached_projection_files(model, atlas.layers, atlas.manifest.config, bar=bar)
    for name, source in found["files"].items():
        staged = atlas.path / f".{name}.parquet.{os.getpid()}.tmp"
        link_or_copy(Path(source), staged)
        os.replace(staged, atlas.path / f"{name}.parquet")
    manifest = atlas.manifest
    manifest.projection.update(method=found["method"], tables="written by kvmem project")
    staged = atlas.path / f".manifest.json.{os.getpid()}.tmp"
    manifest.write(staged)
    os.replace(staged, atlas.path / "manifest.json")
    return {"written": True, "method": found["method"], "cached": found["cached"], "seconds": phases.elapsed()}
