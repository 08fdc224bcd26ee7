"""Lazy projections (the default): an atlas without values and keys tables computes a neuron's rows from the
model, bit for bit the rows an eager scan writes (token ids, ranks, tie order, float32 scores), on a plain
LayerNorm GPT-2 and a gated Llama (key and gate vectors); ``kvmem project`` writes tables byte-identical to the
eager ones; a query that needs a whole table says in one line how to make it; another model's weights are
refused."""

from __future__ import annotations

import shutil

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import SHORT_DOCS

import kvmem
from kvmem.cli import main

SETTINGS = dict(top_k=3, window=8, batch_size=3, top_n=6, progress=False)
NEURONS = [(0, 0), (1, 7), (1, 95)]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, gpt2_model, llama_model, tmp_path_factory):
    """(model, eager atlas, lazy atlas), the eager tables computed now (an empty projection cache), whole."""
    model = {"gpt2": gpt2_model, "llama": llama_model}[request.param]
    root = tmp_path_factory.mktemp(f"lazy-{request.param}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVMEM_CACHE", str(root / "cache"))
        eager = kvmem.scan(model, SHORT_DOCS, out=root / "eager", projections="eager", **SETTINGS)
        assert eager.manifest.timing["projections_cached"] is False
        lazy = kvmem.scan(model, SHORT_DOCS, out=root / "lazy", **SETTINGS)
        yield model, eager, lazy


def _bits(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with its scores as their float32 bits (so -0.0 and 0.0, or two NaNs, compare as stored)."""
    return frame.assign(score=frame.score.to_numpy().view("int32"))


def test_a_lazy_scan_writes_no_projection_tables_and_records_it(pair):
    _, eager, lazy = pair
    assert not (lazy.path / "values.parquet").exists() and not (lazy.path / "keys.parquet").exists()
    assert not lazy.has_projections and eager.has_projections
    assert lazy.manifest.scan["projections"] == "lazy" and eager.manifest.scan["projections"] == "eager"
    assert lazy.manifest.projection["method"] is None and eager.manifest.projection["method"] == "torch-screen"
    for table in ("neurons", "triggers", "contexts", "histograms", "samples", "unigrams"):  # the rest is the same
        assert (lazy.path / f"{table}.parquet").read_bytes() == (eager.path / f"{table}.parquet").read_bytes()


@pytest.mark.parametrize("cache", ["empty", "holding the tables"])
def test_rows_on_demand_equal_the_eager_tables_bit_for_bit(pair, cache, tmp_path, monkeypatch):
    model, eager, lazy = pair
    if cache == "empty":  # computed from the model; otherwise read from the tables the eager scan cached
        monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "empty-cache"))
    lazy = kvmem.open(lazy.path)
    reopened = kvmem.open(lazy.path, model=model)  # the model passed in, and (below) loaded from the manifest
    for layer, neuron in NEURONS:
        for opened in (reopened, lazy):
            got, want = opened.values(layer, neuron), eager.values(layer, neuron)
            assert len(want) == len(eager.conventions) * 2 * 6
            pd.testing.assert_frame_equal(_bits(got), _bits(want), check_exact=True)
            got, want = opened.keys(layer, neuron), eager.keys(layer, neuron)
            assert set(want.vector) == ({"key", "gate"} if model.gated else {"key"})
            pd.testing.assert_frame_equal(_bits(got), _bits(want), check_exact=True)
    many = reopened.projection_rows("values", 1, [95, 3, 7])  # several neurons at once, in table order
    stored = pq.read_table(eager.path / "values.parquet").to_pandas()
    stored = stored[(stored.layer == 1) & stored.neuron.isin([3, 7, 95])].reset_index(drop=True)
    pd.testing.assert_frame_equal(_bits(many.to_pandas()), _bits(stored), check_exact=True)
    for convention in eager.conventions:  # one convention computed alone: the eager table's rows of it
        for opened in (reopened, eager):
            one = opened.projection_rows("values", 1, [95, 3, 7], labels=[convention]).to_pandas()
            pd.testing.assert_frame_equal(_bits(one), _bits(stored[stored.convention == convention].reset_index(
                drop=True)), check_exact=True)
    key_rows = pq.read_table(eager.path / "keys.parquet").to_pandas()
    key_rows = key_rows[(key_rows.layer == 1) & (key_rows.neuron == 7) & (key_rows.vector == "key")]
    one = reopened.projection_rows("keys", 1, [7], labels=["key"]).to_pandas()
    pd.testing.assert_frame_equal(_bits(one), _bits(key_rows.reset_index(drop=True)), check_exact=True)
    record = reopened.neuron(1, 7)
    assert record.promoted() == eager.neuron(1, 7).promoted() and record.promoted()
    for opened in (reopened, lazy):  # which way the rows came
        assert (opened.projections._projector is None) == (cache != "empty")


def test_a_whole_layer_computed_on_demand_is_kept_for_the_next_reader(pair, tmp_path, monkeypatch):
    model, eager, lazy = pair
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))  # no whole tables: each layer computed, then kept
    stored = pq.read_table(eager.path / "values.parquet").to_pandas()
    want = stored[(stored.layer == 1) & (stored.convention == "final_norm")].reset_index(drop=True)
    every = list(range(lazy.d_ff))
    first = kvmem.open(lazy.path, model=model)
    got = first.projection_rows("values", 1, every, labels=["final_norm"]).to_pandas()
    assert first.projections._projector is not None and len(list((tmp_path / "cache").rglob("values.parquet"))) == 1
    second = kvmem.open(lazy.path, model=model)  # another reader, as the next command: reads what the first kept
    again = second.projection_rows("values", 1, every, labels=["final_norm"]).to_pandas()
    assert second.projections._projector is None
    for frame in (got, again):
        pd.testing.assert_frame_equal(_bits(frame), _bits(want), check_exact=True)


def test_whole_table_queries_read_the_models_tables_or_say_how_and_project_writes_the_eager_bytes(pair, tmp_path):
    """A lazily scanned atlas answers queries over every neuron's value from the scanned model's tables (the
    per-model projection cache), equal to an eager scan's; where the model cannot load it says in one line how
    to write them; ``kvmem project`` writes the eager bytes."""
    import json

    import pandas as pd

    model, eager, lazy = pair
    copy = tmp_path / "atlas"
    main(["scan", "--model", str(model.source), "--corpus", str(_corpus(tmp_path)), "--out", str(copy),
          "--top-k", "3", "--window", "8", "--top-n", "6", "--batch-size", "3", "--quiet"])
    token = int(eager.values(1, 7).token_id.iloc[0])
    atlas = kvmem.open(copy)
    assert not atlas.has_projections
    pd.testing.assert_frame_equal(atlas.top_neurons(token=token, by="value"), eager.top_neurons(token=token, by="value"))
    pd.testing.assert_frame_equal(atlas.table("keys"), eager.table("keys"))
    assert not atlas.has_projections  # read from the cache; the atlas directory is left as it was

    orphan = tmp_path / "orphan"  # the same atlas, its model gone
    shutil.copytree(copy, orphan)
    manifest = json.loads((orphan / "manifest.json").read_text())
    manifest["model"]["name"] = str(tmp_path / "no-such-model")
    (orphan / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(kvmem.KvmemError, match=rf"holds no projection tables.*cannot load here.*kvmem project --atlas "
                                               rf"{orphan}") as error:
        kvmem.open(orphan).top_neurons(token=token, by="value")
    assert "\n" not in str(error.value)
    with pytest.raises(kvmem.KvmemError, match=rf"holds no keys table .*kvmem project --atlas {orphan}") as error:
        kvmem.open(orphan).table("keys")
    assert "\n" not in str(error.value)

    assert main(["project", "--atlas", str(copy), "--quiet"]) == 0
    for table in ("values", "keys"):
        written = (copy / f"{table}.parquet").read_bytes()
        assert written == (eager.path / f"{table}.parquet").read_bytes(), table
    reopened = kvmem.open(copy)
    assert reopened.has_projections and reopened.manifest.projection["method"] == "torch-screen"
    assert reopened.top_neurons(token=token, by="value").shape[0] >= 1
    assert main(["project", "--atlas", str(copy), "--quiet"]) == 0  # nothing to do the second time


def test_token_queries_compute_only_what_they_read(pair, tmp_path, monkeypatch):
    """From an empty projection cache, a lazy atlas answers ``top --by trigger`` with no projection at all, and
    ``top --by value`` with the default convention's values a layer at a time (kept for the next command), never the
    keys or the other convention; both answers equal the eager atlas's."""
    model, eager, lazy = pair
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVMEM_CACHE", str(cache))
    atlas = kvmem.open(lazy.path, model=model)
    triggers = eager.table("triggers", ["kind", "next_token"])
    text = triggers[triggers.kind == "top"].next_token.value_counts().index[0]  # a token many top triggers precede
    pd.testing.assert_frame_equal(atlas.top_neurons(token=text, by="trigger"), eager.top_neurons(token=text, by="trigger"))
    with pytest.raises(kvmem.KvmemError, match="is not a token seen in this atlas"):
        atlas.top_neurons(token="no such token", by="trigger")
    assert not (cache / "projections").exists()
    promoted = eager.values(1, 7)
    promoted = promoted[(promoted.kind == "promote") & (promoted.convention == eager.default_convention)].token.iloc[0]
    for token in (text, promoted):
        pd.testing.assert_frame_equal(atlas.top_neurons(token=token, by="value"), eager.top_neurons(token=token, by="value"))
    kept = sorted(path.name for path in (cache / "projections" / "layers").iterdir())
    assert len(kept) == len(atlas.layers) and all(name.endswith(f"-values-{atlas.default_convention}") for name in kept)
    assert [path.name for path in (cache / "projections").iterdir()] == ["layers"]


def test_another_models_weights_are_refused(pair, gpt2_model, llama_model):
    model, _, lazy = pair
    other = llama_model if model is gpt2_model else gpt2_model
    with pytest.raises(kvmem.KvmemError, match="is not the scanned model"):
        lazy.values(0, 0, model=other)


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(SHORT_DOCS))
    return path
