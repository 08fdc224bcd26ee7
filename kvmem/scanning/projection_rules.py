"""The rules of an exact projection, at the bottom of the projection modules: what a score is, the tie
order, the screen's error bound, the methods' names, and the results.

**Scores.** The score of token t for a row a is ``float32(a_0 b_0t + a_1 b_1t + ... )``, the products
summed in float64 in index order (a float32 x float32 product is exact in float64, and the float64
sum is within d * 2^-53 * sum|a_i b_it| of the real dot product, far below float32's resolution).
Every exact method reports these numbers to the bit, on any device; a float32 GEMM's rounding
instead depends on its blocking.

**Order (the tie rule).** Top n: score descending, then token id ascending; bottom n: score
ascending, then token id ascending. (``torch.topk`` had no rule for ties.)

**The bound.** For a float32 row a, column b (= b_t) and the screen S = fl(a-hat . b-hat), where
a-hat = bf16(a), b-hat = bf16(b), da = a - a-hat, db = b - b-hat (measured, in float32), u = 2^-9
(bfloat16's unit roundoff), g = 2 * gamma_d = 2 d 2^-24 / (1 - d 2^-24) (float32 accumulation
in any order, doubled: hardware bf16 dot instructions pair products and flush denormals), and r the
exact score above::

    |S - r| <= |S - acc|                 <= u/(1-u) |S|                       (bf16 output rounding)
             + |acc - a-hat . b-hat|     <= g ||a-hat|| ||b-hat||             (float32 accumulation)
             + |a-hat . b-hat - a . b|   <= ||a|| ||db|| + ||da|| ||b|| + ||da|| ||db||  (input rounding)
             + |a . b - r|               <= 2^-23 ||a|| ||b||                 (float64 sum, float32 result)
             + tau = d 2^-120 (1 + ||a||)(1 + max_t ||b_t||)                  (flushed subnormals)

with ||a-hat|| <= ||a|| + ||da||, ||b-hat|| <= ||b|| + ||db||. So eps = x_r ||b_t|| + y_r ||db_t|| +
beta |S| + tau_r (x_r = ||da|| + g (||a|| + ||da||) + 2^-23 ||a||, y_r = (||a|| + ||da||)(1 + g),
beta = u/(1-u)), every coefficient multiplied by 17/16 (generous: it also covers the float32
evaluation of eps in the kernel) and the norms rounded up. The float32 screen has da = db = 0 and
u = 2^-24, plus (2v + v^2) ||a|| ||b|| with v = 2^-8 where the float32 GEMM may round its inputs
(TF32, or ``torch.set_float32_matmul_precision`` below "highest"). A row whose screen could come
near float32's range (||a|| max_t ||b_t|| >= 2^120) is rescored in full instead.

**Selection with proof.** S - eps <= r <= S + eps for every token. L = the n-th largest S - eps is
at most the n-th largest r, so every token of the exact top n (ties at the n-th place included)
has S + eps >= L: those are the candidates. Likewise U = the n-th smallest S + eps and S - eps <= U
for the bottom. The candidates are rescored exactly and ordered by the rule above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from kvmem.errors import KvmemError

__all__ = ["Projection", "ProjectionStats", "Basis", "METHODS", "EXACT_METHODS", "CPU_METHODS", "prepare_basis",
           "screen_bound", "keeps_fp32_inputs", "check_finite"]

METHODS = {
    "bf16-screen": "bfloat16 GEMM screen, exact rescoring of the candidates (numba, CPU)",
    "fp32-screen": "float32 GEMM screen, exact rescoring of the candidates (numba, CPU)",
    "torch-screen": "float32 GEMM screen, exact rescoring of the candidates (torch, any device)",
    "fp32-topk": "float32 GEMM and torch.topk (scores rounded as the GEMM rounds them)",
}
EXACT_METHODS = frozenset({"bf16-screen", "fp32-screen", "torch-screen"})  # the same numbers to the bit
CPU_METHODS = frozenset({"bf16-screen", "fp32-screen"})  # the numba kernels'

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
    """A basis prepared once for many :func:`project_rows` calls (:func:`prepare_basis`).

    matrix: [d_model, vocab] float32 (the float32 GEMMs); columns: [vocab, d_model] float32, contiguous
    (the exact rescoring); norms: [vocab] float32, upper bounds of the columns' 2-norms; low: [vocab,
    d_model] bfloat16 and error_norms: [vocab] float32 upper bounds of ||b_t - bf16(b_t)|| (bf16-screen
    only); method: the method it is prepared for (its tensors live where that method computes); workspace:
    the numba screens' buffer (:meth:`screen_buffer`)."""

    method: str
    matrix: Tensor
    columns: Tensor
    norms: Tensor
    max_norm: float
    low: Tensor | None = None
    error_norms: Tensor | None = None
    max_error_norm: float = 0.0
    workspace: dict = field(default_factory=dict, repr=False)  # the screen's buffer, reused by every call

    def screen_buffer(self, rows: int, dtype: torch.dtype) -> Tensor:
        """A [rows, vocab] buffer for the screen, made once and reused (a fresh 25 MB block on every call
        costs its page faults again; one Basis is for one thread at a time)."""
        buffer = self.workspace.get("screen")
        if buffer is None or buffer.shape[0] < rows or buffer.dtype != dtype:
            buffer = self.workspace["screen"] = torch.empty(rows, self.vocab, dtype=dtype)
        return buffer[:rows]

    @property
    def vocab(self) -> int:
        return self.matrix.shape[1]


def prepare_basis(basis: Tensor, *, method: str) -> Basis:
    """``basis`` [d_model, vocab] (any dtype, any device) prepared for ``method``."""
    if method not in METHODS:
        raise KvmemError(f"unknown projection method {method!r}; choose one of {', '.join(METHODS)}")
    matrix = basis.detach().float()
    if method in CPU_METHODS:
        matrix = matrix.cpu()
    columns = matrix.T.contiguous()  # [vocab, d]: free for a transposed weight
    norms, max_norm = _norms(columns)
    if not math.isfinite(max_norm):  # a NaN or inf anywhere makes its column's norm one
        check_finite(columns, "basis")
    if method != "bf16-screen":
        return Basis(method, matrix, columns, norms, max_norm)
    low = columns.bfloat16()  # [vocab, d]
    step = 4096  # columns at a time: their rounding errors are never all alive at once
    errors = torch.cat([torch.linalg.vector_norm(columns[i:i + step] - low[i:i + step].float(), dim=1,
                                                 dtype=torch.float64) for i in range(0, columns.shape[0], step)])
    error_norms = _up(errors)
    max_error = float(error_norms.max()) if error_norms.numel() else 0.0
    return Basis(method, matrix, columns, norms, max_norm, low, error_norms, max_error)


def screen_bound(vectors: Tensor, basis: Basis, *, low: Tensor | None = None, precise: bool = True
                 ) -> tuple[Tensor, Tensor, float, Tensor]:
    """(x, y, beta, tau) of the bound eps[r, t] = x[r] ||b_t|| + y[r] ||db_t|| + beta |S[r, t]| + tau[r]
    (module docstring), x, y, tau float32 [rows], rounded up; tau is -1 for a row whose screen could
    overflow (rescored in full). ``low``: the bfloat16 vectors of a bf16 screen (else a float32
    screen, with rounded inputs unless ``precise``)."""
    d = vectors.shape[1]
    length = _row_norms(vectors)  # [rows] float64
    g = 2 * d * 2.0**-24 / (1 - d * 2.0**-24)
    if low is not None:
        error = _row_norms(vectors - low.float())  # exact in float32: the bits bfloat16 dropped
        unit = 2.0**-9
        x = error + g * (length + error) + 2.0**-23 * length
        y = (length + error) * (1 + g)
    else:
        error = torch.zeros_like(length)
        unit = 2.0**-24
        rounding = 0.0 if precise else 2 * 2.0**-8 + 2.0**-16
        x = (g + 2.0**-23 + rounding) * length
        y = torch.zeros_like(length)
    reach = (length + error) * (basis.max_norm + basis.max_error_norm)
    tau = d * 2.0**-120 * (1 + length + error) * (1 + basis.max_norm + basis.max_error_norm)
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
