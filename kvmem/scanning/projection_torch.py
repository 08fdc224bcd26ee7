"""The torch methods of :func:`kvmem.scanning.projection_screen.project_rows` (any device):
``torch-screen`` (a float32 GEMM screen, exact rescoring in torch) and ``fp32-topk`` (a float32 GEMM
and ``torch.topk``). Scores, tie order and bound: :mod:`kvmem.scanning.projection_rules`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.scanning.projection_rules import Basis, Projection, ProjectionStats, keeps_fp32_inputs, screen_bound

__all__ = ["torch_screen", "fp32_topk"]

_UP = 1 + 2.0**-20
_SPARE = 8  # torch-screen keeps 2n + _SPARE per side


def torch_screen(vectors: Tensor, basis: Basis, n: int, block: int) -> Projection:
    """torch-screen: per row one bound E (eps at its largest over the tokens); the top 2n + 8 by S hold
    every candidate when their last is below the n-th minus 2E (likewise the bottom)."""
    device = basis.matrix.device
    vocab = basis.vocab
    keep = min(vocab, 2 * n + _SPARE)
    precise = keeps_fp32_inputs(device)
    parts, screened, candidates = [], 0, 0
    for start in range(0, vectors.shape[0], block):
        a = vectors[start:start + block].to(device, torch.float32)  # [block, d]
        screen = a @ basis.matrix  # [block, vocab]
        x, _, beta, tau = screen_bound(a, basis, precise=precise)
        bound = (x.double() * basis.max_norm + beta * screen.abs().amax(dim=1).double() + tau.double()) * _UP
        top = torch.topk(screen, keep, dim=1)
        bottom = torch.topk(screen, keep, dim=1, largest=False)
        enough = torch.full_like(tau, keep == vocab, dtype=torch.bool)
        clear_top = top.values[:, keep - 1].double() < top.values[:, n - 1].double() - 2 * bound
        clear_bottom = bottom.values[:, keep - 1].double() > bottom.values[:, n - 1].double() + 2 * bound
        ok = (tau >= 0) & (enough | (clear_top & clear_bottom))  # [block]
        del screen
        out = [torch.empty(a.shape[0], n, dtype=dtype, device=device)
               for dtype in (torch.int64, torch.float32, torch.int64, torch.float32)]
        if ok.any():
            rows = ok.nonzero().squeeze(1)
            for side, (ids, largest) in enumerate(((top.indices, True), (bottom.indices, False))):
                ids = ids[rows].sort(dim=1).values  # [ok rows, keep], ascending
                step = rows.numel() if device.type == "cuda" else 128  # a GPU takes the block at once
                scores = _exact_gathered(a[rows], basis.columns, ids, rows_per_step=step)
                chosen, scores = _order(ids, scores, n, largest)
                out[2 * side][rows], out[2 * side + 1][rows] = chosen, scores
            screened += rows.numel()
        if not ok.all():
            rows = (~ok).nonzero().squeeze(1)
            scores = _exact_full(a[rows], basis.matrix)  # [rows, vocab]
            ids = torch.arange(vocab, device=device).expand(rows.numel(), vocab)
            for side, largest in enumerate((True, False)):
                chosen, kept = _order(ids, scores, n, largest)
                out[2 * side][rows], out[2 * side + 1][rows] = chosen, kept
        parts.append(out)
    candidates = 2 * keep * screened
    rows = vectors.shape[0]
    stats = ProjectionStats(basis.method, rows, candidates, rows - screened)
    return Projection(*(torch.cat([p[i] for p in parts]).cpu() for i in range(4)), stats)


def fp32_topk(vectors: Tensor, basis: Basis, n: int, block: int) -> Projection:
    """fp32-topk: a float32 GEMM and two torch.topk per block; the n kept then ordered by the tie rule."""
    parts = []
    for start in range(0, vectors.shape[0], block):
        screen = vectors[start:start + block].to(basis.matrix.device, torch.float32) @ basis.matrix  # [block, vocab]
        out = []
        for largest in (True, False):
            kept = torch.topk(screen, n, dim=1, largest=largest)
            ids, order = kept.indices.sort(dim=1)
            out += _order(ids, kept.values.gather(1, order), n, largest)
        parts.append(out)
    rows = vectors.shape[0]
    return Projection(*(torch.cat([p[i] for p in parts]).cpu() for i in range(4)), ProjectionStats(basis.method, rows))


def _order(ids: Tensor, scores: Tensor, n: int, largest: bool) -> tuple[Tensor, Tensor]:
    """ids [rows, m] ascending per row, scores [rows, m] -> the first n by the tie rule."""
    order = torch.sort(scores, dim=1, descending=largest, stable=True).indices[:, :n]
    return ids.gather(1, order), scores.gather(1, order)


def _exact_gathered(a: Tensor, columns: Tensor, ids: Tensor, *, rows_per_step: int = 128) -> Tensor:
    """float32 [rows, m]: a [rows, d] against columns[ids] [rows, m, d], float64 in index order."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=a.device)
    for start in range(0, a.shape[0], rows_per_step):
        part = columns[ids[start:start + rows_per_step]]  # [step, m, d] float32
        a64 = a[start:start + rows_per_step].double()
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
