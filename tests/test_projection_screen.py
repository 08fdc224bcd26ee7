"""The screened projection is exact: its top and bottom n equal a numpy float64 brute force
(tests/projection_oracle.py) to the bit, ties by token id; the screen's error bound holds; the
fall-back runs where the margin is too thin; a row's result does not depend on the rows beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from projection_oracle import exact_scores, top_bottom

from kvmem.errors import KvmemError
from kvmem.scanning.projection_screen import METHOD, prepare_basis, project_rows, screen_bound

ROWS, D, VOCAB, N = 300, 64, 5000, 20  # smollm2's aspect (d << vocab), small


def random_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    vectors = torch.randn(ROWS, D, generator=generator)  # [rows, d]
    basis = torch.randn(D, VOCAB, generator=generator) * 0.3  # [d, vocab]
    assert vectors.shape == (ROWS, D) and basis.shape == (D, VOCAB)
    return vectors, basis


def assert_exact(projection, vectors: torch.Tensor, basis: torch.Tensor, n: int) -> None:
    want = top_bottom(vectors.numpy(), basis.numpy(), n)
    for name, expected in want.items():
        got = getattr(projection, name).numpy()
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        if not np.array_equal(got, expected):
            rows = np.nonzero((got != expected).any(axis=1))[0]
            raise AssertionError(f"{projection.stats.method}: {name} differs in rows {rows[:10].tolist()}")


def test_the_projection_equals_the_float64_brute_force():
    vectors, basis = random_case()
    projection = project_rows(vectors, basis, N, block=128)
    assert_exact(projection, vectors, basis, N)
    assert projection.stats.method == METHOD and projection.stats.rows == ROWS and projection.stats.full_rows == 0
    assert 2 * N <= projection.stats.candidates_per_row < 8 * N  # a screen, not a full rescoring


def test_near_ties_at_the_nth_place():
    """Columns 1 ulp-ish apart from the n-th token's column of chosen rows, so the screen cannot order them."""
    vectors, basis = random_case(1)
    scores = exact_scores(vectors.numpy(), basis.numpy())
    basis = basis.clone()
    free = iter(range(VOCAB - 1, 0, -1))
    for row in (0, 7, 42):
        for largest in (True, False):
            ids = np.lexsort((np.arange(VOCAB), -scores[row] if largest else scores[row]))
            nth = ids[N - 1]
            for scale in (1 + 2.0**-22, 1 - 2.0**-22, 1 + 2.0**-20, 1 - 2.0**-21):
                basis[:, next(free)] = basis[:, nth] * scale
    assert_exact(project_rows(vectors, basis, N), vectors, basis, N)


def test_exact_ties_go_to_the_lowest_token_id():
    vectors, basis = random_case(2)
    basis = basis.clone()
    basis[:, 100:140] = basis[:, 7:8]  # 41 identical columns: more than n of them may tie at the top
    basis[:, 200:230] = -basis[:, 7:8]
    projection = project_rows(vectors, basis, N)
    assert_exact(projection, vectors, basis, N)
    tied = projection.top_ids[(projection.top_ids == 7).any(dim=1)]
    assert len(tied) > 0 and ((tied == 7) | (tied >= 100)).sum() > 0


def test_a_zero_row_falls_back_to_a_full_rescoring():
    vectors, basis = random_case(3)
    vectors = vectors.clone()
    vectors[[4, 9]] = 0.0  # every token ties at 0
    projection = project_rows(vectors, basis, N)
    assert_exact(projection, vectors, basis, N)
    assert projection.stats.full_rows == 2
    assert projection.top_ids[4].tolist() == list(range(N)) == projection.bottom_ids[9].tolist()
    assert projection.top_scores[4].abs().sum() == 0


def test_large_norms_and_a_few_huge_or_tiny_columns():
    vectors, basis = random_case(4)
    vectors, basis = vectors.clone(), basis.clone()
    vectors[:20] *= 1e4  # tokens with very large norms / rows with very large norms
    basis[:, :50] *= torch.logspace(1, 6, 50)
    basis[:, 60:63] *= 1e15  # a few huge columns
    basis[:, 70:80] = 1e-39  # subnormal columns (bfloat16 hardware may flush them)
    vectors[30, :10] = 1e-40
    projection = project_rows(vectors, basis, N)
    assert_exact(projection, vectors, basis, N)


def test_n_larger_than_the_vocabulary_is_clipped():
    vectors, basis = random_case(5)
    basis = basis[:, :30]
    projection = project_rows(vectors[:50], basis, 45)
    assert projection.top_ids.shape == (50, 30)
    assert_exact(projection, vectors[:50], basis, 45)
    assert (projection.top_ids.sort(dim=1).values == torch.arange(30)).all()  # every token, ordered


def test_the_screen_bound_holds_with_room():
    """max |S - r| / eps < 1 for the float32 screen S of every (row, token), r the exact score."""
    vectors, basis = random_case(6)
    vectors, basis = vectors.clone(), basis.clone()
    basis[:, :40] *= torch.logspace(0, 4, 40)
    vectors[5] = 0.0
    prepared = prepare_basis(basis)
    screen = (vectors @ prepared.matrix).double()  # [rows, vocab], what the method screens with
    x, _, beta, tau = screen_bound(vectors, prepared)
    eps = x.double()[:, None] * prepared.norms.double() + beta * screen.abs() + tau.double()[:, None]
    exact = torch.from_numpy(exact_scores(vectors.numpy(), basis.numpy())).double()
    ratio = ((screen - exact).abs() / eps).max().item()
    assert 0 < ratio < 1, ratio


def test_a_basis_prepared_once_serves_many_calls_and_rows_do_not_depend_on_their_neighbours():
    """Rows projected in two calls, one at a time, or in other blocks, give the very bits of one call: what a
    neuron's projection computed on its own (an atlas's rows on demand) relies on."""
    vectors, basis = random_case(8)
    prepared = prepare_basis(basis)
    whole = project_rows(vectors, prepared, N)
    first, second = project_rows(vectors[:100], prepared, N), project_rows(vectors[100:], prepared, N)
    assert first.stats.method == METHOD
    assert_exact(first, vectors[:100], basis, N)
    assert_exact(second, vectors[100:], basis, N)
    for name in ("top_ids", "top_scores", "bottom_ids", "bottom_scores"):
        got = getattr(whole, name)
        assert torch.equal(torch.cat([getattr(first, name), getattr(second, name)]), got)
        for row in (0, 137, ROWS - 1):
            alone = getattr(project_rows(vectors[row:row + 1], prepared, N, block=1), name)[0]
            assert torch.equal(alone.view(torch.int32) if alone.is_floating_point() else alone,
                               got[row].view(torch.int32) if got.is_floating_point() else got[row])


def test_non_finite_weights_get_one_clear_error():
    vectors, basis = random_case(10)
    vectors = vectors.clone()
    vectors[3, 5] = float("nan")
    with pytest.raises(KvmemError, match=r"vectors hold NaN or inf \(1 rows of 300\)"):
        project_rows(vectors, basis, N)


def test_the_screen_stays_exact_when_float32_matmuls_round_their_inputs():
    """torch.set_float32_matmul_precision("medium") lets oneDNN (or TF32 on CUDA) round a float32 GEMM's
    inputs; the screen then widens its bound accordingly."""
    vectors, basis = random_case(11)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        projection = project_rows(vectors, basis, N)
    finally:
        torch.set_float32_matmul_precision(before)
    assert_exact(projection, vectors, basis, N)


def test_the_exact_rescoring_adds_in_index_order_where_the_order_shows():
    """Rows built so that the order of the float64 additions decides the result: (2^60 + c) - 2^60 is 0 in
    index order, c in most others. The rescoring of the screen's candidates equals the oracle's index-order
    sum, token by token, on the CPU."""
    from kvmem.scanning.projection_screen import _exact_gathered

    rng = np.random.default_rng(5)
    d, vocab, rows, m = 6, 400, 150, 12
    vectors = rng.standard_normal((rows, d)).astype(np.float32)
    vectors[::3, 0], vectors[::3, 2] = 2.0**60, -(2.0**60)  # cancel only after the small terms are lost
    basis = rng.integers(-3, 4, (d, vocab)).astype(np.float32)
    basis[0], basis[2] = 1.0, 1.0
    ids = np.sort(rng.integers(0, vocab, (rows, m)), axis=1)
    expected = exact_scores(vectors, basis)
    got = _exact_gathered(torch.from_numpy(vectors), torch.from_numpy(basis.T.copy()), torch.from_numpy(ids),
                          rows_per_step=16).numpy()
    assert np.array_equal(got, np.take_along_axis(expected, ids, 1))
    # another order (the small terms first) keeps them: the test can tell the orders apart
    other = (vectors[:, [1, 3, 4, 5, 0, 2]].astype(np.float64) @ basis[[1, 3, 4, 5, 0, 2]].astype(np.float64))
    assert (other.astype(np.float32)[::3] != expected[::3]).mean() > 0.5
