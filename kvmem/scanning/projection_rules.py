"""The rules of an exact projection, at the bottom of the projection modules: what a score is, the tie
order, the screen's error bound, the methods' names, and the results.

**Scores.** The score of token t for a row a is ``float32(a_0 b_0t + a_1 b_1t + ... )``, the products
summed in float64 in index order (a float32 x float32 product is exact in float64, and the float64
sum is within d * 2^-53 * sum|a_i b_it| of the real dot product, far below float32's resolution).
Every exact method reports these numbers to the bit, on any device; a float32 GEMM's rounding
instead depends on its blocking.

**Order (the tie rule).** Top n: score descending, then token id ascending; bottom n: score
ascending, then token id ascending. (``torch.topk`` had no rule for ties.)

**The bound.** For a float32 row a, column b (= b_t), the float32 screen S = fl(a . b) and r the exact
score above, with u = 2^-24 (float32's unit roundoff) and g = 2 * gamma_d = 2 d 2^-24 / (1 - d 2^-24)
(float32 accumulation in any order, doubled)::

    |S - r| <= |S - acc|            <= u/(1-u) |S|                       (float32 output rounding)
             + |acc - a . b|        <= g ||a|| ||b||                     (float32 accumulation)
             + |a . b - r|          <= 2^-23 ||a|| ||b||                 (float64 sum, float32 result)
             + tau = d 2^-120 (1 + ||a||)(1 + max_t ||b_t||)             (flushed subnormals)

So eps = x_r ||b_t|| + beta |S| + tau_r (x_r = (g + 2^-23) ||a||, beta = u/(1-u)), every coefficient
multiplied by 17/16 and the norms rounded up; plus (2v + v^2) ||a|| ||b|| with v = 2^-8 where the
float32 GEMM may round its inputs (TF32, or ``torch.set_float32_matmul_precision`` below "highest").
A row whose screen could come near float32's range (||a|| max_t ||b_t|| >= 2^120) is rescored in full
instead.

**Selection with proof.** S - eps <= r <= S + eps for every token. L = the n-th largest S - eps is
at most the n-th largest r, so every token of the exact top n (ties at the n-th place included)
has S + eps >= L: those are the candidates. Likewise U = the n-th smallest S + eps and S - eps <= U
for the bottom. The candidates are rescored exactly and ordered by the rule above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvmem.errors import KvmemError

__all__ = ["Projection", "ProjectionStats", "Basis", "METHOD", "prepare_basis", "screen_bound", "keeps_fp32_inputs",
           "check_finite"]

# the one projection method (its name goes into the manifest and beside cached tables): a float32 GEMM screen,
# exact rescoring of the candidates in torch, on any device
METHOD = "torch-screen"

_SAFETY = 17 / 16
_UP = 1 + 2.0**-20  # a float64 norm rounded to float32 stays an upper bound


@dataclass(frozen=True)
class ProjectionStats:
    """How projections ran. rows: rows projected; candidates: tokens rescored exactly in the screened
    rows (top and bottom together); full_rows: rows rescored in full (the margin was too thin)."""

    method: str
    rows: int = 0
    candidates: int = 0
    full_rows: int = 0

    def __add__(self, other: ProjectionStats) -> ProjectionStats:
        return ProjectionStats(self.method if self.method == other.method else f"{self.method}+{other.method}",
                               self.rows + other.rows, self.candidates + other.candidates,
                               self.full_rows + other.full_rows)

    @property
    def candidates_per_row(self) -> float:
        """Mean candidates rescored per screened row (top + bottom)."""
        return self.candidates / max(1, self.rows - self.full_rows)

    def to_dict(self) -> dict:
        return {"method": self.method, "rows": self.rows, "candidates_per_row": round(self.candidates_per_row, 2),
                "full_rows": self.full_rows}


@dataclass(frozen=True)
class Projection:
    """Top and bottom ``n`` tokens per row. All [rows, n]: ids int64, scores float32 (see the module
    docstring for the scores and the order); ``stats``: how it ran."""

    top_ids: Tensor
    top_scores: Tensor
    bottom_ids: Tensor
    bottom_scores: Tensor
    stats: ProjectionStats | None = None


@dataclass(frozen=True, eq=False)
class Basis:
    """A basis prepared once for many :func:`~kvmem.scanning.projection_screen.project_rows` calls
    (:func:`prepare_basis`).

    matrix: [d_model, vocab] float32 (the float32 GEMMs); columns: [vocab, d_model] float32, contiguous
    (the exact rescoring); norms: [vocab] float32, upper bounds of the columns' 2-norms."""

    matrix: Tensor
    columns: Tensor
    norms: Tensor
    max_norm: float

    @property
    def vocab(self) -> int:
        return self.matrix.shape[1]


def prepare_basis(basis: Tensor) -> Basis:
    """``basis`` [d_model, vocab] (any dtype, any device) prepared for many projections."""
    matrix = basis.detach().float()
    columns = matrix.T.contiguous()  # [vocab, d]: free for a transposed weight
    norms, max_norm = _norms(columns)
    if not math.isfinite(max_norm):  # a NaN or inf anywhere makes its column's norm one
        check_finite(columns, "basis")
    return Basis(matrix, columns, norms, max_norm)


def screen_bound(vectors: Tensor, basis: Basis, *, precise: bool = True) -> tuple[Tensor, Tensor, float, Tensor]:
    """(x, y, beta, tau) of the bound eps[r, t] = x[r] ||b_t|| + beta |S[r, t]| + tau[r] (module docstring;
    y = 0, the term of a screen with rounded bases), x, tau float32 [rows], rounded up; tau is -1 for a row
    whose screen could overflow (rescored in full). ``precise``: the float32 GEMM multiplies its inputs
    unrounded."""
    d = vectors.shape[1]
    length = _row_norms(vectors)  # [rows] float64
    g = 2 * d * 2.0**-24 / (1 - d * 2.0**-24)
    unit = 2.0**-24
    rounding = 0.0 if precise else 2 * 2.0**-8 + 2.0**-16
    x = (g + 2.0**-23 + rounding) * length
    y = torch.zeros_like(length)
    reach = length * basis.max_norm
    tau = d * 2.0**-120 * (1 + length) * (1 + basis.max_norm)
    tau = torch.where(reach < 2.0**120, tau, torch.full_like(tau, -1 / _SAFETY))
    beta = _SAFETY * unit / (1 - unit)
    return *(_up(_SAFETY * t) for t in (x, y)), beta * _UP, _up(_SAFETY * tau)


def _row_norms(rows: Tensor) -> Tensor:
    """float64 [rows]: each row's 2-norm of float32 [rows, d], summed in float64 (numpy on a CPU: one
    thread, no barrier for torch's thread pool to cross)."""
    if rows.device.type != "cpu":
        return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64)
    wide = rows.detach().numpy().astype(np.float64)
    return torch.from_numpy(np.sqrt(np.einsum("ij,ij->i", wide, wide)))


def keeps_fp32_inputs(device: torch.device) -> bool:
    """Whether float32 GEMMs on ``device`` multiply the float32 inputs as they are (no TF32 or bfloat16
    rounding: ``torch.set_float32_matmul_precision("highest")`` and the backends' own settings)."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    backend = torch.backends.cuda.matmul if device.type == "cuda" else getattr(torch.backends.mkldnn, "matmul", None)
    if getattr(backend, "fp32_precision", "none") not in ("none", "ieee"):
        return False
    return not (device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)


def _norms(rows: Tensor) -> tuple[Tensor, float]:
    """Upper bounds (float32 [n]) of each row's 2-norm, and the largest (float64 sums, rounded up)."""
    norms = _up(torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64))
    return norms, float(norms.max()) if norms.numel() else 0.0


def _up(values: Tensor) -> Tensor:
    """float64 -> float32, never below the float64 value (for values far from float32's range limits)."""
    return (values * _UP).float()


def check_finite(values: Tensor, what: str) -> None:
    """One clear error for NaN or inf in ``values`` [rows, ...] (on a CPU by numpy: one thread, no
    barrier for torch's thread pool to cross)."""
    plain = values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64)
    finite = np.isfinite(values.detach().numpy()) if plain else torch.isfinite(values)
    if not bool(finite.all()):
        bad = int((~finite).reshape(values.shape[0], -1).any(1).sum())
        raise KvmemError(f"the projection's {what} hold NaN or inf ({bad} rows of {values.shape[0]}); "
                         f"the exact top and bottom tokens need finite weights")
