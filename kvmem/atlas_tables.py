"""An atlas's parquet files as :class:`~kvmem.atlas.Atlas` reads them: one layer's (or neuron's) rows from
the row groups that hold them, whole tables cached, and the text of triggers and samples joined from the
contexts table by position.

Tables with layer and neuron columns are sorted by (layer, neuron) and grouped so that no row group spans a
layer (:mod:`kvmem.scanning.parquet`); each group's layer and neuron statistics locate a neuron without
reading the others. The contexts table holds one row per kept position, keyed by (doc, pos).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvmem.errors import KvmemError
from kvmem.schema import CONTEXT_TEXT, SAMPLE_VIEW, TRIGGER_VIEW

__all__ = ["AtlasTables", "position_codes"]


def position_codes(rows) -> np.ndarray:
    """Packed positions doc << 32 | pos of an Arrow table or DataFrame with doc and pos columns."""
    doc, pos = (np.asarray(rows[name] if isinstance(rows, pd.DataFrame) else rows.column(name).to_numpy(), np.int64)
                for name in ("doc", "pos"))
    return (doc << 32) | pos


class AtlasTables:
    """The parquet files of the atlas at ``directory``; ``locate(table)`` says where a table's file is (the
    atlas's own, or a projection table in the per-model cache). Files are opened once; :meth:`clear`
    forgets them (after the atlas gained tables)."""

    def __init__(self, directory: Path, locate: Callable[[str], Path]):
        self.directory = directory
        self.locate = locate
        self._files: dict[str, pq.ParquetFile] = {}
        self._groups: dict[str, list[tuple[int, int, int]]] = {}
        self.cache: dict = {}  # whole tables, the contexts index, and what the atlas's queries build from them

    def clear(self) -> None:
        self._files.clear()
        self._groups.clear()
        self.cache.clear()

    def corrupt(self, table: str, error: Exception) -> KvmemError:
        return KvmemError(f"atlas table {self.directory / table}.parquet is corrupt ({error}); scan again")

    def file(self, table: str) -> pq.ParquetFile:
        if table not in self._files:
            path = self.locate(table)
            if not path.exists():
                raise KvmemError(f"atlas table {path} is missing; the atlas is incomplete, scan again")
            try:
                self._files[table] = pq.ParquetFile(path)
            except Exception as error:  # pyarrow raises several types for a damaged file
                raise KvmemError(f"atlas table {path} is corrupt ({error}); scan again") from None
            groups = []
            meta = self._files[table].metadata
            names = self._files[table].schema_arrow.names
            if "layer" not in names:  # contexts: keyed by (doc, pos), read whole
                return self._files[table]
            li, ni = names.index("layer"), names.index("neuron")
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                layer, neuron = rg.column(li).statistics, rg.column(ni).statistics
                if rg.num_rows == 0 or layer is None or neuron is None:
                    groups.append((-1, 0, -1))  # an empty table's single empty row group
                else:
                    groups.append((int(layer.min), int(neuron.min), int(neuron.max)))
            self._groups[table] = groups
        return self._files[table]

    def rows(self, table: str, layer: int, neuron: int | None = None) -> pa.Table:
        """Rows of one layer (and neuron), from the row groups that hold them."""
        file = self.file(table)
        wanted = [g for g, (lay, lo, hi) in enumerate(self._groups[table])
                  if lay == layer and (neuron is None or lo <= neuron <= hi)]
        if not wanted:
            return file.schema_arrow.empty_table()
        rows = file.read_row_groups(wanted)
        return rows if neuron is None else rows.filter(pc.equal(rows.column("neuron"), neuron))

    # ---- texts: one row per position in contexts, joined to triggers and samples by (doc, pos) ----
    def contexts(self) -> tuple[np.ndarray, pa.Table]:
        """(sorted codes doc << 32 | pos, the contexts table in that order), read once."""
        key = "_contexts"
        if key not in self.cache:
            try:
                contexts = self.file("contexts").read()
            except OSError as error:
                raise self.corrupt("contexts", error) from None
            codes = position_codes(contexts)
            order = np.argsort(codes, kind="stable")
            self.cache[key] = (codes[order], contexts.take(pa.array(order)))
        return self.cache[key]

    def with_text(self, rows: pa.Table, table: str, columns=None) -> pa.Table:
        """``rows`` (with doc, pos) plus their context's columns (all of CONTEXT_TEXT, or those in
        ``columns``), in the order of the table's view."""
        view = TRIGGER_VIEW if table == "triggers" else SAMPLE_VIEW
        columns = list(view if columns is None else columns)
        wanted = [name for name in CONTEXT_TEXT if name in columns and name not in rows.column_names]
        if wanted:
            codes, contexts = self.contexts()
            mine = position_codes(rows)
            at = np.searchsorted(codes, mine)
            found = at < len(codes)
            found[found] = codes[at[found]] == mine[found]
            if not found.all():
                raise KvmemError(f"{self.directory}: {int((~found).sum())} {table} row(s) point at positions missing "
                                 f"from the contexts table; the atlas is damaged, scan again")
            taken = contexts.select(wanted).take(pa.array(at))
            for name in wanted:
                rows = rows.append_column(contexts.schema.field(name), taken.column(name))
        return rows.select([name for name in columns if name in rows.column_names])

    def table(self, table: str, columns: list[str] | None = None) -> pd.DataFrame:
        """A whole table (triggers and samples with their context's columns) as a DataFrame, cached."""
        key = f"{table}:{columns}"
        if key not in self.cache:
            stored = self.file(table).schema_arrow.names
            joined = table in ("triggers", "samples")
            read = columns
            if joined and columns is not None:
                read = [name for name in columns if name in stored]
                if any(name in CONTEXT_TEXT and name not in stored for name in columns):
                    read = sorted(set(read) | {"doc", "pos"}, key=stored.index)
            try:
                rows = self.file(table).read(columns=read)
            except OSError as error:
                raise self.corrupt(table, error) from None
            if joined:
                rows = self.with_text(rows, table, columns)
            self.cache[key] = rows.to_pandas()
        return self.cache[key]

    def row_groups(self, table: str, columns: list[str]) -> Iterator[pa.Table]:
        """The stored ``columns`` of ``table``, one parquet row group at a time."""
        file = self.file(table)
        unknown = sorted(set(columns) - set(file.schema_arrow.names))
        if unknown:
            raise KvmemError(f"table {table!r} stores no column(s) {unknown}; see kvmem.schema.COLUMNS")
        for group in range(file.metadata.num_row_groups):
            try:
                yield file.read_row_group(group, columns=list(columns))
            except OSError as error:
                raise self.corrupt(table, error) from None
