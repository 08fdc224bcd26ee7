"""Open an atlas directory and query it: neurons, triggers, projections, search.

Selections by (layer, neuron) read one parquet row group (tables are sorted and grouped by
layer and neuron block, see :mod:`kvmem.schema`), so they stay fast on large atlases. An atlas
scanned with lazy projections (the default) holds no ``values`` / ``keys`` tables: a neuron's rows
are computed on demand from the scanned model (:mod:`kvmem.atlas_projections`), and
:meth:`Atlas.project` writes the whole tables.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvmem.atlas_projections import TABLES as PROJECTION_TABLES
from kvmem.atlas_projections import OnDemandProjections, project_atlas
from kvmem.atlas_tables import AtlasTables, position_codes
from kvmem.conventions import DEFAULT_CONVENTION
from kvmem.errors import KvmemError
from kvmem.manifest import Manifest
from kvmem.neuron_record import NeuronRecord
from kvmem.schema import SAMPLE_KINDS, SAMPLE_VIEW, TABLES, TRIGGER_KINDS, TRIGGER_VIEW, arrow_schema

__all__ = ["open_atlas", "Atlas", "NeuronRecord"]


def open_atlas(path, *, model=None) -> Atlas:
    """Open an atlas written by :func:`kvmem.scan` (``kvmem.open(DIR)``); ``model``: the scanned model, for
    projections computed on demand (else loaded from the manifest when first needed)."""
    return Atlas(path, model=model)


class Atlas:
    """A memory atlas on disk. ``atlas.neurons`` is a DataFrame; other tables are read on demand. ``model``: the
    scanned model (checked by fingerprint), for projections computed on demand."""

    def __init__(self, path, *, model=None):
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not self.path.is_dir():
            raise KvmemError(f"atlas {self.path} does not exist (or is not a directory); scan one with kvmem scan")
        if not manifest.exists():
            raise KvmemError(f"{manifest} is missing: {self.path} is not a complete atlas; scan again")
        self.manifest: Manifest = Manifest.read(manifest)
        self._tables = AtlasTables(self.path, self.table_path)
        self._cache = self._tables.cache
        self.projections = OnDemandProjections(self, model)

    # ---- provenance ----
    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    @property
    def d_ff(self) -> int:
        return int(self.manifest.model["d_ff"])

    @property
    def conventions(self) -> list[str]:
        return list(self.manifest.scan["conventions"])

    @property
    def default_convention(self) -> str:
        """The default the atlas records (format 2); for older atlases :data:`kvmem.conventions.DEFAULT_CONVENTION`
        if the atlas holds it, else its first convention."""
        recorded = self.manifest.projection.get("default_convention")
        if recorded is not None:
            return recorded
        return DEFAULT_CONVENTION if DEFAULT_CONVENTION in self.conventions else self.conventions[0]

    def provenance(self, convention: str | None = None) -> dict:
        m = self.manifest
        return {"model": m.model["name"], "fingerprint": m.model["fingerprint"], "corpus": m.corpus["spec"],
                "tokens": m.tokens, "convention": convention or self.default_convention,
                "kvmem_version": m.kvmem_version, "atlas": str(self.path)}

    def __repr__(self) -> str:
        m = self.manifest
        return (f"Atlas({str(self.path)!r}: {m.model['name']}, layers {self.layers[0]}..{self.layers[-1]} "
                f"× {self.d_ff} neurons, corpus {m.corpus['spec']!r}, {m.tokens:,} tokens, top_k {m.scan['top_k']})")

    # ---- file access (kvmem.atlas_tables) ----
    def _read_arrow(self, table: str, layer: int, neuron: int | None = None) -> pa.Table:
        """Rows of one layer (and neuron) of ``table``, both checked against the atlas."""
        self.check(layer, neuron)
        return self._tables.rows(table, layer, neuron)

    def _known(self, table: str) -> None:
        """A table of the format (:data:`kvmem.schema.TABLES`), or one a statistic wrote into this atlas."""
        if table not in TABLES and not (self.path / f"{table}.parquet").exists():
            raise KvmemError(f"unknown table {table!r}; tables are {', '.join(TABLES)} (and those of the optional "
                             f"statistics a scan kept)")

    def row_groups(self, table: str, columns: list[str]):
        """The stored ``columns`` of ``table``, one parquet row group at a time (pa.Table each): a whole
        table streamed without ever being in memory at once (triggers and samples carry no text here)."""
        self._known(table)
        return self._tables.row_groups(table, columns)

    def check(self, layer: int, neuron: int | None = None) -> None:
        if layer not in self.layers:
            raise KvmemError(f"layer {layer} is not in this atlas; it holds layers {_ranges(self.layers)}")
        if neuron is not None and not 0 <= neuron < self.d_ff:
            raise KvmemError(f"neuron {neuron} is out of range; layer {layer} has neurons 0..{self.d_ff - 1}")

    # ---- queries ----
    @cached_property
    def neurons(self) -> pd.DataFrame:
        """One row per (layer, neuron): statistics and vector norms (see kvmem.schema.COLUMNS)."""
        return self._tables.table("neurons")

    @cached_property
    def taxonomy(self) -> pd.DataFrame:
        """One row per (layer, neuron): the neuron taxonomy (kvmem.taxonomy.table.COLUMNS), if written."""
        from kvmem.taxonomy.table import FILE, read_taxonomy

        if not (self.path / FILE).exists():
            raise KvmemError(f"{self.path} has no taxonomy table; run: kvmem taxonomy --atlas {self.path}")
        return read_taxonomy(self.path / FILE)

    def triggers(self, layer: int, neuron: int, *, kind: str | None = None) -> pd.DataFrame:
        """Kept triggers of one neuron, ranked; kind in top | bottom | top_doc | bottom_doc (None: all)."""
        if kind is not None and kind not in TRIGGER_KINDS:
            raise KvmemError(f"unknown trigger kind {kind!r}; choose one of {', '.join(TRIGGER_KINDS)}")
        rows = self._read_arrow("triggers", layer, neuron)
        if kind is not None:
            rows = rows.filter(pc.equal(rows.column("kind"), kind))
        return self._tables.with_text(rows, "triggers").to_pandas()

    def table_path(self, table: str) -> Path:
        """Where ``table``'s parquet file is: the atlas's own file, or, for a projection table (values, keys)
        that the atlas does not hold, the scanned model's tables in the per-model projection cache
        (``$KVMEM_CACHE/projections/``), computed once per model and equal to the tables an eager scan
        writes. Their first use loads the scanned model (the manifest's, fingerprint checked, or the one
        passed to :func:`kvmem.open`); ``kvmem project`` keeps them in the atlas."""
        path = self.path / f"{table}.parquet"
        if path.exists() or table not in PROJECTION_TABLES:
            return path
        return self.projections.cached_file(table)

    def holds(self, table: str) -> bool:
        """Whether the atlas directory holds ``table``'s file (a lazily scanned atlas holds no values or keys)."""
        return (self.path / f"{table}.parquet").exists()

    @property
    def has_projections(self) -> bool:
        """Whether the atlas holds the values and keys tables (else a neuron's are computed on demand)."""
        return all((self.path / f"{name}.parquet").exists() for name in PROJECTION_TABLES)

    def projection_rows(self, table: str, layer: int, neurons, *, model=None, labels=None) -> pa.Table:
        """The rows of ``table`` (values | keys) of ``neurons`` of ``layer``: read from the table, or computed
        from the model where the atlas holds none (``model``: the scanned model; default: loaded from the
        manifest, fingerprint checked). ``labels``: only the rows of these conventions (values) or vectors
        (keys); None: all."""
        if table not in PROJECTION_TABLES:
            raise KvmemError(f"unknown projection table {table!r}; choose one of {', '.join(PROJECTION_TABLES)}")
        neurons = sorted({int(n) for n in neurons})
        for neuron in neurons:
            self.check(layer, neuron)
        if (self.path / f"{table}.parquet").exists():
            rows = self._read_arrow(table, layer, neurons[0] if len(neurons) == 1 else None)
            rows = rows.filter(pc.is_in(rows.column("neuron"), pa.array(neurons, rows.schema.field("neuron").type)))
        else:
            rows = self.projections.rows(table, layer, neurons, model, labels=labels)
        if labels is not None:
            label = "convention" if table == "values" else "vector"
            rows = rows.filter(pc.is_in(rows.column(label), pa.array(list(labels), pa.string())))
        return rows

    def project(self, *, model=None, progress: bool = False) -> dict:
        """Write the values and keys tables into the atlas (as ``kvmem project`` does; nothing when it holds
        them). ``model``: the scanned model (default: loaded from the manifest)."""
        done = project_atlas(self, model=model, progress=progress)
        self._tables.clear()
        self.manifest = Manifest.read(self.path / "manifest.json")
        return done

    def values(self, layer: int, neuron: int, *, convention: str | None = None, kind: str | None = None,
               model=None) -> pd.DataFrame:
        """Tokens the value vector promotes / suppresses, under each stored convention (computed from the model
        when the atlas holds no values table: ``model``, or the scanned model loaded from the manifest)."""
        self.check(layer, neuron)
        frame = self.projection_rows("values", layer, [neuron], model=model).to_pandas()
        if convention is not None:
            if convention not in self.conventions:
                raise KvmemError(f"convention {convention!r} is not in this atlas; it has {', '.join(self.conventions)}")
            frame = frame[frame.convention == convention]
        if kind is not None:
            frame = frame[frame.kind == kind]
        return frame.reset_index(drop=True)

    def value_rows(self, convention: str | None = None, *, kind: str | None = None, model=None) -> pd.DataFrame:
        """Every neuron's values rows under one convention (default: the atlas's), optionally of one ``kind``: the
        values table's, or, where the atlas holds none, each layer's computed for this convention alone and kept in
        the per-model cache (``model``: see :meth:`values`)."""
        convention = convention or self.default_convention
        if convention not in self.conventions:
            raise KvmemError(f"convention {convention!r} is not in this atlas; it has {', '.join(self.conventions)}")
        columns = ["layer", "neuron", "convention", "kind", "rank", "token_id", "token", "score"]
        if self.holds("values"):
            frame = self._tables.table("values", columns)
            frame = frame[frame.convention.to_numpy() == convention]
        else:
            frame = self.projections.convention_rows(convention, columns, model).to_pandas()
        if kind is not None:
            frame = frame[frame.kind.to_numpy() == kind]
        return frame.reset_index(drop=True)

    def keys(self, layer: int, neuron: int, *, vector: str | None = None, model=None) -> pd.DataFrame:
        """Tokens whose input embedding best matches the key (and gate key) vectors (on demand as :meth:`values`)."""
        self.check(layer, neuron)
        frame = self.projection_rows("keys", layer, [neuron], model=model).to_pandas()
        return frame if vector is None else frame[frame.vector == vector].reset_index(drop=True)

    def samples(self, layer: int, neuron: int, *, kind: str | None = None) -> pd.DataFrame:
        """Sampled coefficients of one neuron with their text: kind ``random`` (a uniform sample of
        positions) or ``bin`` (a sample of each histogram bin, see :meth:`quantile_samples`); None: both."""
        if kind is not None and kind not in SAMPLE_KINDS:
            raise KvmemError(f"unknown sample kind {kind!r}; choose one of {', '.join(SAMPLE_KINDS)}")
        if not (self.path / "samples.parquet").exists():
            raise KvmemError(f"{self.path} holds no samples (scanned with random_samples=0 and bin_samples=0, "
                             f"or by an older kvmem); rescan to get them")
        rows = self._read_arrow("samples", layer, neuron)
        if kind is not None:
            rows = rows.filter(pc.equal(rows.column("kind"), kind))
        return self._tables.with_text(rows, "samples").to_pandas()

    def quantile_samples(self, layer: int, neuron: int, *, bands: int = 5, per_band: int = 5,
                         levels=None) -> list[pd.DataFrame]:
        """Uniform samples of each of ``bands`` quantile bands of the neuron's coefficients.

        Bands are whole histogram bins, cut where the cumulative count crosses i/bands (so each
        holds about 1/bands of the positions, as exactly as the bins allow); each band's sample is
        the ``per_band`` positions with the smallest sampling keys among its bins' samples, which
        is a uniform sample of the band. Each frame has a ``band`` column and the band's bounds.
        ``levels``: increasing quantile levels from 0 to 1 (e.g. ``(0, 0.5, 0.9, 0.99, 0.999, 1)``)
        instead of equal bands; a bin joins the band in which the count before it falls.
        """
        counts = self.histogram(layer, neuron)
        cumulative = counts["count"].cumsum().to_numpy() / max(int(counts["count"].sum()), 1)
        before = np.concatenate([[0.0], cumulative[:-1]])
        if levels is not None:
            levels = [float(level) for level in levels]
            if len(levels) < 2 or levels[0] != 0 or levels[-1] != 1 or sorted(set(levels)) != levels:
                raise KvmemError(f"quantile levels must increase from 0 to 1 (e.g. 0, 0.5, 0.9, 1), got {levels}")
            bands = len(levels) - 1
            band_of_bin = np.searchsorted(np.asarray(levels[1:-1]), before, side="right")
        else:
            band_of_bin = np.minimum((before * bands).astype(int), bands - 1)
        samples = self.samples(layer, neuron, kind="bin")
        samples = samples.assign(band=band_of_bin[samples["bin"].to_numpy()])
        out = []
        for band in range(bands):
            bins = counts.index[band_of_bin == band]
            part = samples[samples.band == band].sort_values("rank", kind="stable").head(per_band)
            low = float(counts.low.iloc[bins.min()]) if len(bins) else float("nan")
            high = float(counts.high.iloc[bins.max()]) if len(bins) else float("nan")
            out.append(part.assign(band_low=low, band_high=high).reset_index(drop=True))
        return out

    def histogram(self, layer: int, neuron: int) -> pd.DataFrame:
        """Coefficient histogram over the fixed bins: columns bin, low, high, count."""
        frame = self._read_arrow("histograms", layer, neuron).to_pandas()
        edges = [float(e) for e in self.manifest.histogram["edges"]]
        counts = np.asarray(frame.counts.iloc[0]) if len(frame) else np.zeros(len(edges) - 1, np.int64)
        return pd.DataFrame({"bin": np.arange(len(counts)), "low": edges[:-1], "high": edges[1:], "count": counts})

    def neuron(self, layer: int, neuron: int, *, convention: str | None = None, model=None,
               projections: bool = True) -> NeuronRecord:
        """One neuron with everything about it (readable repr, HTML in notebooks). ``model``: see :meth:`values`;
        ``projections=False``: empty values and keys where the atlas holds no tables (nothing computed)."""
        self.check(layer, neuron)
        index = self.layers.index(layer) * self.d_ff + neuron
        stats = self.neurons.iloc[index].to_dict()
        stats["count"] = int(stats["count"])
        if projections or self.has_projections:
            values, keys = self.values(layer, neuron, model=model), self.keys(layer, neuron, model=model)
        else:
            values, keys = (arrow_schema(name).empty_table().to_pandas() for name in PROJECTION_TABLES)
        return NeuronRecord(layer, neuron, stats, self.triggers(layer, neuron), values, keys,
                            self.histogram(layer, neuron), self.provenance(convention))

    def top_neurons(self, *, token: str | int, by: str = "value", k: int = 10, convention: str | None = None,
                    tokenizer=None) -> pd.DataFrame:
        """Memories tied to one token.

        by="value": values that list the token among their promoted tokens, by score;
        by="trigger": keys whose top triggers are followed by the token (they fire right before it),
        by how many of their triggers it follows, then the highest activation.
        ``token``: a token id, or a string that must be exactly one token (kept token strings are matched).
        """
        if by == "value":
            convention = convention or self.default_convention
            if convention not in self.conventions:
                raise KvmemError(f"convention {convention!r} is not in this atlas; it has {', '.join(self.conventions)}")
        # a trigger's next token is in the contexts: a token they do not hold needs no projection to be refused
        token_id = self.token_id(token, tokenizer=tokenizer, convention=convention if by == "value" else None)
        if by == "value":
            hits = self._rows_for_token("values", token_id, convention=convention)
            out = hits.sort_values(["score", "layer", "neuron"], ascending=[False, True, True]).head(k)
            return out.assign(convention=convention)[["layer", "neuron", "rank", "score", "convention"]].reset_index(drop=True)
        if by == "trigger":
            hits = self._rows_for_token("triggers", token_id)
            grouped = hits.groupby(["layer", "neuron"], as_index=False).agg(
                triggers=("activation", "size"), max_activation=("activation", "max"))
            out = grouped.sort_values(["triggers", "max_activation"], ascending=False).head(k)
            return out.reset_index(drop=True)
        raise KvmemError(f"unknown ranking by={by!r}; choose 'value' or 'trigger'")

    def _rows_for_token(self, table: str, token_id: int, convention: str | None = None) -> pd.DataFrame:
        """Rows of promoted value tokens (one convention) or top triggers' next tokens equal to token_id.

        Built once per table: the relevant rows sorted by token id, then each query is a binary search.
        """
        key = f"_index:{table}:{convention}"
        if key not in self._cache:
            if table == "values":
                frame = self.value_rows(convention, kind="promote")
                frame, token = frame[["layer", "neuron", "rank", "score"]], frame.token_id.to_numpy()
            else:
                frame = self._tables.table("triggers", ["layer", "neuron", "kind", "activation", "next_token_id"])
                frame = frame[["layer", "neuron", "kind", "activation", "next_token_id"]]
                keep = frame.kind.to_numpy() == "top"
                frame, token = frame[keep][["layer", "neuron", "activation"]], frame.next_token_id.to_numpy()[keep]
            order = np.argsort(token, kind="stable")
            self._cache[key] = (token[order], frame.iloc[order].reset_index(drop=True))
        tokens, frame = self._cache[key]
        lo, hi = np.searchsorted(tokens, token_id), np.searchsorted(tokens, token_id, side="right")
        return frame.iloc[lo:hi]

    def token_id(self, token: str | int, *, tokenizer=None, convention: str | None = "default") -> int:
        """The id of a one-token string, from the atlas's own token strings (or a tokenizer): its contexts' tokens,
        then the tokens its values list under ``convention`` (default: the atlas's; None: the contexts' alone)."""
        if isinstance(token, (int, np.integer)):
            return int(token)
        if tokenizer is not None:
            ids = tokenizer(token, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                pieces = [tokenizer.decode([i]) for i in ids]
                raise KvmemError(f"{token!r} is not one token: it tokenizes as {pieces}; query one of those")
            return ids[0]
        if token in (seen := self._vocabulary()):
            return seen[token]
        if convention is not None and token in (listed := self._value_vocabulary(convention)):
            return listed[token]
        raise KvmemError(f"{token!r} is not a token seen in this atlas; check the leading space (e.g. ' Paris'), "
                         f"or pass a tokenizer (kvmem top --model M) to see how it tokenizes")

    def _vocabulary(self) -> dict[str, int]:
        """The tokens the atlas's contexts hold (every trigger's token and next token among them)."""
        if "_vocab" not in self._cache:
            seen = self._tables.contexts()[1].select(["token_id", "token"]).to_pandas().drop_duplicates("token")
            self._cache["_vocab"] = dict(zip(seen.token, seen.token_id.astype(int)))
        return self._cache["_vocab"]

    def _value_vocabulary(self, convention: str) -> dict[str, int]:
        """The tokens the values list under ``convention`` ("default": the atlas's); nothing when a lazily scanned
        atlas's model does not load here."""
        convention = self.default_convention if convention == "default" else convention
        key = f"_value_vocab:{convention}"
        if key not in self._cache:
            try:
                listed = self.value_rows(convention)[["token_id", "token"]].sort_values("token_id", kind="stable")
            except KvmemError:  # no model here: the contexts' tokens alone
                listed = pd.DataFrame({"token_id": [], "token": []})
            listed = listed.drop_duplicates("token")
            self._cache[key] = dict(zip(listed.token, listed.token_id.astype(int)))
        return self._cache[key]

    def search(self, pattern: str, *, layer: int | None = None, kind: str = "top", limit: int = 100) -> pd.DataFrame:
        """Triggers whose context matches a regular expression."""
        try:
            regex = re.compile(pattern)
        except re.error as error:
            raise KvmemError(f"bad regular expression {pattern!r}: {error}") from None
        columns = ["layer", "neuron", "kind", "rank", "activation", "doc_id", "pos", "token", "context"]
        if layer is not None:
            self.check(layer)
        # the regular expression runs once per distinct context, not once per trigger row
        codes, contexts = self._tables.contexts()
        matches = np.fromiter((regex.search(text) is not None for text in contexts.column("context").to_pylist()),
                              bool, len(codes))
        key = f"_search:{kind}"
        if key not in self._cache:  # the rows of this kind and the index of their context, once
            rows = self._tables.table("triggers", ["layer", "neuron", "kind", "rank", "activation", "doc", "pos"])
            rows = rows[rows.kind.to_numpy() == kind].reset_index(drop=True)
            self._cache[key] = (rows, np.minimum(np.searchsorted(codes, position_codes(rows)), max(len(codes) - 1, 0)))
        rows, at = self._cache[key]
        keep = matches[at] if len(codes) else np.zeros(len(rows), bool)
        if layer is not None:
            keep &= rows.layer.to_numpy() == layer
        hits = pa.Table.from_pandas(rows[keep].head(limit), preserve_index=False)
        return self._tables.with_text(hits, "triggers", columns).to_pandas()

    def explanations(self, layer: int | None = None, neuron: int | None = None, *,
                     explainer: str | None = None) -> pd.DataFrame:
        """Stored explanations (``explanations.parquet``, written by :func:`kvmem.explain`), with their scores;
        optionally of one layer, one neuron, one explainer (columns: :data:`kvmem.autointerp.store.COLUMNS`)."""
        from kvmem.autointerp.store import read

        frame = read(self.path)
        if layer is not None:
            self.check(layer, neuron)
            frame = frame[frame.layer == layer]
        if neuron is not None:
            frame = frame[frame.neuron == neuron]
        if explainer is not None:
            frame = frame[frame.explainer == explainer]
        return frame.reset_index(drop=True)

    def explanation_scores(self, layer: int | None = None, neuron: int | None = None, *,
                           explainer: str | None = None) -> pd.DataFrame:
        """The explanations' scores, one row per side and scorer: score, interval, p, n, baseline and the paired
        interval of score minus baseline (columns: :data:`kvmem.autointerp.tidy.TIDY_COLUMNS`)."""
        from kvmem.autointerp.tidy import score_table

        return score_table(self.explanations(layer, neuron, explainer=explainer))

    def search_explanations(self, pattern: str, *, layer: int | None = None, limit: int = 100) -> pd.DataFrame:
        """Explanations whose text matches a regular expression."""
        try:
            regex = re.compile(pattern)
        except re.error as error:
            raise KvmemError(f"bad regular expression {pattern!r}: {error}") from None
        frame = self.explanations(layer)
        hits = frame[frame.text.map(lambda text: regex.search(text) is not None)]
        return hits.head(limit).reset_index(drop=True)

    def table(self, name: str, columns: list[str] | None = None) -> pd.DataFrame:
        """A whole table as a DataFrame, optionally only some columns (large for big atlases)."""
        self._known(name)
        if columns is not None:
            names = set(self._tables.file(name).schema_arrow.names)
            if name in ("triggers", "samples"):
                names |= set(TRIGGER_VIEW if name == "triggers" else SAMPLE_VIEW)
            unknown = sorted(set(columns) - names)
            if unknown:
                raise KvmemError(f"table {name!r} has no column(s) {unknown}; see kvmem.schema.COLUMNS")
            columns = list(columns)
        return self._tables.table(name, columns)


def _ranges(values: list[int]) -> str:
    return f"{values[0]}..{values[-1]}" if values == list(range(values[0], values[-1] + 1)) else str(values)
