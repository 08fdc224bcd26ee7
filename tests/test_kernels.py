"""The numba backend (kvmem/scanning/backends/numba_backend.py) against numpy brute force, and
against the torch backend: the same state, tensor for tensor, after many batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmem.errors import KvmemError
from kvmem.scanning.backends import ENV, select_backend
from kvmem.scanning.histogram import HIST_BINS, reference_bin
from kvmem.scanning.rules import BLOCK_ROWS, KEY_BITS, key_of, key_salt, position_keys
from kvmem.scanning.state import new_layer_state
from kvmem.scanning.step import close_open_document, fold_batch

NUMBA = select_backend("cpu", "numba")
TORCH = select_backend("cpu", "torch")


@pytest.fixture(autouse=True)
def numba_is_usable():
    """numba is a dependency (pyproject.toml): where it cannot load, every test here fails, none skips."""
    assert NUMBA.name == "numba", "the numba backend did not load (see the RuntimeWarning above); kvmem needs it"


def special_values(rng, n: int, d_ff: int) -> np.ndarray:
    values = (rng.standard_normal((n, d_ff)) * rng.choice([1e-3, 0.1, 1, 50, 300], (n, d_ff))).astype(np.float32)
    picks = rng.random((n, d_ff))
    values[picks < 0.05] = 0.0
    values[(picks >= 0.05) & (picks < 0.1)] = -0.0
    values[(picks >= 0.1) & (picks < 0.12)] = np.float32(1e-40)  # subnormal, > 0
    values[(picks >= 0.12) & (picks < 0.14)] = np.float32(-1e-40)
    values[(picks >= 0.14) & (picks < 0.15)] = 2.0**-7  # a bin edge
    return values


@pytest.mark.parametrize("n, d_ff", [(70, 200), (1, 3), (64, 128), (33, 257)])
def test_batch_statistics_equal_numpy(n, d_ff):
    rng = np.random.default_rng(n * 1000 + d_ff)
    values = special_values(rng, n, d_ff)
    histogram = torch.full((d_ff, HIST_BINS), 7, dtype=torch.int64)  # added to, not overwritten
    positive = torch.full((d_ff,), 3, dtype=torch.int64)
    got = NUMBA.statistics(torch.from_numpy(values), histogram, positive)
    want = np.full((d_ff, HIST_BINS), 7, np.int64)
    for (_, neuron), value in np.ndenumerate(values):
        want[neuron, reference_bin(float(value))] += 1
    np.testing.assert_array_equal(histogram.numpy(), want)
    np.testing.assert_array_equal(positive.numpy(), 3 + (values > 0).sum(0))
    blocks = [values[b:b + BLOCK_ROWS] for b in range(0, n, BLOCK_ROWS)]
    np.testing.assert_array_equal(got.low.numpy(), np.stack([b.min(0) for b in blocks]))
    np.testing.assert_array_equal(got.high.numpy(), np.stack([b.max(0) for b in blocks]))
    wide = values.astype(np.float64)
    np.testing.assert_allclose(got.total.numpy(), wide.sum(0), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(got.total_sq.numpy(), (wide * wide).sum(0), rtol=1e-12, atol=1e-300)


def stream_batches(rng, n_docs: int, d_ff: int, *, shuffled: bool, integer: bool):
    """Batches (acts, codes, docs, keys, ordered) of documents cut at random rows."""
    lengths = rng.integers(1, 40, n_docs)
    order = rng.permutation(n_docs) if shuffled else np.arange(n_docs)
    rows = [(doc, pos) for doc in order for pos in range(lengths[doc])]
    values = (rng.integers(-4, 5, (len(rows), d_ff)) if integer else rng.standard_normal((len(rows), d_ff)))
    values = values.astype(np.float32)
    cuts = sorted(rng.choice(np.arange(1, len(rows)), 6, replace=False).tolist())
    for a, b in zip([0, *cuts], [*cuts, len(rows)]):
        codes = torch.tensor([(int(doc) << 32) | pos for doc, pos in rows[a:b]])
        docs = torch.tensor([int(doc) for doc, _ in rows[a:b]])
        yield torch.from_numpy(values[a:b]), codes, docs, position_keys(codes, 0), not shuffled


def scan_state(batches, d_ff: int, backend=NUMBA):
    state = new_layer_state(d_ff, 6, per_document=True, context_width=3, random_samples=5, bin_samples=3,
                            sample_rate=0.5)
    for acts, codes, docs, keys, ordered in batches:
        def context_fn(rows, neurons, a=acts, c=codes):  # identifies (position, neuron)
            return torch.stack([a[rows, neurons], (c[rows] % 4096).float(), neurons.float()], dim=1)
        fold_batch(backend, state, acts, codes, context_fn, docs=docs, keys=keys, ordered=ordered)
    close_open_document(backend, state)
    return state


def state_tensors(state) -> dict[str, torch.Tensor]:
    tensors, _ = state.to_tensors("layer")
    tensors["layer.random.context"] = state.random.context
    for name, side in state.sides().items():
        tensors[f"layer.{name}.context"] = side.context
    return tensors


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("integer", [False, True])
def test_compiled_state_equals_torch_state(shuffled, integer):
    """Every table of the state (kept triggers with their context, per-document bests, histograms,
    counts, both samples) is the same to the bit. The sums: the kernel's to float64 rounding of
    numpy's, the torch path's (float32 blocks of 32 rows) to its stated bound, 32·2⁻²⁴·Σ|m|."""
    d_ff = 150
    batches = list(stream_batches(np.random.default_rng(int(shuffled) * 2 + int(integer)), 60, d_ff,
                                  shuffled=shuffled, integer=integer))
    compiled = state_tensors(scan_state(batches, d_ff, NUMBA))
    reference = state_tensors(scan_state(batches, d_ff, TORCH))
    assert compiled.keys() == reference.keys()
    values = torch.cat([b[0] for b in batches]).double().numpy()
    for name, want in reference.items():
        if name.endswith(("total", "total_sq")):
            exact = values if name.endswith("total") else values * values
            np.testing.assert_allclose(compiled[name].sum(0).numpy(), exact.sum(0), rtol=1e-13, atol=1e-12)
            bound = 32 * 2.0**-24 * np.abs(exact).sum(0)
            assert (np.abs(want.sum(0).numpy() - exact.sum(0)) <= bound).all()
        else:
            assert torch.equal(compiled[name].nan_to_num(123.0), want.nan_to_num(123.0)), name


@pytest.mark.parametrize("ordered", [True, False])
def test_a_dense_first_batch_keeps_the_brute_force_sides(ordered):
    """A first batch of many more blocks than k, into empty sides: the kept entries are the k first by the
    tie rule (value, then the lowest code), with heavy ties, as numpy sorts them, on both backends, and
    each entry's context is its own."""
    rng = np.random.default_rng(3 + ordered)
    n, d_ff, k = 1000, 40, 6
    acts = torch.from_numpy(rng.integers(-3, 4, (n, d_ff)).astype(np.float32))
    acts[:, 0] = torch.from_numpy(rng.standard_normal(n).astype(np.float32))  # and one neuron without ties
    codes = torch.arange(n, dtype=torch.int64) * 7 + 100
    if not ordered:
        codes = codes[torch.from_numpy(rng.permutation(n))]
    context_fn = lambda rows, neurons: torch.stack([codes[rows].float(), neurons.float()], dim=1)  # noqa: E731
    states = {}
    for backend in (NUMBA, TORCH):
        states[backend.name] = state = new_layer_state(d_ff, k, per_document=False, context_width=2)
        fold_batch(backend, state, acts, codes, context_fn, ordered=ordered)
    for name, largest in (("top", True), ("bottom", False)):
        for neuron in range(d_ff):
            values, order_codes = acts[:, neuron].numpy(), codes.numpy()
            best = np.lexsort((order_codes, -values if largest else values))[:k]
            for backend, state in states.items():
                side = getattr(state, name)
                np.testing.assert_array_equal(side.codes[:, neuron].numpy(), order_codes[best], err_msg=backend)
                np.testing.assert_array_equal(side.values[:, neuron].numpy(), values[best], err_msg=backend)
                np.testing.assert_array_equal(side.context[:, neuron, 0].numpy(), order_codes[best].astype(np.float32))


@pytest.mark.parametrize("backend", [NUMBA, TORCH], ids=["numba", "torch"])
def test_bin_samples_equal_brute_force(backend):
    """Each (neuron, bin) keeps the q positions with the smallest (key, code) among those whose
    key is under the rate and whose coefficient falls in the bin."""
    rng = np.random.default_rng(11)
    d_ff, q, rate = 40, 3, 0.5
    batches = list(stream_batches(rng, 80, d_ff, shuffled=True, integer=False))
    state = new_layer_state(d_ff, 2, per_document=False, context_width=1, bin_samples=q, sample_rate=rate)
    for acts, codes, _, keys, ordered in batches:
        fold_batch(backend, state, acts, codes, lambda rows, neurons: torch.zeros(rows.numel(), 1), keys=keys,
                   ordered=ordered)
    acts = torch.cat([b[0] for b in batches]).numpy()
    codes = torch.cat([b[1] for b in batches]).numpy()
    keys = torch.cat([b[3] for b in batches]).numpy()
    under = keys < int(rate * (1 << KEY_BITS))
    for neuron in range(d_ff):
        bins = np.array([reference_bin(float(v)) for v in acts[:, neuron]])
        for b in range(HIST_BINS):
            chosen = np.flatnonzero(under & (bins == b))
            chosen = chosen[np.lexsort((codes[chosen], keys[chosen]))][:q]
            want = np.full(q, -1, np.int64)
            want[:chosen.size] = codes[chosen]
            np.testing.assert_array_equal(state.bins.codes[neuron, b].numpy(), want)
            np.testing.assert_array_equal(state.bins.values[neuron, b, :chosen.size].numpy(), acts[chosen, neuron])


@pytest.mark.parametrize("backend", [NUMBA, TORCH], ids=["numba", "torch"])
def test_window_context_equals_brute_force(backend):
    """Entry i reads neuron neurons[i] at rows rows[i] + step, NaN wherever that row leaves the
    entry's own window (windows of uneven lengths, entries at both edges, repeated entries, none)."""
    rng = np.random.default_rng(5)
    lengths = [1, 7, 3, 12, 2]
    n, d_ff = sum(lengths), 9
    acts = special_values(rng, n, d_ff)
    first = np.repeat(np.cumsum([0] + lengths[:-1]), lengths)
    end = first + np.repeat(lengths, lengths)
    steps = np.arange(-4, 5)
    rows = np.concatenate([np.arange(n), rng.integers(0, n, 40)])
    neurons = rng.integers(0, d_ff, len(rows))
    want = np.full((len(rows), len(steps)), np.nan, np.float32)
    for i, (row, neuron) in enumerate(zip(rows, neurons)):
        for j, step in enumerate(steps):
            if first[row] <= row + step < end[row]:
                want[i, j] = acts[row + step, neuron]
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    got = backend.window_context(torch.from_numpy(acts), as_tensor(rows), as_tensor(neurons), as_tensor(steps),
                                 as_tensor(first), as_tensor(end))
    assert got.dtype == torch.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32))  # the bits, -0.0 and NaN included
    empty = backend.window_context(torch.from_numpy(acts), as_tensor([]), as_tensor([]), as_tensor(steps),
                                   as_tensor(first), as_tensor(end))
    assert empty.shape == (0, len(steps))
    # extras (the gate and up of gated FFNs): each entry's own value of each, after the window
    extras = np.stack([special_values(rng, n, d_ff), special_values(rng, n, d_ff)])
    got = backend.window_context(torch.from_numpy(acts), as_tensor(rows), as_tensor(neurons), as_tensor(steps),
                                 as_tensor(first), as_tensor(end), torch.from_numpy(extras))
    want = np.concatenate([want, extras[:, rows, neurons].T], axis=1)
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32))
    only = backend.window_context(torch.from_numpy(acts), as_tensor(rows), as_tensor(neurons), as_tensor(steps[:0]),
                                  as_tensor(first), as_tensor(end), torch.from_numpy(extras))  # no context, extras only
    np.testing.assert_array_equal(only.numpy().view(np.int32), want[:, len(steps):].view(np.int32))


def test_compiled_key_hash_equals_position_keys():
    """The kernel's splitmix64 (in uint64) and position_keys (in int64 torch ops) agree, seeds included."""
    codes = torch.tensor([0, 1, 5, (7 << 32) | 3, (1 << 40) + 12345, (1 << 62) - 1])
    for seed in (0, 1, 12345):
        state = new_layer_state(1, 1, per_document=False, context_width=1, bin_samples=len(codes), sample_rate=1.0,
                                seed=seed)
        acts = torch.ones(len(codes), 1)  # one bin: the kernel orders the entries by its own hash
        fold_batch(NUMBA, state, acts, codes, lambda rows, neurons: torch.zeros(rows.numel(), 1),
                   keys=position_keys(codes, seed), ordered=True)
        kept = state.bins.codes[0].reshape(-1)
        kept = kept[kept >= 0]
        want = codes[torch.argsort(position_keys(codes, seed), stable=True)]
        assert torch.equal(kept, want)
        assert int(state.bins.last_keys[reference_bin(1.0), 0]) == int(position_keys(codes, seed).max())  # the q-th key
        with np.errstate(over="ignore"):  # the rule's scalar spelling, in plain Python
            scalar = [int(key_of(np.int64(c), np.uint64(key_salt(seed)))) for c in codes.tolist()]
        assert scalar == position_keys(codes, seed).tolist()


def test_backend_chosen_by_environment_and_name(monkeypatch):
    """KVMEM_KERNELS picks the backend, a name given beats it, a bad name or numba off the CPU is one line."""
    monkeypatch.setenv(ENV, "torch")
    assert select_backend("cpu").name == "torch"
    assert select_backend("cpu", "numba").name == "numba"
    monkeypatch.setenv(ENV, "numba")
    assert select_backend("cpu").name == "numba"
    monkeypatch.delenv(ENV)
    assert select_backend("cpu").name == "numba" and select_backend("meta").name == "torch"
    monkeypatch.setenv(ENV, "cuda-kernels")
    with pytest.raises(KvmemError, match="unknown KVMEM_KERNELS 'cuda-kernels'; choose one of torch, numba"):
        select_backend("cpu")
    with pytest.raises(KvmemError, match="numba backend runs on the CPU only"):
        select_backend("meta", "numba")
    histogram = torch.zeros(4, HIST_BINS, dtype=torch.int64)
    stats = select_backend("cpu", "torch").statistics(torch.ones(3, 4), histogram, torch.zeros(4, dtype=torch.int64))
    assert stats.total.tolist() == [3.0] * 4 and int(histogram.sum()) == 12


def test_kernels_load_from_the_disk_cache(tmp_path):
    """A second process loads every kernel from numba's cache instead of compiling it again
    (kernels that call compiled helpers held in closures are recompiled in every process: seconds)."""
    import os
    import subprocess
    import sys

    script = ("from kvmem.scanning.backends import select_backend, numba_kernels as k; select_backend('cpu', 'numba'); "
              "kernels = [getattr(k, name) for name in k.__all__]; "
              "print(sum(sum(f.stats.cache_misses.values()) for f in kernels), "
              "sum(sum(f.stats.cache_hits.values()) for f in kernels))")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    misses, hits = map(int, runs[1].stdout.split())
    from kvmem.scanning.backends import numba_kernels

    assert (misses, hits) == (0, len(numba_kernels.__all__)), runs[1].stdout  # every kernel from the cache


CACHE_CANNOT_BE_SAVED = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from kvmem.scanning.backends import select_backend
    chosen = [select_backend("cpu").name, select_backend("cpu").name]
print(json.dumps({"chosen": chosen, "warnings": [str(w.message) for w in caught]}))
"""


def test_a_numba_cache_that_cannot_be_saved_falls_back_with_one_warning(tmp_path):
    """A real fault: in a fresh process whose files may not grow past 16 KiB (RLIMIT_FSIZE, SIGXFSZ
    ignored, so writes fail with EFBIG), numba compiles the kernels into an empty NUMBA_CACHE_DIR and its
    save raises. The selector falls back to the torch backend with exactly one warning, however often it
    is asked."""
    import json
    import os
    import resource
    import signal
    import subprocess
    import sys
    from pathlib import Path

    def no_file_may_grow() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("KVMEM_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", CACHE_CANNOT_BE_SAVED], env=env, capture_output=True, text=True,
                            preexec_fn=no_file_may_grow, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["chosen"] == ["torch", "torch"]
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "compiled CPU kernels are unavailable" in got["warnings"][0] and "NUMBA_CACHE_DIR" in got["warnings"][0]


def test_starting_numba_threads_leaves_torch_thread_count():
    """numba's first parallel call starts its OpenMP pool, which sets the process's OpenMP thread count
    (torch's too) to one per core. The scan's kernels and the projection kernels start it themselves and
    keep the caller's torch count, even above the cores (a fresh process: the pool not yet started)."""
    import subprocess
    import sys

    script = ("import os, torch\n"
              "above = (os.cpu_count() or 1) + 1\n"
              "torch.set_num_threads(above)\n"
              "from kvmem.scanning.backends import select_backend\n"
              "select_backend('cpu', 'numba').prepare()\n"
              "assert torch.get_num_threads() == above, torch.get_num_threads()\n"
              "torch.set_num_threads(above + 1)\n"
              "from kvmem.scanning import projection_kernels\n"
              "projection_kernels.use_threads(1)\n"
              "assert torch.get_num_threads() == above + 1, torch.get_num_threads()\n"
              "import numba\n"
              "assert numba.get_num_threads() == 1\n")
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
