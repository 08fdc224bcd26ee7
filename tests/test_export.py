"""Activation records (stored and on demand) and the neuron-explainer export, read back as its dataclasses."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import numpy as np
import pytest
from conftest import SHORT_DOCS
from hf_oracle import histogram_bins, positions

import kvmem
from kvmem.cli import main
from kvmem.errors import KvmemError
from kvmem.export import FORMATS, export_atlas
from kvmem.records import activation_records

NEURONS = (0, 17, 95)
LEVELS = (0, 0.5, 0.9, 0.99, 0.999, 1)


@pytest.fixture(scope="module")
def gpt2_atlas(gpt2_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "atlas"
    return kvmem.scan(gpt2_model, SHORT_DOCS, out=out, top_k=4, window=8, top_n=5, progress=False)


@pytest.fixture(scope="module")
def llama_atlas(llama_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("export-llama") / "atlas"
    return kvmem.scan(llama_model, SHORT_DOCS, out=out, top_k=4, window=8, top_n=5, progress=False)


# ---- a reader that follows openai/automated-interpretability activations.py (field names, order, types) ----
@dataclass
class ActivationRecord:
    tokens: list[str]
    activations: list[float]


@dataclass
class NeuronId:
    layer_index: int
    neuron_index: int


@dataclass
class NeuronRecord:
    neuron_id: NeuronId
    random_sample: list[ActivationRecord] = field(default_factory=list)
    random_sample_by_quantile: list[list[ActivationRecord]] | None = None
    quantile_boundaries: list[float] | None = None
    mean: float | None = float("nan")
    variance: float | None = float("nan")
    skewness: float | None = float("nan")
    kurtosis: float | None = float("nan")
    most_positive_activation_records: list[ActivationRecord] = field(default_factory=list)


CLASSES = {cls.__name__: cls for cls in (ActivationRecord, NeuronId, NeuronRecord)}


def load_record(path) -> NeuronRecord:
    """Like fast_dataclasses.loads: each dict names its class and holds exactly its fields (cls(**d))."""
    def hook(d: dict):
        if "dataclass_name" not in d:
            return d
        cls = CLASSES[d.pop("dataclass_name")]
        assert list(d) == [f.name for f in fields(cls)], (cls.__name__, list(d))
        return cls(**d)

    record = json.loads(path.read_text("utf-8"), object_hook=hook,
                        parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))
    assert isinstance(record, NeuronRecord)
    for r in [*record.random_sample, *record.most_positive_activation_records,
              *[r for band in record.random_sample_by_quantile or [] for r in band]]:
        assert isinstance(r, ActivationRecord) and len(r.tokens) == len(r.activations) > 0
        assert all(isinstance(t, str) for t in r.tokens) and all(isinstance(a, float) for a in r.activations)
    return record


def test_trigger_and_random_records_come_from_the_atlas(gpt2_atlas):
    for layer in gpt2_atlas.layers:
        for neuron in NEURONS:
            for frame in (gpt2_atlas.triggers(layer, neuron, kind="top"), gpt2_atlas.samples(layer, neuron, kind="random")):
                records = activation_records(gpt2_atlas, frame)  # no model
                assert len(records) == len(frame) > 0
                for r, row in zip(records, frame.itertuples()):
                    assert r.tokens == tuple(row.context_tokens) and not r.computed
                    assert r.activations == tuple(float(a) for a in row.context_activations)
                    assert r.activations[r.index] == r.activation == pytest.approx(row.activation)


def test_on_demand_records_equal_stored_values(gpt2_atlas, gpt2_model):
    for layer in gpt2_atlas.layers:
        for neuron in NEURONS:
            bins = gpt2_atlas.samples(layer, neuron, kind="bin")
            assert len(bins) and all(len(a) == 0 for a in bins.context_activations)
            with pytest.raises(KvmemError, match="model="):
                activation_records(gpt2_atlas, bins)
            records = activation_records(gpt2_atlas, bins, model=gpt2_model, corpus=SHORT_DOCS)
            for r, row in zip(records, bins.itertuples()):
                assert r.computed and len(r.activations) == len(row.context_tokens)
                np.testing.assert_allclose(r.activations[r.index], row.activation, rtol=1e-5, atol=1e-6)
            random = gpt2_atlas.samples(layer, neuron, kind="random")
            again = activation_records(gpt2_atlas, random, model=gpt2_model, corpus=SHORT_DOCS, recompute=True)
            for r, row in zip(again, random.itertuples()):
                np.testing.assert_allclose(r.activations, row.context_activations, rtol=1e-5, atol=1e-6)


def test_on_demand_refuses_another_corpus_or_model(gpt2_atlas, gpt2_model, llama_model):
    bins = gpt2_atlas.samples(0, 17, kind="bin")
    with pytest.raises(KvmemError, match="in-memory corpus"):
        activation_records(gpt2_atlas, bins, model=gpt2_model)
    with pytest.raises(KvmemError, match="not the scanned corpus"):
        activation_records(gpt2_atlas, bins, model=gpt2_model, corpus=list(reversed(SHORT_DOCS)))
    with pytest.raises(KvmemError, match="not the scanned model"):
        activation_records(gpt2_atlas, bins, model=llama_model, corpus=SHORT_DOCS)


def test_neuron_explainer_round_trip(gpt2_atlas, gpt2_model, tmp_path):
    out = export_atlas(gpt2_atlas, out=tmp_path / "ne", neurons=[(0, n) for n in NEURONS], layers=[1],
                       model=gpt2_model, corpus=SHORT_DOCS, per_band=2)
    assert sorted(p.name for p in (out / "neurons").iterdir()) == ["0", "1"]
    assert len(list((out / "neurons" / "1").iterdir())) == gpt2_model.d_ff
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["format"] == "neuron-explainer" and "estimated" in meta["moments"]["skewness"]
    for neuron in NEURONS:
        record = load_record(out / "neurons" / "0" / f"{neuron}.json")
        side = json.loads((out / "kvmem" / "0" / f"{neuron}.json").read_text())
        assert record.neuron_id == NeuronId(layer_index=0, neuron_index=neuron)
        stats = gpt2_atlas.neurons.query(f"layer == 0 and neuron == {neuron}").iloc[0]
        assert record.mean == pytest.approx(stats["mean"], rel=1e-12)
        assert record.variance == pytest.approx(stats["std"] ** 2, rel=1e-12)
        assert side["stdev"] == pytest.approx(stats["std"], rel=1e-12)
        top = gpt2_atlas.triggers(0, neuron, kind="top")
        assert [r.tokens for r in record.most_positive_activation_records] == [list(t) for t in top.context_tokens]
        for r, row in zip(record.most_positive_activation_records, top.itertuples()):
            assert np.array_equal(np.float32(r.activations), np.asarray(row.context_activations, np.float32))
        bottom = gpt2_atlas.triggers(0, neuron, kind="bottom")
        assert [r["tokens"] for r in side["most_negative_activation_records"]] == [list(t) for t in bottom.context_tokens]
        random = gpt2_atlas.samples(0, neuron, kind="random")
        at = [r.activations[i["index"]] for r, i in zip(record.random_sample, side["positions"]["random_sample"])]
        assert np.array_equal(np.float32(at), random.activation.to_numpy(np.float32))
        bands = gpt2_atlas.quantile_samples(0, neuron, levels=(0, 0.5, 0.9, 0.99, 0.999, 1), per_band=2)
        assert len(record.random_sample_by_quantile) == 5 and len(record.quantile_boundaries) == 4
        expected = expected_boundaries(oracle_values(gpt2_model, 0, neuron), LEVELS)
        assert record.quantile_boundaries == pytest.approx(expected, rel=1e-6)
        for band, frame, where in zip(record.random_sample_by_quantile, bands, side["positions"]["random_sample_by_quantile"]):
            assert [(p["doc"], p["pos"]) for p in where] == list(zip(frame.doc, frame.pos))
            for r, p, row in zip(band, where, frame.itertuples()):
                assert r.tokens == list(row.context_tokens) and p["computed"]
                assert r.activations[p["index"]] == pytest.approx(row.activation, rel=1e-5, abs=1e-6)
        assert record.skewness is not None and record.kurtosis is not None  # exact values: test_exported_moments_*


def test_export_of_an_atlas_without_context_activations(gpt2_atlas, gpt2_model, tmp_path):
    """Bug fixed: the random samples of an atlas scanned without context activations were read without the
    model, so the export stopped with 'pass model='; they are now computed like the triggers."""
    bare = kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "bare", top_k=4, window=8, top_n=5, progress=False,
                      context_activations=False)
    out = export_atlas(bare, out=tmp_path / "ne", neurons=[(1, n) for n in NEURONS], model=gpt2_model,
                       corpus=SHORT_DOCS, quantiles=False)
    for neuron in NEURONS:
        record = load_record(out / "neurons" / "1" / f"{neuron}.json")
        stored = gpt2_atlas.samples(1, neuron, kind="random")  # the same seeded sample, contexts stored by the scan
        assert len(record.random_sample) == len(stored) > 0
        for r, row in zip(record.random_sample, stored.itertuples()):
            assert r.tokens == list(row.context_tokens)
            np.testing.assert_allclose(r.activations, row.context_activations, rtol=1e-5, atol=1e-6)


def test_moments_are_exact_for_values_the_samples_hold():
    """Every bin keeps all its values: the stratified estimate is the exact skewness and excess kurtosis."""
    import pandas as pd

    from kvmem.export.neuron_explainer import moments

    values = np.array([-1.0, 0.1, 0.1, 0.2, 3.0], np.float64)
    bins = np.array([0, 1, 1, 2, 3])
    histogram = pd.DataFrame({"bin": range(4), "low": [-2, 0, 0.15, 2], "high": [0, 0.15, 2, 4],
                              "count": np.bincount(bins, minlength=4)})
    samples = pd.DataFrame({"bin": bins, "activation": values})
    stats = {"mean": values.mean(), "std": values.std(), "min": values.min(), "max": values.max()}
    mean, variance, skewness, kurtosis = moments(stats, histogram, samples)
    d = values - values.mean()
    assert skewness == pytest.approx(np.mean(d ** 3) / values.std() ** 3, rel=1e-12)
    assert kurtosis == pytest.approx(np.mean(d ** 4) / values.std() ** 4 - 3, rel=1e-12)


def test_gated_export_keeps_signs(llama_atlas, llama_model, tmp_path):
    neuron = int(llama_atlas.neurons.query("layer == 1").sort_values("min").neuron.iloc[0])
    out = export_atlas(llama_atlas, out=tmp_path / "ne", neurons=[(1, neuron)], model=llama_model, corpus=SHORT_DOCS)
    record = load_record(out / "neurons" / "1" / f"{neuron}.json")
    side = json.loads((out / "kvmem" / "1" / f"{neuron}.json").read_text())
    bottom = llama_atlas.triggers(1, neuron, kind="bottom")
    lowest = [r["activations"][p["index"]] for r, p in zip(side["most_negative_activation_records"],
                                                            side["positions"]["most_negative_activation_records"])]
    assert np.array_equal(np.float32(lowest), bottom.activation.to_numpy(np.float32)) and lowest[0] < 0
    assert "-v" in side["sign"]["most_negative_activation_records"]
    assert max(max(r.activations) for r in record.most_positive_activation_records) >= 0


def test_cli_export(gpt2_atlas, tmp_path, capsys):
    assert list(FORMATS) == ["neuron-explainer"]
    out = tmp_path / "cli"
    code = main(["export", "--atlas", str(gpt2_atlas.path), "--format", "neuron-explainer", "--out", str(out),
                 "--neurons", "0:3", "1:5", "--no-quantiles", "--no-progress"])
    assert code == 0 and "2 neuron(s)" in capsys.readouterr().out
    record = load_record(out / "neurons" / "1" / "5.json")
    assert record.random_sample_by_quantile is None and record.quantile_boundaries is None
    assert main(["export", "--atlas", str(gpt2_atlas.path), "--format", "neuron-explainer", "--out", str(out),
                 "--neurons", "0:3", "--no-quantiles"]) == 2
    assert "already exists" in capsys.readouterr().err
    # quantiles need the corpus: an in-memory list cannot be reopened, said in one line
    assert main(["export", "--atlas", str(gpt2_atlas.path), "--format", "neuron-explainer", "--out", str(tmp_path / "q"),
                 "--neurons", "0:3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "in-memory corpus" in err and not (tmp_path / "q").exists()
    with pytest.raises(SystemExit):
        main(["export", "--atlas", str(gpt2_atlas.path), "--format", "nope", "--out", str(tmp_path / "x")])


# ---- quantile bands and boundaries against brute force ----
_ORACLE: dict = {}


def oracle_values(model, layer: int, neuron: int) -> np.ndarray:
    """Every coefficient the scans of SHORT_DOCS (window 8) read, of one neuron, from HF forwards with a
    down-projection pre-hook."""
    if id(model) not in _ORACLE:
        _ORACLE[id(model)] = positions(model, SHORT_DOCS, window=8)[1]
    return _ORACLE[id(model)][layer][:, neuron]


def oracle_bands(values: np.ndarray, levels=None, bands: int = 5):
    """(bin of each value, band of each bin [B]): bins from the documented edges; a bin joins the band in
    which the fraction of values in lower bins falls (levels), or band floor(fraction * bands)."""
    from kvmem.scanning.bins import HIST_BINS, bin_edges

    bins = histogram_bins(values, bin_edges())
    below = np.array([(bins < b).sum() / len(values) for b in range(HIST_BINS)])
    if levels is None:
        return bins, np.minimum(np.floor(below * bands).astype(int), bands - 1)
    inner = levels[1:-1]
    return bins, np.array([sum(level <= f for level in inner) for f in below])


def expected_boundaries(values: np.ndarray, levels) -> list[float]:
    """Where bands 2.. start: the lower edge of the bin holding the smallest value at or above the band,
    clamped to [min, max]; float32 as the export writes it."""
    from kvmem.scanning.bins import bin_edges

    edges = bin_edges()
    bins, band_of_bin = oracle_bands(values, levels)
    out = []
    for band in range(1, len(levels) - 1):
        held = values[band_of_bin[bins] >= band]
        edge = edges[int(bins[np.argmin(np.where(band_of_bin[bins] >= band, values, np.inf))])] if len(held) \
            else values.max()
        out.append(float(np.float32(min(max(edge, values.min()), values.max()))))
    return out


@pytest.mark.parametrize("levels", [None, LEVELS], ids=["equal_bands", "viewer_levels"])
def test_quantile_bands_equal_brute_force(gpt2_atlas, gpt2_model, levels):
    """Each band's bins, bounds and samples follow from the raw coefficients alone."""
    from kvmem.scanning.bins import bin_edges

    edges = bin_edges()
    changed = 0
    for layer in (0, 1):
        for neuron in NEURONS:
            values = oracle_values(gpt2_model, layer, neuron)
            bins, band_of_bin = oracle_bands(values, levels)
            frames = gpt2_atlas.quantile_samples(layer, neuron, levels=levels, per_band=50)
            assert len(frames) == (5 if levels is None else len(levels) - 1)
            for band, frame in enumerate(frames):
                mine = np.flatnonzero(band_of_bin == band)  # every bin, empty ones included, has a band
                if len(frame):
                    assert (frame.band_low.iloc[0], frame.band_high.iloc[0]) == (edges[mine.min()], edges[mine.max() + 1])
                # every sample of the band lies in one of the band's non-empty bins
                held = np.unique(bins[band_of_bin[bins] == band])
                assert set(histogram_bins(frame.activation.to_numpy(), edges).tolist()) <= set(held.tolist())
                assert len(held) == 0 or len(frame) == min(50, len(gpt2_atlas.samples(layer, neuron, kind="bin").query(
                    "bin in @held")))
            # the rule is about the count *before* each bin: the count after would move some bin
            after = np.array([(bins <= b).sum() / len(values) for b in range(len(band_of_bin))])
            moved = np.minimum(np.floor(after * 5).astype(int), 4) if levels is None else \
                np.array([sum(level <= f for level in levels[1:-1]) for f in after])
            changed += bool((moved[np.unique(bins)] != band_of_bin[np.unique(bins)]).any())
    assert changed > 0  # so a band rule that reads the count after each bin fails above


def test_quantile_boundaries_separate_the_bands(gpt2_atlas, gpt2_model, tmp_path):
    """Each exported boundary lies between the largest value of the bands below it and the smallest of the
    bands at or above it (inside a bin's width), and equals the lower edge of that bin."""
    out = export_atlas(gpt2_atlas, out=tmp_path / "ne", neurons=[(1, n) for n in NEURONS], model=gpt2_model,
                       corpus=SHORT_DOCS, per_band=1)
    for neuron in NEURONS:
        record = load_record(out / "neurons" / "1" / f"{neuron}.json")
        values = oracle_values(gpt2_model, 1, neuron)
        bins, band_of_bin = oracle_bands(values, LEVELS)
        for band, boundary in enumerate(record.quantile_boundaries, start=1):
            above = values[band_of_bin[bins] >= band]
            below = values[band_of_bin[bins] < band]
            if len(above) and len(below):
                assert below.max() <= boundary <= above.min() * (1 + 1e-6) + 1e-12
        assert record.quantile_boundaries == pytest.approx(expected_boundaries(values, LEVELS), rel=1e-6)


@pytest.fixture(scope="module")
def exact_atlas(gpt2_model, tmp_path_factory):
    """Every bin keeps every value it counts (the corpus has ~100 positions): moments are exact."""
    out = tmp_path_factory.mktemp("export-exact") / "atlas"
    return kvmem.scan(gpt2_model, SHORT_DOCS, out=out, top_k=2, window=8, top_n=2, bin_samples=128, sample_rate=1.0,
                      layers=[1], conventions=("raw",), key_projections=False, progress=False)


def test_exported_moments_equal_numpy_when_every_value_is_kept(exact_atlas, gpt2_model, tmp_path):
    out = export_atlas(exact_atlas, out=tmp_path / "ne", neurons=[(1, n) for n in NEURONS], quantiles=False)
    for neuron in NEURONS:
        values = oracle_values(gpt2_model, 1, neuron).astype(np.float64)
        assert exact_atlas.histogram(1, neuron)["count"].sum() == len(values)
        assert len(exact_atlas.samples(1, neuron, kind="bin")) == len(values)  # every value kept
        record = load_record(out / "neurons" / "1" / f"{neuron}.json")
        d = values - values.mean()
        assert record.skewness == pytest.approx(np.mean(d ** 3) / values.std() ** 3, rel=1e-4, abs=1e-6)
        assert record.kurtosis == pytest.approx(np.mean(d ** 4) / values.std() ** 4 - 3, rel=1e-4, abs=1e-6)
