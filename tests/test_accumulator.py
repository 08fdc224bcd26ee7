"""The streaming statistics against numpy brute force, with codes in any order and many exact ties
(length-sorted batches read documents out of corpus order): the kept sides, per-document bests, samples,
histogram, moments and the window context, as the one torch implementation computes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from layer_driver import fold, new_layer

from kvmem.scanning.bins import HIST_BINS, reference_bin
from kvmem.scanning.ordering import BLOCK_ROWS, KEY_BITS, NO_KEY, order_by_key, position_keys
from kvmem.scanning.statistics.sides import block_extremes
from kvmem.scanning.step import window_context, window_rows

K, F, WIDTH = 3, 5, 2


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


def run(order, lengths, acts, cuts, **samples):
    state = new_layer(F, K, per_document=True, context_width=WIDTH, **samples)
    for batch_acts, codes, docs, ordered in stream(order, lengths, acts, cuts):
        def context_fn(rows, neurons, a=batch_acts, c=codes):
            return torch.stack([a[rows, neurons], (c[rows] % 1000).float()], dim=1)  # identifies (position, neuron)
        fold(state, batch_acts, codes, context_fn, docs=docs, keys=position_keys(codes, 0), ordered=ordered)
    state.close()
    return state


def brute_top(values: np.ndarray, codes: np.ndarray, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """[n, F] values, [n] codes -> the k best of each neuron under (value, then lowest code): values, codes [k, F]."""
    out_v, out_c = np.empty((K, F), np.float32), np.empty((K, F), np.int64)
    for j in range(F):
        order = np.lexsort((codes, -values[:, j] if largest else values[:, j]))[:K]
        out_v[:, j], out_c[:, j] = values[order, j], codes[order]
    return out_v, out_c


@pytest.mark.parametrize("seed, n_cuts", [(0, 12), (1, 12), (2, 12), (3, 2), (4, 3)])
def test_any_code_order_equals_brute_force(seed, n_cuts):
    """Few cuts: batches of many documents, so the not-yet-full sides first cut to the batch's k best."""
    rng = np.random.default_rng(seed)
    n_docs = 30
    lengths = rng.integers(1, 9, n_docs).tolist()
    acts = {d: rng.integers(-3, 4, (lengths[d], F)).astype(np.float32) for d in range(n_docs)}  # many exact ties
    n_rows = sum(lengths)
    cuts = sorted(rng.choice(np.arange(1, n_rows), n_cuts, replace=False).tolist())
    in_order = run(list(range(n_docs)), lengths, acts, cuts)
    shuffled = run(sorted(range(n_docs), key=lambda d: (lengths[d], rng.random())), lengths, acts, cuts)
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
        np.testing.assert_array_equal(state["histogram"].counts.numpy(), in_order["histogram"].counts.numpy())
        assert state["moments"].count == n_rows


def test_samples_do_not_depend_on_code_order():
    rng = np.random.default_rng(5)
    n_docs = 40
    lengths = rng.integers(1, 12, n_docs).tolist()
    acts = {d: rng.normal(size=(lengths[d], F)).astype(np.float32) for d in range(n_docs)}
    cuts = sorted(rng.choice(np.arange(1, sum(lengths)), 15, replace=False).tolist())
    settings = dict(random_samples=7, bin_samples=2, sample_rate=0.5)
    a = run(list(range(n_docs)), lengths, acts, cuts, **settings)["samples"]
    b = run(sorted(range(n_docs), key=lambda d: (lengths[d], d)), lengths, acts, cuts, **settings)["samples"]
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
def test_non_finite_batch_is_flagged(bad):
    """fold_batch's flag (read once per batch by the scan) is False exactly when a coefficient is not finite,
    wherever it sits in a block of rows."""
    rng = np.random.default_rng(0)
    for row in (0, 31, 40):
        state = new_layer(F, K, per_document=True, context_width=WIDTH, random_samples=2, bin_samples=1)
        acts = torch.tensor(rng.normal(size=(45, F)).astype(np.float32))
        codes, docs = torch.arange(45), torch.zeros(45, dtype=torch.int64)
        context = lambda rows, neurons: torch.zeros(rows.numel(), WIDTH)  # noqa: E731
        assert fold(state, acts, codes, context, docs=docs, keys=position_keys(codes, 0))
        acts[row, 2] = bad
        assert not fold(state, acts, codes + 45, context, docs=docs, keys=position_keys(codes + 45, 0))


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
    """One batch's histogram and #{m > 0} exactly, Σm and Σm² within the float32 blocks' stated bound
    (32·2⁻²⁴·Σ|m|), and the block extremes the candidate search reads."""
    rng = np.random.default_rng(n * 1000 + d_ff)
    values = special_values(rng, n, d_ff)
    state = new_layer(d_ff, 2)
    fold(state, torch.from_numpy(values), torch.arange(n), lambda rows, neurons: torch.zeros(rows.numel(), 1))
    want = np.zeros((d_ff, HIST_BINS), np.int64)
    for (_, neuron), value in np.ndenumerate(values):
        want[neuron, reference_bin(float(value))] += 1
    np.testing.assert_array_equal(state["histogram"].counts.numpy(), want)
    np.testing.assert_array_equal(state["histogram"].positive.numpy(), (values > 0).sum(0))
    low, high = block_extremes(torch.from_numpy(values))
    blocks = [values[b:b + BLOCK_ROWS] for b in range(0, n, BLOCK_ROWS)]
    np.testing.assert_array_equal(low.numpy(), np.stack([b.min(0) for b in blocks]))
    np.testing.assert_array_equal(high.numpy(), np.stack([b.max(0) for b in blocks]))
    total, total_sq = (t.numpy() for t in state["moments"].sums())
    wide = values.astype(np.float64)
    for got, exact in ((total, wide), (total_sq, wide * wide)):
        assert (np.abs(got - exact.sum(0)) <= 32 * 2.0**-24 * np.abs(exact).sum(0) + 1e-300).all()


@pytest.mark.parametrize("ordered", [True, False])
def test_a_dense_first_batch_keeps_the_brute_force_sides(ordered):
    """A first batch of many more blocks than k, into empty sides: the kept entries are the k first by the
    tie rule (value, then the lowest code), with heavy ties, as numpy sorts them, and each entry's context
    is its own."""
    rng = np.random.default_rng(3 + ordered)
    n, d_ff, k = 1000, 40, 6
    acts = torch.from_numpy(rng.integers(-3, 4, (n, d_ff)).astype(np.float32))
    acts[:, 0] = torch.from_numpy(rng.standard_normal(n).astype(np.float32))  # and one neuron without ties
    codes = torch.arange(n, dtype=torch.int64) * 7 + 100
    if not ordered:
        codes = codes[torch.from_numpy(rng.permutation(n))]
    context_fn = lambda rows, neurons: torch.stack([codes[rows].float(), neurons.float()], dim=1)  # noqa: E731
    state = new_layer(d_ff, k, context_width=2)
    fold(state, acts, codes, context_fn, ordered=ordered)
    for name, largest in (("top", True), ("bottom", False)):
        side = state.sides()[name]
        for neuron in range(d_ff):
            values, order_codes = acts[:, neuron].numpy(), codes.numpy()
            best = np.lexsort((order_codes, -values if largest else values))[:k]
            np.testing.assert_array_equal(side.codes[:, neuron].numpy(), order_codes[best])
            np.testing.assert_array_equal(side.values[:, neuron].numpy(), values[best])
            np.testing.assert_array_equal(side.context[:, neuron, 0].numpy(), order_codes[best].astype(np.float32))


def test_bin_samples_equal_brute_force():
    """Each (neuron, bin) keeps the q positions with the smallest (key, code) among those whose
    key is under the rate and whose coefficient falls in the bin."""
    rng = np.random.default_rng(11)
    d_ff, q, rate = 40, 3, 0.5
    lengths = rng.integers(1, 40, 80)
    rows = [(int(doc), pos) for doc in rng.permutation(80) for pos in range(lengths[doc])]
    values = rng.standard_normal((len(rows), d_ff)).astype(np.float32)
    all_codes = np.array([(doc << 32) | pos for doc, pos in rows], np.int64)
    state = new_layer(d_ff, 2, bin_samples=q, sample_rate=rate)
    cuts = sorted(rng.choice(np.arange(1, len(rows)), 6, replace=False).tolist())
    for a, b in zip([0, *cuts], [*cuts, len(rows)]):
        codes = torch.from_numpy(all_codes[a:b])
        fold(state, torch.from_numpy(values[a:b]), codes, lambda r, n: torch.zeros(r.numel(), 1),
             keys=position_keys(codes, 0), ordered=False)
    keys = position_keys(torch.from_numpy(all_codes), 0).numpy()
    under = keys < int(rate * (1 << KEY_BITS))
    bins_kept = state["samples"].bins
    for neuron in range(d_ff):
        bins = np.array([reference_bin(float(v)) for v in values[:, neuron]])
        for b in range(HIST_BINS):
            chosen = np.flatnonzero(under & (bins == b))
            chosen = chosen[np.lexsort((all_codes[chosen], keys[chosen]))][:q]
            want = np.full(q, -1, np.int64)
            want[:chosen.size] = all_codes[chosen]
            np.testing.assert_array_equal(bins_kept.codes[neuron, b].numpy(), want)
            np.testing.assert_array_equal(bins_kept.values[neuron, b, :chosen.size].numpy(), values[chosen, neuron])


def _windows(rng):
    """(acts [n, 9] of special values, each row's window bounds first and end [n] over windows of uneven
    lengths, context steps -4..4)."""
    lengths = [1, 7, 3, 12, 2]
    acts = special_values(rng, sum(lengths), 9)
    first = np.repeat(np.cumsum([0] + lengths[:-1]), lengths)
    return acts, first, first + np.repeat(lengths, lengths), np.arange(-4, 5)


def test_window_context_equals_brute_force():
    """Entry i reads neuron neurons[i] at rows rows[i] + step, NaN wherever that row leaves the
    entry's own window (windows of uneven lengths, entries at both edges, repeated entries, none)."""
    rng = np.random.default_rng(5)
    acts, first, end, steps = _windows(rng)
    n, d_ff = acts.shape
    rows = np.concatenate([np.arange(n), rng.integers(0, n, 40)])
    neurons = rng.integers(0, d_ff, len(rows))
    want = np.full((len(rows), len(steps)), np.nan, np.float32)
    for i, (row, neuron) in enumerate(zip(rows, neurons)):
        for j, step in enumerate(steps):
            if first[row] <= row + step < end[row]:
                want[i, j] = acts[row + step, neuron]
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    got = window_context(torch.from_numpy(acts), as_tensor(rows), as_tensor(neurons), as_tensor(steps),
                         as_tensor(first), as_tensor(end))
    assert got.dtype == torch.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32))  # the bits, -0.0 and NaN included
    empty = window_context(torch.from_numpy(acts), as_tensor([]), as_tensor([]), as_tensor(steps),
                           as_tensor(first), as_tensor(end))
    assert empty.shape == (0, len(steps))
    # extras (the gate and up of gated FFNs): each entry's own value of each, after the window
    extras = np.stack([special_values(rng, n, d_ff), special_values(rng, n, d_ff)])
    got = window_context(torch.from_numpy(acts), as_tensor(rows), as_tensor(neurons), as_tensor(steps),
                         as_tensor(first), as_tensor(end), torch.from_numpy(extras))
    want = np.concatenate([want, extras[:, rows, neurons].T], axis=1)
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32))
    only = window_context(torch.from_numpy(acts), as_tensor(rows), as_tensor(neurons), as_tensor(steps[:0]),
                          as_tensor(first), as_tensor(end), torch.from_numpy(extras))  # no context, extras only
    np.testing.assert_array_equal(only.numpy().view(np.int32), want[:, len(steps):].view(np.int32))


def test_window_rows_equal_brute_force():
    """Row i holds every neuron at rows rows[i] + step, NaN wherever that row leaves the row's own window,
    then the extras' rows (the random sample's context, laid out as whole rows)."""
    rng = np.random.default_rng(6)
    acts, first, end, steps = _windows(rng)
    n, d_ff = acts.shape
    rows = np.concatenate([np.arange(n), rng.integers(0, n, 10)])
    extras = np.stack([special_values(rng, n, d_ff), special_values(rng, n, d_ff)])
    want = np.full((len(rows), len(steps) + 2, d_ff), np.nan, np.float32)
    for i, row in enumerate(rows):
        for j, step in enumerate(steps):
            if first[row] <= row + step < end[row]:
                want[i, j] = acts[row + step]
        want[i, len(steps):] = extras[:, row]
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    got = window_rows(torch.from_numpy(acts), as_tensor(rows), as_tensor(steps), as_tensor(first), as_tensor(end),
                      torch.from_numpy(extras))
    assert got.dtype == torch.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32))  # the bits, -0.0 and NaN included
    plain = window_rows(torch.from_numpy(acts), as_tensor(rows), as_tensor(steps), as_tensor(first), as_tensor(end))
    np.testing.assert_array_equal(plain.numpy().view(np.int32), want[:, :len(steps)].view(np.int32))
