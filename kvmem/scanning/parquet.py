"""Parquet files of an atlas: row groups that never span a layer (see :mod:`kvmem.schema`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvmem.schema import ROW_GROUP_NEURONS

__all__ = ["write_parquet", "LayerParts"]


def _dictionary_columns(schema: pa.Schema) -> list[str]:
    """Columns worth dictionary encoding: strings and lists of strings (kinds, tokens, contexts shared
    by many neurons). Numbers are not: integer dictionaries saved under 2% of an atlas's bytes (zstd
    compresses the plain values nearly as well) at about 15% of the writing time, and float
    dictionaries overflow and fall back to plain."""
    def worth(kind: pa.DataType) -> bool:
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            return worth(kind.value_type)
        return pa.types.is_string(kind) or pa.types.is_large_string(kind)

    return [field.name for field in schema if worth(field.type)]


# positions in the corpus: delta-encoded (bit-packed differences, no codec). Within a neuron's rows they
# repeat or step, so this packs them about as small as zstd does, in a third of the time (the doc and
# pos columns of a 20,000-token atlas's samples: 0.21 s of zstd writing, 0.07 s delta-encoded).
_DELTA_COLUMNS = ("doc", "pos")


def _encodings(schema: pa.Schema) -> dict[str, str]:
    return {field.name: "DELTA_BINARY_PACKED" for field in schema
            if field.name in _DELTA_COLUMNS and pa.types.is_integer(field.type)}


def _compression(schema: pa.Schema) -> dict[str, str]:
    """zstd for every column but floats (and lists of floats): coefficients are nearly incompressible
    (zstd saves about 12% of their bytes here at 1.5 times the writing time); none for the
    delta-encoded positions, which zstd hardly shrinks further."""
    def floats(kind: pa.DataType) -> bool:
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            return floats(kind.value_type)
        return pa.types.is_floating(kind)

    codecs = {}
    delta = _encodings(schema)
    for field in schema:
        codec = "none" if floats(field.type) or field.name in delta else "zstd"
        codecs[field.name] = codec
        if pa.types.is_list(field.type) or pa.types.is_large_list(field.type) or \
                pa.types.is_fixed_size_list(field.type):
            codecs[f"{field.name}.list.element"] = codec  # the writer names a list's values by their leaf path
    return codecs


def write_parquet(path: Path, table: pa.Table) -> None:
    """Row groups never span a layer and hold at most ROW_GROUP_NEURONS neurons (tables without
    layer and neuron columns, such as contexts, in row groups of 64k rows). Such tables keep
    column statistics for layer and neuron only: readers find a neuron's row group by them
    (:class:`kvmem.atlas.Atlas`, pyarrow's ``filters``), and statistics of every other column of
    every row group cost a quarter of the writing time."""
    if "layer" not in table.column_names:
        pq.write_table(table, path, row_group_size=1 << 16, **_options(table.schema))
        return
    with LayerParts(path) as out:
        out.write(table)


def _options(schema: pa.Schema) -> dict:
    return dict(compression=_compression(schema), use_dictionary=_dictionary_columns(schema) or False,
                column_encoding=_encodings(schema) or None)


class LayerParts:
    """A table with layer and neuron columns written part by part, parts in table order (each part
    whole layers, or the whole table): the same file as :func:`write_parquet` of the parts joined.

        with LayerParts(path) as out:
            for part in parts:  # pa.Tables of one schema
                out.write(part)
    """

    def __init__(self, path: Path):
        self.path = path
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self._rows = 0

    def __enter__(self) -> LayerParts:
        return self

    def write(self, table: pa.Table) -> None:
        if self._schema is None:
            self._schema = table.schema
        if len(table) == 0:
            return
        layer = table.column("layer").to_numpy().astype(np.int64)
        neuron = table.column("neuron").to_numpy().astype(np.int64)
        group = layer * (1 << 24) + neuron // ROW_GROUP_NEURONS
        cuts = np.flatnonzero(np.diff(group)) + 1
        bounds = [0, *cuts.tolist(), len(group)]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            self._open().write_table(table.slice(start, stop - start), row_group_size=stop - start)
        self._rows += len(table)

    def _open(self) -> pq.ParquetWriter:
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, self._schema, write_statistics=["layer", "neuron"],
                                            **_options(self._schema))
        return self._writer

    def close(self) -> None:
        """Finish the file; a table of no rows is one empty row group. Nothing is written without a part."""
        if self._schema is None:
            return
        if self._rows == 0:
            self._open().write_table(self._schema.empty_table(), row_group_size=1)
        self._open().close()

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            self.close()
        elif self._writer is not None:
            self._writer.close()  # the caller discards the file (an atlas is staged, see kvmem.atomic)
