"""The one state merge: the streaming states of two shards, merged, hold exactly what brute force says
one stream over the whole corpus holds (histograms, random sample, bin samples, moments, top-k).

Public functions only: ``kvmem.scanning.runner.stream`` (the pass alone) and ``ScanState.merge``
(which merges each layer's states, one statistic at a time, ``LayerState.merge``). Oracles: HF forwards
with a down-projection pre-hook, bins from the documented edges, the sampling keys re-derived in
plain Python integers (tests/hf_oracle.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SHORT_DOCS
from hf_oracle import histogram_bins, positions, sampling_key

from kvmem.scanning.bins import HIST_BINS, bin_edges
from kvmem.scanning.runner import stream

WINDOW = 8
RANDOM = 12  # random sample size, well below the ~150 positions
PER_BIN = 3
SETTINGS = dict(window=WINDOW, top_k=4, batch_size=3, block_documents=2, random_samples=RANDOM,
                bin_samples=PER_BIN, sample_rate=1.0, seed=5, conventions=("raw",))


@pytest.fixture(scope="module")
def states(gpt2_model):
    halves = [stream(gpt2_model, SHORT_DOCS, shard=(i, 2), **SETTINGS) for i in range(2)]
    codes, acts = positions(gpt2_model, SHORT_DOCS, window=WINDOW)
    return halves, codes, acts


def test_shards_are_disjoint_and_cover_the_stream(states):
    (a, b), codes, _ = states
    assert a.tokens > 0 and b.tokens > 0 and a.tokens + b.tokens == len(codes)


def test_merged_histograms_equal_brute_force(states):
    (a, b), codes, acts = states
    merged = a.merge(b)
    edges = bin_edges()
    for layer, m in acts.items():
        expected = np.stack([np.bincount(histogram_bins(m[:, n], edges), minlength=HIST_BINS) for n in range(m.shape[1])])
        state = merged.layer_states[layer]
        assert state["moments"].count == len(codes)
        np.testing.assert_array_equal(state["histogram"].counts.numpy(), expected)
        # and each shard alone counted only its own positions
        assert (a.layer_states[layer]["histogram"].counts.sum(1) == a.tokens).all()


def test_merged_random_sample_is_the_smallest_keys_of_the_whole_stream(states):
    (a, b), codes, acts = states
    keys = [sampling_key(int(c), SETTINGS["seed"]) for c in codes]
    order = sorted(range(len(codes)), key=lambda i: (keys[i], int(codes[i])))[:RANDOM]
    # both shards hold some of the whole stream's sample: a merge that drops either is caught
    for shard in (a, b):
        assert set(codes[order].tolist()) & set(shard.layer_states[1]["samples"].random.codes.tolist())
    merged = a.merge(b)
    for layer, m in acts.items():
        sample = merged.layer_states[layer]["samples"].random
        assert sample.codes.tolist() == codes[order].tolist()
        np.testing.assert_allclose(sample.values.numpy(), m[order], rtol=1e-5, atol=1e-6)


def test_merged_bin_samples_are_the_smallest_keys_of_each_bin(states):
    (a, b), codes, acts = states
    keys = np.array([sampling_key(int(c), SETTINGS["seed"]) for c in codes], dtype=object)
    merged = a.merge(b)
    edges = bin_edges()
    for layer, m in acts.items():
        got = merged.layer_states[layer]["samples"].bins.codes.numpy()  # [F, B, Q]
        for neuron in (0, 9, 200):
            bins = histogram_bins(m[:, neuron], edges)
            for b_ in np.unique(bins):
                rows = sorted(np.flatnonzero(bins == b_).tolist(), key=lambda i: (keys[i], int(codes[i])))[:PER_BIN]
                kept = got[neuron, b_][got[neuron, b_] >= 0].tolist()
                assert kept == codes[rows].tolist(), (layer, neuron, b_)


def test_merged_moments_and_triggers_equal_brute_force(states):
    (a, b), codes, acts = states
    merged = a.merge(b)
    for layer, m in acts.items():
        state = merged.layer_states[layer]
        total, total_sq = state["moments"].sums()
        m64 = m.astype(np.float64)
        np.testing.assert_allclose(total.numpy(), m64.sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(total_sq.numpy(), (m64 ** 2).sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(state["histogram"].positive.numpy(), (m > 0).sum(0))
        for neuron in (3, 250):
            top = np.argsort(-m[:, neuron], kind="stable")[:4]
            assert state["extremes"].top.codes[:, neuron].tolist() == codes[top].tolist()


def test_merge_is_symmetric(states):
    """The order of the two shards does not matter (a, b) vs (b, a): the same layer states."""
    (a, b), _, _ = states
    for layer in a.layers:
        one = a.layer_states[layer].merge(b.layer_states[layer])
        two = b.layer_states[layer].merge(a.layer_states[layer])
        assert one["histogram"].counts.equal(two["histogram"].counts)
        assert one["samples"].random.codes.equal(two["samples"].random.codes)
        assert one["extremes"].top.codes.equal(two["extremes"].top.codes)
        assert one["samples"].bins.codes.equal(two["samples"].bins.codes)
