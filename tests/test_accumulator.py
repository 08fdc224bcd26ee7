"""The streaming state against numpy brute force, with codes in any order and many exact ties
(length-sorted batches read documents out of corpus order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmem.scanning.backends import select_backend
from kvmem.scanning.rules import NO_KEY, order_by_key, position_keys
from kvmem.scanning.state import new_layer_state
from kvmem.scanning.step import close_open_document, fold_batch

K, F, WIDTH = 3, 5, 2


@pytest.fixture(params=["numba", "torch"])
def backend(request):
    """Every streaming test runs on the compiled CPU kernels and on the torch backend (a GPU's)."""
    chosen = select_backend("cpu", request.param)
    assert chosen.name == request.param, "numba is a dependency (pyproject.toml) but its backend did not load here"
    return chosen


def stream(order: list[int], lengths: list[int], acts: dict[int, np.ndarray], cuts: list[int]):
    """Rows of documents ``order`` (each contiguous, in position order), cut into batches at ``cuts``;
    yields (acts [n, F], codes [n], docs [n], ordered) as the scan would fold them."""
    rows = [(doc, pos) for doc in order for pos in range(lengths[doc])]
    last = -1
    for a, b in zip([0, *cuts], [*cuts, len(rows)]):
        part = rows[a:b]
        if not part:
            continue
        codes = [(doc << 32) | pos for doc, pos in part]
        ordered = codes[0] > last and codes == sorted(set(codes))
        last = max(last, *codes)
        yield (torch.tensor(np.stack([acts[doc][pos] for doc, pos in part])), torch.tensor(codes),
               torch.tensor([doc for doc, _ in part]), ordered)


def run(backend, order, lengths, acts, cuts, **samples):
    state = new_layer_state(F, K, per_document=True, context_width=WIDTH, **samples)
    for batch_acts, codes, docs, ordered in stream(order, lengths, acts, cuts):
        def context_fn(rows, neurons, a=batch_acts, c=codes):
            return torch.stack([a[rows, neurons], (c[rows] % 1000).float()], dim=1)  # identifies (position, neuron)
        fold_batch(backend, state, batch_acts, codes, context_fn, docs=docs, keys=position_keys(codes, 0),
                   ordered=ordered)
    close_open_document(backend, state)
    return state


def brute_top(values: np.ndarray, codes: np.ndarray, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """[n, F] values, [n] codes -> the k best of each neuron under (value, then lowest code): values, codes [k, F]."""
    out_v, out_c = np.empty((K, F), np.float32), np.empty((K, F), np.int64)
    for j in range(F):
        order = np.lexsort((codes, -values[:, j] if largest else values[:, j]))[:K]
        out_v[:, j], out_c[:, j] = values[order, j], codes[order]
    return out_v, out_c


@pytest.mark.parametrize("seed, n_cuts", [(0, 12), (1, 12), (2, 12), (3, 2), (4, 3)])
def test_any_code_order_equals_brute_force(seed, n_cuts, backend):
    """Few cuts: batches of many documents, so the not-yet-full sides first cut to the batch's k best."""
    rng = np.random.default_rng(seed)
    n_docs = 30
    lengths = rng.integers(1, 9, n_docs).tolist()
    acts = {d: rng.integers(-3, 4, (lengths[d], F)).astype(np.float32) for d in range(n_docs)}  # many exact ties
    n_rows = sum(lengths)
    cuts = sorted(rng.choice(np.arange(1, n_rows), n_cuts, replace=False).tolist())
    in_order = run(backend, list(range(n_docs)), lengths, acts, cuts)
    shuffled = run(backend, sorted(range(n_docs), key=lambda d: (lengths[d], rng.random())), lengths, acts, cuts)
    codes = np.array([(d << 32) | p for d in range(n_docs) for p in range(lengths[d])], np.int64)
    values = np.concatenate([acts[d] for d in range(n_docs)])
    best = {largest: [] for largest in (True, False)}
    for d in range(n_docs):  # each document's best: the most extreme value at its lowest position
        for largest in (True, False):
            v = acts[d].max(0) if largest else acts[d].min(0)
            pos = (acts[d] == v).argmax(0)
            best[largest].append((v, (d << 32) | pos))
    for state in (in_order, shuffled):
        for name, largest in (("top", True), ("bottom", False)):
            side = state.sides()[name]
            want_v, want_c = brute_top(values, codes, largest)
            np.testing.assert_array_equal(side.values.numpy(), want_v)
            np.testing.assert_array_equal(side.codes.numpy(), want_c)
            np.testing.assert_array_equal(side.context[:, :, 0].numpy(), want_v)
            np.testing.assert_array_equal(side.context[:, :, 1].numpy(), (want_c % 1000).astype(np.float32))
        for name, largest in (("top_doc", True), ("bottom_doc", False)):
            side = state.sides()[name]
            doc_v = np.stack([v for v, _ in best[largest]])
            doc_c = np.stack([c for _, c in best[largest]])  # [docs, F]
            for j in range(F):
                order = np.lexsort((doc_c[:, j], -doc_v[:, j] if largest else doc_v[:, j]))[:K]
                np.testing.assert_array_equal(side.values[:, j].numpy(), doc_v[order, j])
                np.testing.assert_array_equal(side.codes[:, j].numpy(), doc_c[order, j])
                # the context is the best position's own (also when it was found in an earlier batch)
                np.testing.assert_array_equal(side.context[:, j, 0].numpy(), doc_v[order, j])
                np.testing.assert_array_equal(side.context[:, j, 1].numpy(), (doc_c[order, j] % 1000).astype(np.float32))
        np.testing.assert_array_equal(state.histogram.numpy(), in_order.histogram.numpy())
        assert state.count == n_rows


def test_samples_do_not_depend_on_code_order(backend):
    rng = np.random.default_rng(5)
    n_docs = 40
    lengths = rng.integers(1, 12, n_docs).tolist()
    acts = {d: rng.normal(size=(lengths[d], F)).astype(np.float32) for d in range(n_docs)}
    cuts = sorted(rng.choice(np.arange(1, sum(lengths)), 15, replace=False).tolist())
    settings = dict(random_samples=7, bin_samples=2, sample_rate=0.5)
    a = run(backend, list(range(n_docs)), lengths, acts, cuts, **settings)
    b = run(backend, sorted(range(n_docs), key=lambda d: (lengths[d], d)), lengths, acts, cuts, **settings)
    assert torch.equal(a.random.codes, b.random.codes) and torch.equal(a.random.values, b.random.values)
    assert torch.equal(a.bins.codes, b.bins.codes)
    assert torch.equal(a.bins.values.nan_to_num(9), b.bins.values.nan_to_num(9))
    assert (a.random.codes >= 0).all()


def test_sample_order_breaks_equal_keys_by_code():
    """Keys are hashes and almost never tie; when two real keys do, the lower code goes first
    (numpy lexsort as the oracle), along either dimension, with empties (code -1) last."""
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 4, (6, 9))  # many equal keys
    codes = rng.permutation(54).reshape(6, 9).astype(np.int64)
    codes[0, 0], keys[0, 0] = -1, NO_KEY  # an empty entry
    for dim in (0, 1):
        got = order_by_key(torch.tensor(keys), torch.tensor(codes), dim).numpy()
        sort_codes = np.where(codes < 0, np.iinfo(np.int64).max, codes)
        for i in range(keys.shape[1 - dim]):
            k = keys[:, i] if dim == 0 else keys[i]
            c = sort_codes[:, i] if dim == 0 else sort_codes[i]
            assert (got[:, i] if dim == 0 else got[i]).tolist() == np.lexsort((c, k)).tolist()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_non_finite_batch_is_flagged(backend, bad):
    """fold_batch's flag (read once per batch by the scan) is False exactly when a coefficient is not finite,
    wherever it sits in a block of rows."""
    rng = np.random.default_rng(0)
    for row in (0, 31, 40):
        state = new_layer_state(F, K, per_document=True, context_width=WIDTH, random_samples=2, bin_samples=1)
        acts = torch.tensor(rng.normal(size=(45, F)).astype(np.float32))
        codes, docs = torch.arange(45), torch.zeros(45, dtype=torch.int64)
        context = lambda rows, neurons: torch.zeros(rows.numel(), WIDTH)  # noqa: E731
        assert bool(fold_batch(backend, state, acts, codes, context, docs=docs, keys=position_keys(codes, 0)))
        acts[row, 2] = bad
        assert not bool(fold_batch(backend, state, acts, codes + 45, context, docs=docs,
                                   keys=position_keys(codes + 45, 0)))
