"""The top and bottom n tokens of every row of ``vectors @ basis``, exactly, on any device: a float32 GEMM
screens every score, ``torch.topk`` keeps 2n + 8 per side, and the candidates among them (within twice
the screen's error bound of the n-th) are rescored exactly in torch (:func:`project_rows`). Where the
margin is too thin (more than the kept candidates could tie, e.g. an all-zero vector where every token
ties, or scores near float32's range) a row is rescored in full;
:class:`~kvmem.scanning.projection_rules.ProjectionStats` counts both.

What a score is, the tie order and the screen's error bound (with its proof):
:mod:`kvmem.scanning.projection_rules`. Every row's result depends on that row alone, so a neuron's rows
projected on their own (:meth:`kvmem.atlas.Atlas.values` on demand) equal the whole table's to the bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.scanning.projection_rules import (
    METHOD,
    Basis,
    Projection,
    ProjectionStats,
    check_finite,
    keeps_fp32_inputs,
    prepare_basis,
    screen_bound,
)

__all__ = ["Projection", "ProjectionStats", "Basis", "METHOD", "BLOCK", "CUDA_BLOCK", "prepare_basis", "project_rows"]

BLOCK = 512  # rows per GEMM on a CPU
CUDA_BLOCK = 4096  # rows per GEMM on a GPU (fewer, larger launches)
_UP = 1 + 2.0**-20
_SPARE = 8  # the screen keeps 2n + _SPARE per side


def project_rows(vectors: Tensor, basis: Tensor | Basis, n: int, *, block: int | None = None) -> Projection:
    """scores = vectors [rows, d_model] @ basis [d_model, vocab]; keep the n highest and lowest per row
    (n clipped to the vocabulary), in blocks of ``block`` rows (the full score matrix never exists).

    ``basis``: a tensor, or a :class:`Basis` prepared once for many calls. Results on the CPU."""
    if not isinstance(basis, Basis):
        basis = prepare_basis(basis)
    n = min(n, basis.vocab)
    rows = vectors.shape[0]
    if n <= 0 or rows == 0:
        empty = torch.empty(rows, max(n, 0))
        return Projection(empty.long(), empty, empty.long(), empty, ProjectionStats(METHOD, rows))
    vectors = vectors.detach()
    check_finite(vectors, "vectors")
    block = block or (CUDA_BLOCK if basis.matrix.device.type == "cuda" else BLOCK)
    with torch.inference_mode():
        return _screen(vectors, basis, n, block)


def _screen(vectors: Tensor, basis: Basis, n: int, block: int) -> Projection:
    """Per row one bound E (eps at its largest over the tokens); the top 2n + 8 by S hold every candidate
    when their last is below the n-th minus 2E (likewise the bottom), and the candidates are those of them
    within 2E of the n-th: a token below the n-th S minus 2E scores exactly below the n-th exact score."""
    device = basis.matrix.device
    vocab = basis.vocab
    keep = min(vocab, 2 * n + _SPARE)
    precise = keeps_fp32_inputs(device)
    parts, screened, candidates = [], 0, 0
    for start in range(0, vectors.shape[0], block):
        a = vectors[start:start + block].to(device, torch.float32)  # [block, d]
        screen = a @ basis.matrix  # [block, vocab]
        x, _, beta, tau = screen_bound(a, basis, precise=precise)
        top = torch.topk(screen, keep, dim=1)
        bottom = torch.topk(screen, keep, dim=1, largest=False)
        peak = torch.maximum(top.values[:, 0], bottom.values[:, 0].neg())  # max |S| per row (NaN stays NaN)
        bound = (x.double() * basis.max_norm + beta * peak.double() + tau.double()) * _UP
        enough = torch.full_like(tau, keep == vocab, dtype=torch.bool)
        clear_top = top.values[:, keep - 1].double() < top.values[:, n - 1].double() - 2 * bound
        clear_bottom = bottom.values[:, keep - 1].double() > bottom.values[:, n - 1].double() + 2 * bound
        ok = (tau >= 0) & (enough | (clear_top & clear_bottom))  # [block]
        del screen
        out = [torch.empty(a.shape[0], n, dtype=dtype, device=device)
               for dtype in (torch.int64, torch.float32, torch.int64, torch.float32)]
        if ok.any():
            rows = ok.nonzero().squeeze(1)
            for side, (found, largest) in enumerate(((top, True), (bottom, False))):
                # the candidates: S >= the n-th S - 2E (top), S <= the n-th S + 2E (bottom), a prefix of each row's
                # topk in its order; the rows of a block rescore as many as the row that has most
                values, bound_2e = found.values[rows].double(), 2 * bound[rows, None]
                nth = values[:, n - 1:n]
                inside = values >= nth - bound_2e if largest else values <= nth + bound_2e
                m = max(n, int(inside.sum(dim=1).max()))
                ids = found.indices[rows, :m].sort(dim=1).values  # [ok rows, m], ascending
                step = rows.numel() if device.type == "cuda" else 64  # a GPU takes the block at once
                scores = _exact_gathered(a[rows], basis.columns, ids, rows_per_step=step)
                chosen, scores = _order(ids, scores, n, largest)
                out[2 * side][rows], out[2 * side + 1][rows] = chosen, scores
                candidates += m * rows.numel()
            screened += rows.numel()
        if not ok.all():
            rows = (~ok).nonzero().squeeze(1)
            scores = _exact_full(a[rows], basis.matrix)  # [rows, vocab]
            ids = torch.arange(vocab, device=device).expand(rows.numel(), vocab)
            for side, largest in enumerate((True, False)):
                chosen, kept = _order(ids, scores, n, largest)
                out[2 * side][rows], out[2 * side + 1][rows] = chosen, kept
        parts.append(out)
    rows = vectors.shape[0]
    stats = ProjectionStats(METHOD, rows, candidates, rows - screened)
    return Projection(*(torch.cat([p[i] for p in parts]).cpu() for i in range(4)), stats)


def _order(ids: Tensor, scores: Tensor, n: int, largest: bool) -> tuple[Tensor, Tensor]:
    """ids [rows, m] ascending per row, scores [rows, m] -> the first n by the tie rule."""
    order = torch.sort(scores, dim=1, descending=largest, stable=True).indices[:, :n]
    return ids.gather(1, order), scores.gather(1, order)


def _exact_gathered(a: Tensor, columns: Tensor, ids: Tensor, *, rows_per_step: int = 64) -> Tensor:
    """float32 [rows, m]: a [rows, d] against columns[ids] [rows, m, d], float64 in index order.

    Each product of two float32 numbers is exact in float64; the sum adds them one after another in index
    order. On a CPU that is the last entry of ATen's ``cumsum`` along d (its CPU kernel adds the terms in
    order, in float64, from 0); elsewhere (a GPU's cumsum is a parallel scan) a loop over d."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=a.device)
    for start in range(0, a.shape[0], rows_per_step):
        part = columns[ids[start:start + rows_per_step]]  # [step, m, d] float32
        a64 = a[start:start + rows_per_step].double()
        if a.device.type == "cpu":
            total = part.double().mul_(a64[:, None, :]).cumsum(2)[:, :, -1]
        else:
            total = torch.zeros(part.shape[:2], dtype=torch.float64, device=a.device)
            for i in range(a.shape[1]):
                total.addcmul_(a64[:, i:i + 1], part[:, :, i].double())  # an exact product: fused or not, the same
        out[start:start + rows_per_step] = total.float()
    return out


def _exact_full(a: Tensor, matrix: Tensor) -> Tensor:
    """float32 [rows, vocab]: a [rows, d] against every column of matrix [d, vocab], float64 in index order."""
    a64 = a.double()
    total = torch.zeros(a.shape[0], matrix.shape[1], dtype=torch.float64, device=a.device)
    for i in range(a.shape[1]):
        total.addcmul_(a64[:, i:i + 1], matrix[i].double()[None, :])
    return total.float()
