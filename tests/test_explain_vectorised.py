"""The array path of the tokens explainer and judge (kvmem.autointerp.vectorised) against the per-side path.

The per-side path builds one Example at a time from the atlas's per-neuron queries
(kvmem.autointerp.evidence.load_evidence), fits each rule with Counters, answers each query with
Rule.fires and bootstraps each score alone. Switching off the array path (no contexts table seen)
sends kvmem.explain and kvmem.score through it; both must store exactly the same table.
"""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest

import kvmem
from kvmem.autointerp import api, bulk, scoring, store
from kvmem.autointerp.scorers.intervals import (
    balanced_accuracy_from,
    bootstrap,
    bootstrap_many,
    moment_sums,
    pearson_from,
)


@pytest.fixture(scope="module")
def gated_atlas_source(llama_model, tmp_path_factory):
    """Both layers of the tiny random-init Llama (SwiGLU: two sides per neuron) over 1,500 pydoc tokens."""
    from pydoc_data.topics import topics

    base = tmp_path_factory.mktemp("explain-gated")
    corpus = base / "pydoc.txt"
    corpus.write_text("\n\n".join(topics[k] for k in sorted(topics)[:10]))
    kvmem.scan(llama_model, corpus, out=base / "atlas", unit="paragraph", window=32, max_tokens=1500, top_k=12,
               random_samples=60, progress=False)
    return base / "atlas"


def _run(atlas_dir, *, seed: int, held_out: float):
    atlas = kvmem.open(atlas_dir)
    kvmem.explain(atlas, neurons=[(layer, n) for layer in atlas.layers for n in range(0, atlas.d_ff, 3)], seed=seed,
                  held_out=held_out)
    returned = kvmem.score(atlas_dir, scorers="detection,fuzzing,simulation,output", n_boot=300, seed=seed + 1)
    first = store.read(atlas_dir)
    fewer = kvmem.score(atlas_dir, scorers="simulation,detection,output", n_boot=200, per_band=3, max_quiet=4,
                        neurons=[(layer, n) for layer in atlas.layers for n in range(0, atlas.d_ff, 6)])
    assert (fewer.detection_n <= 5 * 3 + 4).all() and (fewer.simulation_n <= 3 + 4).all()
    return first, returned, store.read(atlas_dir), fewer


@pytest.mark.parametrize("which", ["gelu", "gated"])
def test_array_path_stores_exactly_what_the_per_side_path_stores(which, explain_atlas_source, gated_atlas_source,
                                                                tmp_path, monkeypatch):
    source = explain_atlas_source if which == "gelu" else gated_atlas_source
    fast_dir, slow_dir = tmp_path / "fast", tmp_path / "slow"
    for target in (fast_dir, slow_dir):
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("explanations*"))
    per_side = []
    one_side_at_a_time = scoring._score_sides
    monkeypatch.setattr(scoring, "_score_sides", lambda *a, **k: per_side.append(1) or one_side_at_a_time(*a, **k))
    fast, fast_returned, fast_fewer, fast_fewer_returned = _run(fast_dir, seed=2, held_out=0.4)
    assert not per_side  # every scorer of the tokens judge took the array path

    calls = []
    per_neuron = bulk.load_evidence
    monkeypatch.setattr(api, "read_contexts", lambda atlas: None)
    monkeypatch.setattr(scoring, "read_contexts", lambda atlas: None)
    monkeypatch.setattr(bulk, "read_contexts", lambda atlas: None)
    monkeypatch.setattr(bulk, "load_evidence", lambda *a, **k: calls.append(a[1:3]) or per_neuron(*a, **k))
    slow, slow_returned, slow_fewer, slow_fewer_returned = _run(slow_dir, seed=2, held_out=0.4)

    atlas = kvmem.open(source)
    chosen = len(atlas.layers) * len(range(0, atlas.d_ff, 3))
    assert len(calls) == 2 * chosen + len(fast_fewer_returned) // (2 if which == "gated" else 1)  # one at a time
    assert len(fast) == chosen * (2 if which == "gated" else 1)
    if which == "gated":
        assert set(fast.side) == {"positive", "negative"}
    for name in ("detection", "fuzzing", "simulation", "output"):
        assert fast[name].notna().mean() > 0.9 and fast[f"{name}_baseline"].notna().mean() > 0.9
        assert fast[f"{name}_p"].notna().mean() > 0.9 and fast[f"{name}_diff_low"].notna().mean() > 0.9
        assert (fast[f"{name}_status"] == "ok").mean() > 0.9
    assert fast.explain_codes.map(len).min() > 0 and fast.detection_codes.map(len).min() > 0
    pd.testing.assert_frame_equal(fast, slow, check_exact=True)
    pd.testing.assert_frame_equal(fast_returned, slow_returned, check_exact=True, check_dtype=False)
    pd.testing.assert_frame_equal(fast_fewer, slow_fewer, check_exact=True)
    pd.testing.assert_frame_equal(fast_fewer_returned, slow_fewer_returned, check_exact=True, check_dtype=False)


def test_bootstrap_many_equals_one_bootstrap_per_task():
    rng = np.random.default_rng(0)
    tasks = []
    for n in (1, 5, 5, 30, 30, 30, 7):
        tasks.append(np.eye(4)[rng.integers(0, 4, size=n)])  # one confusion cell per example
    tasks.append(np.zeros((0, 4)))
    tasks.append(np.array([[1.0, 0, 0, 0]] * 6))  # one class only: every replicate NaN
    tasks.append(np.array([[1.0, 0, 0, 0]] * 5 + [[0, 0, 1.0, 0]]))  # some replicates NaN (no negative drawn)
    low, high = bootstrap_many(balanced_accuracy_from, tasks, n_boot=400, seed=3, exact_sums=True, batch=2)
    for i, sums in enumerate(tasks):
        np.testing.assert_array_equal([low[i], high[i]], bootstrap(balanced_accuracy_from, sums, n_boot=400, seed=3))
    assert np.isnan([low[-3], low[-2]]).all() and np.isfinite(low[-1])
    moments = []
    for n in (3, 30, 30, 12):
        tokens = rng.integers(1, 9, size=n)
        groups = np.repeat(np.arange(n), tokens)
        x = rng.integers(0, 2, size=len(groups)) * 10.0
        moments.append(moment_sums(x, x * rng.random() + rng.normal(size=len(groups)), groups))
    moments.append(moment_sums(np.zeros(8), np.arange(8.0), np.arange(8)))  # a constant prediction: r = 0
    low, high = bootstrap_many(pearson_from, moments, n_boot=300, seed=1)
    for i, sums in enumerate(moments):
        np.testing.assert_array_equal([low[i], high[i]], bootstrap(pearson_from, sums, n_boot=300, seed=1))
    assert np.isfinite(low[:4]).all() and (low[:4] < high[:4]).all() and (low[4], high[4]) == (0.0, 0.0)
