"""The typed manifest (read, written, upgraded in one place) and the enforced table schema."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SHORT_DOCS

import kvmem
from kvmem.manifest import Manifest
from kvmem.schema import COLUMNS, FORMAT_VERSION, TABLES, arrow_schema, conform


@pytest.fixture(scope="module")
def small_atlas(gpt2_model, tmp_path_factory):
    return kvmem.scan(gpt2_model, SHORT_DOCS[:3], out=tmp_path_factory.mktemp("m") / "a", top_k=2, window=8, top_n=2,
                      progress=False)


def test_manifest_round_trip_and_typed_views(small_atlas, tmp_path):
    manifest = small_atlas.manifest
    assert isinstance(manifest, Manifest) and manifest.format_version == FORMAT_VERSION
    assert manifest.plan.window == 8 and manifest.config.top_k == 2 and manifest.shard == (0, 1)
    manifest.write(tmp_path / "m.json")
    assert Manifest.read(tmp_path / "m.json") == manifest


def test_bad_manifests_get_one_line(small_atlas, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(small_atlas.path, bad)
    data = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**data, "format_version": 9}))
    with pytest.raises(kvmem.KvmemError, match=r"has atlas format 9, this kvmem reads format 4; rescan it") as error:
        kvmem.open(bad)
    assert "\n" not in str(error.value)
    (bad / "manifest.json").write_text(json.dumps({k: v for k, v in data.items() if k != "layers"}))
    with pytest.raises(kvmem.KvmemError, match="lacks layers: it is damaged"):
        kvmem.open(bad)


def test_every_table_on_disk_has_the_schema_of_kvmem_schema(small_atlas):
    import pyarrow.parquet as pq

    for name in TABLES:
        assert pq.ParquetFile(small_atlas.table_path(name)).schema_arrow == arrow_schema(name), name
        assert arrow_schema(name).names == list(COLUMNS[name])


def test_a_drifting_column_fails(small_atlas):
    table = pq.read_table(small_atlas.table_path("neurons"))
    conform(table, "neurons")  # the real one passes
    with pytest.raises(ValueError, match=r"missing \['value_norm'\]"):
        conform(table.drop(["value_norm"]), "neurons")
    with pytest.raises(ValueError, match=r"extra \['surprise'\]"):
        conform(table.append_column("surprise", pa.array([1] * len(table))), "neurons")
    retyped = table.set_column(table.schema.get_field_index("count"), "count", table.column("count").cast(pa.int32()))
    with pytest.raises(ValueError, match="column 'count' is int32, kvmem.schema says int64"):
        conform(retyped, "neurons")


def test_parquet_columns_are_compressed_as_documented(tmp_path):
    """write_parquet: zstd for integers, strings and lists of them (a list's values included: the writer names
    them by their leaf path), none for floats and lists of floats (coefficients barely compress)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvmem.scanning.parquet import write_parquet

    table = pa.table({"layer": pa.array([0, 0], pa.int16()), "neuron": pa.array([0, 1], pa.int32()),
                      "counts": pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, 4], pa.int64()), 2),
                      "tokens": pa.array([["a"], ["b", "c"]], pa.large_list(pa.string())),
                      "score": pa.array([0.5, 1.5], pa.float32()),
                      "acts": pa.array([[0.5], [1.0, 2.0]], pa.large_list(pa.float32()))})
    write_parquet(tmp_path / "t.parquet", table)
    group = pq.ParquetFile(tmp_path / "t.parquet").metadata.row_group(0)
    codecs = {group.column(i).path_in_schema: group.column(i).compression for i in range(group.num_columns)}
    assert codecs == {"layer": "ZSTD", "neuron": "ZSTD", "counts.list.element": "ZSTD",
                      "tokens.list.element": "ZSTD", "score": "UNCOMPRESSED", "acts.list.element": "UNCOMPRESSED"}
    assert pq.read_table(tmp_path / "t.parquet").equals(table)


def test_row_groups_hold_one_layers_neurons_with_their_statistics(tmp_path):
    """write_parquet: a row group never spans a layer and holds at most ROW_GROUP_NEURONS neurons; layer and
    neuron carry min/max statistics (the atlas finds a neuron's row group by them), other columns none;
    strings are dictionary encoded, numbers are not; corpus positions are delta encoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvmem.scanning.parquet import write_parquet
    from kvmem.schema import ROW_GROUP_NEURONS

    d_ff = 2 * ROW_GROUP_NEURONS + 5
    layer = np.repeat(np.array([3, 7], np.int16), d_ff)
    neuron = np.tile(np.arange(d_ff, dtype=np.int32), 2)
    table = pa.table({"layer": layer, "neuron": neuron, "kind": pa.array(["top"] * len(layer)),
                      "activation": np.arange(len(layer), dtype=np.float32),
                      "doc": np.arange(len(layer), dtype=np.int64) // 3, "pos": np.arange(len(layer), dtype=np.int32) % 7})
    write_parquet(tmp_path / "t.parquet", table)
    meta = pq.ParquetFile(tmp_path / "t.parquet").metadata
    spans = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        columns = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
        assert columns["layer"].statistics.min == columns["layer"].statistics.max
        assert columns["neuron"].statistics.max - columns["neuron"].statistics.min < ROW_GROUP_NEURONS
        assert columns["activation"].statistics is None and columns["kind"].statistics is None
        assert "PLAIN_DICTIONARY" in columns["kind"].encodings or "RLE_DICTIONARY" in columns["kind"].encodings
        assert not {"PLAIN_DICTIONARY", "RLE_DICTIONARY"} & set(columns["activation"].encodings)
        for position in ("doc", "pos"):  # corpus positions: delta-encoded, no codec
            assert "DELTA_BINARY_PACKED" in columns[position].encodings and columns[position].compression == "UNCOMPRESSED"
        spans.append((columns["layer"].statistics.min, columns["neuron"].statistics.min, group.num_rows))
    r = ROW_GROUP_NEURONS
    assert spans == [(3, 0, r), (3, r, r), (3, 2 * r, 5), (7, 0, r), (7, r, r), (7, 2 * r, 5)]
    assert pq.read_table(tmp_path / "t.parquet").equals(table)


def test_a_table_written_layer_by_layer_is_the_same_file(tmp_path):
    """LayerParts (the scan's writer threads take the large tables a layer at a time): the parts, an
    empty one among them, give the bytes of write_parquet of the whole table; a table of no rows is one
    empty row group, as write_parquet writes it; no part at all writes no file."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from kvmem.scanning.parquet import LayerParts, write_parquet
    from kvmem.schema import ROW_GROUP_NEURONS

    d_ff = ROW_GROUP_NEURONS + 3
    layer = np.repeat(np.array([0, 2, 5], np.int16), d_ff)
    neuron = np.tile(np.arange(d_ff, dtype=np.int32), 3)
    table = pa.table({"layer": layer, "neuron": neuron, "kind": pa.array(["top", "bottom", "top"] * d_ff),
                      "activation": np.linspace(-1, 1, len(layer), dtype=np.float32),
                      "doc": np.arange(len(layer), dtype=np.int64) // 5,
                      "context": pa.array([[float(i), float(i) + 0.5][:i % 3] for i in range(len(layer))],
                                          pa.large_list(pa.float32()))})
    write_parquet(tmp_path / "whole.parquet", table)
    with LayerParts(tmp_path / "parts.parquet") as out:
        for value in (0, 2, 5):
            out.write(table.filter(pc.equal(table["layer"], value)))
            out.write(table.slice(0, 0))
    assert (tmp_path / "parts.parquet").read_bytes() == (tmp_path / "whole.parquet").read_bytes()
    meta = pq.ParquetFile(tmp_path / "parts.parquet").metadata  # the layout, against pyarrow's own reading
    spans = [(meta.row_group(g).column(0).statistics.min, meta.row_group(g).column(1).statistics.min,
              meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
    r = ROW_GROUP_NEURONS
    assert spans == [(0, 0, r), (0, r, 3), (2, 0, r), (2, r, 3), (5, 0, r), (5, r, 3)]
    assert pq.read_table(tmp_path / "parts.parquet").equals(table)

    write_parquet(tmp_path / "empty_whole.parquet", table.slice(0, 0))
    with LayerParts(tmp_path / "empty_parts.parquet") as out:
        out.write(table.slice(0, 0))
        out.write(table.slice(0, 0))
    assert (tmp_path / "empty_parts.parquet").read_bytes() == (tmp_path / "empty_whole.parquet").read_bytes()
    assert pq.read_table(tmp_path / "empty_parts.parquet").num_rows == 0

    with LayerParts(tmp_path / "none.parquet"):
        pass
    assert not (tmp_path / "none.parquet").exists()
