"""The optional |m| percentile statistic (kvmem/scanning/statistics/magnitude_percentiles.py) against numpy on
the brute-force coefficients of the HF model's down projections (tests/hf_oracle.py): its per-neuron bin counts
exactly, merged from two shards as from one stream, and each written percentile inside the bin it reports
(numpy's ``inverted_cdf``, the smallest x with at least p·n values at or below it)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SHORT_DOCS
from hf_oracle import positions

import kvmem
from kvmem.errors import KvmemError
from kvmem.scanning.runner import stream

WINDOW = 8
SETTINGS = dict(window=WINDOW, top_k=3, batch_size=3, block_documents=2, statistics=("magnitude_percentiles",))


def _edges() -> np.ndarray:
    """The documented bins, written out independently: 0, then 8 edges per octave (1 + j/8) · 2^e from 2^-16
    to 2^16, then inf."""
    finite = [(1 + j / 8) * 2.0**e for e in range(-16, 16) for j in range(8)] + [2.0**16]
    return np.asarray([0.0, *finite, np.inf])


@pytest.fixture(scope="module")
def brute(gpt2_model):
    codes, acts = positions(gpt2_model, SHORT_DOCS, window=WINDOW)
    return {layer: np.abs(m.astype(np.float64)) for layer, m in acts.items()}


def _counts(magnitudes: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """[F, bins]: values v with edges[b] <= v < edges[b + 1]."""
    return np.stack([np.histogram(magnitudes[:, f], bins=edges)[0] for f in range(magnitudes.shape[1])])


def test_merged_shards_count_every_magnitude_in_its_bin(gpt2_model, brute):
    halves = [stream(gpt2_model, SHORT_DOCS, shard=(i, 2), **SETTINGS) for i in range(2)]
    merged = halves[0].merge(halves[1])
    whole = stream(gpt2_model, SHORT_DOCS, **SETTINGS)
    edges = _edges()
    for layer, magnitudes in brute.items():
        want = _counts(magnitudes, edges)
        np.testing.assert_array_equal(whole.layer_states[layer]["magnitude_percentiles"].numpy(), want)
        np.testing.assert_array_equal(merged.layer_states[layer]["magnitude_percentiles"].numpy(), want)
        assert 0 < want.sum(1).min() and (want[:, 1:-1] > 0).any()  # the bins are exercised, not all in one


def test_each_percentile_lies_in_the_bin_it_reports(gpt2_model, brute, tmp_path):
    atlas = kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "atlas", progress=False, **SETTINGS)
    table = atlas.table("magnitude_percentiles")
    assert set(table.columns) == {"layer", "neuron", "level", "low", "high"}
    assert atlas.manifest.scan["statistics"] == ["magnitude_percentiles"]
    assert "magnitude_percentiles" in atlas.manifest.engine["statistics"]
    checked = 0
    for layer, magnitudes in brute.items():
        rows = table[table.layer == layer]
        assert len(rows) == magnitudes.shape[1] * rows.level.nunique()
        for row in rows.itertuples():
            want = np.quantile(magnitudes[:, row.neuron], row.level, method="inverted_cdf")
            assert row.low <= want < row.high, (layer, row.neuron, row.level, want, row.low, row.high)
            checked += 1
    assert checked > 1000


def test_an_unknown_optional_statistic_is_refused_naming_the_known_ones(gpt2_model, tmp_path):
    with pytest.raises(KvmemError, match="magnitude_percentiles"):
        kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "atlas", statistics=("percentile",), progress=False)


def test_off_by_default(gpt2_model, tmp_path):
    atlas = kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "atlas", window=WINDOW, progress=False)
    assert not (atlas.path / "magnitude_percentiles.parquet").exists()
    assert "magnitude_percentiles" not in atlas.manifest.engine["statistics"]
