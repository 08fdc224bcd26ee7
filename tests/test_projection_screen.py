"""The screened projection is exact: every method's top and bottom n equal a numpy float64 brute force
(tests/projection_oracle.py) to the bit, ties by token id; the screen's error bound holds; the
fall-back runs where the margin is too thin; the method is chosen in one place."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from projection_oracle import exact_scores, top_bottom

from kvmem.errors import KvmemError
from kvmem.scanning.projection_screen import (
    ENV,
    EXACT_METHODS,
    METHODS,
    prepare_basis,
    project_rows,
    screen_bound,
    select_method,
)

ROWS, D, VOCAB, N = 300, 64, 5000, 20  # smollm2's aspect (d << vocab), small
EXACT = sorted(EXACT_METHODS)


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


@pytest.mark.parametrize("method", EXACT)
def test_every_exact_method_equals_the_float64_brute_force(method):
    vectors, basis = random_case()
    projection = project_rows(vectors, basis, N, method=method, block=128)
    assert_exact(projection, vectors, basis, N)
    assert projection.stats.method == method and projection.stats.rows == ROWS and projection.stats.full_rows == 0
    assert 2 * N <= projection.stats.candidates_per_row < 8 * N  # a screen, not a full rescoring


@pytest.mark.parametrize("method", EXACT)
def test_near_ties_at_the_nth_place(method):
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
    assert_exact(project_rows(vectors, basis, N, method=method), vectors, basis, N)


@pytest.mark.parametrize("method", EXACT)
def test_exact_ties_go_to_the_lowest_token_id(method):
    vectors, basis = random_case(2)
    basis = basis.clone()
    basis[:, 100:140] = basis[:, 7:8]  # 41 identical columns: more than n of them may tie at the top
    basis[:, 200:230] = -basis[:, 7:8]
    projection = project_rows(vectors, basis, N, method=method)
    assert_exact(projection, vectors, basis, N)
    tied = projection.top_ids[(projection.top_ids == 7).any(dim=1)]
    assert len(tied) > 0 and ((tied == 7) | (tied >= 100)).sum() > 0


@pytest.mark.parametrize("method", EXACT)
def test_a_zero_row_falls_back_to_a_full_rescoring(method):
    vectors, basis = random_case(3)
    vectors = vectors.clone()
    vectors[[4, 9]] = 0.0  # every token ties at 0
    projection = project_rows(vectors, basis, N, method=method)
    assert_exact(projection, vectors, basis, N)
    assert projection.stats.full_rows == 2
    assert projection.top_ids[4].tolist() == list(range(N)) == projection.bottom_ids[9].tolist()
    assert projection.top_scores[4].abs().sum() == 0


@pytest.mark.parametrize("method", EXACT)
def test_large_norms_and_a_few_huge_or_tiny_columns(method):
    vectors, basis = random_case(4)
    vectors, basis = vectors.clone(), basis.clone()
    vectors[:20] *= 1e4  # tokens with very large norms / rows with very large norms
    basis[:, :50] *= torch.logspace(1, 6, 50)
    basis[:, 60:63] *= 1e15  # a few huge columns
    basis[:, 70:80] = 1e-39  # subnormal columns (bfloat16 hardware may flush them)
    vectors[30, :10] = 1e-40
    projection = project_rows(vectors, basis, N, method=method)
    assert_exact(projection, vectors, basis, N)


@pytest.mark.parametrize("method", EXACT)
def test_n_larger_than_the_vocabulary_is_clipped(method):
    vectors, basis = random_case(5)
    basis = basis[:, :30]
    projection = project_rows(vectors[:50], basis, 45, method=method)
    assert projection.top_ids.shape == (50, 30)
    assert_exact(projection, vectors[:50], basis, 45)
    assert (projection.top_ids.sort(dim=1).values == torch.arange(30)).all()  # every token, ordered


def test_the_screen_bound_holds_with_room():
    """max |S - r| / eps < 1 for the bfloat16 screen S of every (row, token), r the exact score."""
    vectors, basis = random_case(6)
    vectors, basis = vectors.clone(), basis.clone()
    basis[:, :40] *= torch.logspace(0, 4, 40)
    vectors[5] = 0.0
    prepared = prepare_basis(basis, method="bf16-screen")
    low = vectors.bfloat16()
    screen = (low @ prepared.low.T).double()  # [rows, vocab], what the method screens with
    x, y, beta, tau = screen_bound(vectors, prepared, low=low)
    eps = (x.double()[:, None] * prepared.norms.double() + y.double()[:, None] * prepared.error_norms.double()
           + beta * screen.abs() + tau.double()[:, None])
    exact = torch.from_numpy(exact_scores(vectors.numpy(), basis.numpy())).double()
    ratio = ((screen - exact).abs() / eps).max().item()
    assert 0 < ratio < 1, ratio


def test_the_float32_topk_path_agrees_where_nothing_is_near_a_tie():
    vectors, basis = random_case(7)
    exact = project_rows(vectors, basis, N, method="fp32-screen")
    plain = project_rows(vectors, basis, N, method="fp32-topk")
    scores = exact_scores(vectors.numpy(), basis.numpy())
    gaps = np.diff(np.sort(scores, axis=1), axis=1)
    clear = np.ones(ROWS, bool)
    for row in range(ROWS):
        ordered = np.sort(scores[row])
        near = np.r_[ordered[:N + 1], ordered[-N - 1:]]
        clear[row] = np.diff(near).min() > 1e-4 * np.abs(near).max()
    assert clear.sum() > ROWS // 2 and gaps.shape[1] == VOCAB - 1
    for ids, values in (("top_ids", "top_scores"), ("bottom_ids", "bottom_scores")):
        assert torch.equal(getattr(plain, ids)[clear], getattr(exact, ids)[clear])
        scale = vectors.norm(dim=1)[:, None] * basis.norm(dim=0)[getattr(exact, ids)]  # ||a|| ||b_t||
        assert ((getattr(plain, values) - getattr(exact, values)).abs() <= 1e-6 * scale)[clear].all()


def test_a_basis_prepared_once_serves_many_calls():
    vectors, basis = random_case(8)
    prepared = prepare_basis(basis, method="bf16-screen")
    first, second = project_rows(vectors[:100], prepared, N), project_rows(vectors[100:], prepared, N)
    assert first.stats.method == "bf16-screen"
    assert_exact(first, vectors[:100], basis, N)
    assert_exact(second, vectors[100:], basis, N)
    with pytest.raises(KvmemError, match="prepared for bf16-screen, not fp32-topk"):
        project_rows(vectors, prepared, N, method="fp32-topk")


def test_the_method_is_chosen_in_one_place(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert select_method("cpu") in ("bf16-screen", "fp32-screen", "torch-screen")
    assert select_method("cuda") == "torch-screen"  # float32 GEMMs are fast there
    monkeypatch.setenv(ENV, "fp32-topk")
    assert select_method("cpu") == "fp32-topk"
    vectors, basis = random_case(9)
    assert project_rows(vectors[:4], basis, 3).stats.method == "fp32-topk"
    assert select_method("cpu", "torch-screen") == "torch-screen"  # an argument beats the environment
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(KvmemError) as error:
        select_method("cpu")
    message = str(error.value)
    assert "\n" not in message and "'fast'" in message and ENV in message
    assert all(name in message for name in ("auto", *METHODS))


def test_non_finite_weights_get_one_clear_error():
    vectors, basis = random_case(10)
    vectors = vectors.clone()
    vectors[3, 5] = float("nan")
    with pytest.raises(KvmemError, match=r"vectors hold NaN or inf \(1 rows of 300\)"):
        project_rows(vectors, basis, N, method="bf16-screen")


@pytest.mark.parametrize("method", ["fp32-screen", "torch-screen"])
def test_float32_screens_stay_exact_when_float32_matmuls_round_their_inputs(method):
    """torch.set_float32_matmul_precision("medium") lets oneDNN (or TF32 on CUDA) round a float32 GEMM's
    inputs; the float32 screens then widen their bound accordingly."""
    vectors, basis = random_case(11)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        projection = project_rows(vectors, basis, N, method=method)
    finally:
        torch.set_float32_matmul_precision(before)
    assert_exact(projection, vectors, basis, N)
