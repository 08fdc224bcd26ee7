"""The top and bottom n tokens of every row of ``vectors @ basis``, exactly, at the machine's GEMM speed.

**Scores.** The score of token t for a row a is ``float32(a_0 b_0t + a_1 b_1t + ... )``, the products
summed in float64 in index order (a float32 x float32 product is exact in float64, and the float64
sum is within d * 2^-53 * sum|a_i b_it| of the real dot product, far below float32's resolution).
Every exact method reports these numbers to the bit, on any device; a float32 GEMM's rounding
instead depends on its blocking.

**Order (the tie rule).** Top n: score descending, then token id ascending; bottom n: score
ascending, then token id ascending. (``torch.topk`` had no rule for ties.)

**Methods** (``method=``, else the ``KVMEM_PROJECTION`` environment variable, else ``auto``):

- ``bf16-screen``: a bfloat16 GEMM screens every score, a numba kernel keeps the candidates the error
  bound below cannot exclude and rescores them exactly (CPU). Chosen by ``auto`` on a CPU that
  multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16), with torch's oneDNN and numba usable.
- ``fp32-screen``: the same with a float32 GEMM screen (CPU, numba); ``auto`` on other CPUs.
- ``torch-screen``: a float32 GEMM screen, ``torch.topk`` of 2n + 8 per side, exact rescoring in torch
  (any device); ``auto`` on CUDA, and on a CPU where numba cannot load.
- ``fp32-topk``: a float32 GEMM and ``torch.topk`` (the first kvmem's way): the GEMM's rounding in the
  scores, the tie rule only among the n kept. Explicit only.

The three screens give the same ids and scores to the bit; where the margin is too thin (more than
``cap`` candidates on a side, e.g. an all-zero vector where every token ties, or scores near
float32's range) a row is rescored in full. :class:`ProjectionStats` counts both.

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
(TF32, or ``torch.set_float32_matmul_precision`` below "highest").

**Selection with proof.** S - eps <= r <= S + eps for every token. L = the n-th largest S - eps is
at most the n-th largest r, so every token of the exact top n (ties at the n-th place included)
has S + eps >= L: those are the candidates. Likewise U = the n-th smallest S + eps and S - eps <= U
for the bottom. The candidates are rescored exactly and ordered by the rule above.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvmem.errors import KvmemError

__all__ = ["Projection", "ProjectionStats", "Basis", "METHODS", "EXACT_METHODS", "ENV", "select_method",
           "prepare_basis", "project_rows", "bf16_units", "screen_bound"]

ENV = "KVMEM_PROJECTION"  # environment variable naming a method
METHODS = {
    "bf16-screen": "bfloat16 GEMM screen, exact rescoring of the candidates (numba, CPU)",
    "fp32-screen": "float32 GEMM screen, exact rescoring of the candidates (numba, CPU)",
    "torch-screen": "float32 GEMM screen, exact rescoring of the candidates (torch, any device)",
    "fp32-topk": "float32 GEMM and torch.topk (scores rounded as the GEMM rounds them)",
}
EXACT_METHODS = frozenset({"bf16-screen", "fp32-screen", "torch-screen"})  # the same numbers to the bit
BLOCK = {"bf16-screen": 1024, "fp32-screen": 512, "torch-screen": 512, "fp32-topk": 512}  # rows per GEMM

_SAFETY = 17 / 16
_UP = 1 + 2.0**-20  # a float64 norm rounded to float32 stays an upper bound
_SPARE = 8  # torch-screen keeps 2n + _SPARE per side
_NUMBA: list = []  # [kernels module] once they loaded, [None] once they failed (warned once per process)


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
    only); method: the method it is prepared for (its tensors live where that method computes)."""

    method: str
    matrix: Tensor
    columns: Tensor
    norms: Tensor
    max_norm: float
    low: Tensor | None = None
    error_norms: Tensor | None = None
    max_error_norm: float = 0.0

    @property
    def vocab(self) -> int:
        return self.matrix.shape[1]


def bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16, from /proc/cpuinfo's
    flags or torch's own probes) and torch reaches it (oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return False
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = {f for line in cpuinfo if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    except OSError:
        pass
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return bool(flags & {"avx512_bf16", "amx_bf16"}) or any(probe() for probe in probes if callable(probe))


def _kernels():
    """The numba kernels (compiled once per install, then loaded from numba's disk cache), or None."""
    if not _NUMBA:
        try:
            from kvmem.scanning import projection_kernels

            tiny = prepare_basis(torch.eye(4), method="fp32-screen")
            _screened(projection_kernels, torch.ones(2, 4), tiny, 1, 2)  # compiles or loads every kernel
            _NUMBA.append(projection_kernels)
        except Exception as error:  # numba missing, or present but unusable here (e.g. no writable cache)
            warnings.warn(f"kvmem: the compiled projection kernels are unavailable ({type(error).__name__}: {error}); "
                          f"projecting with torch-screen (set NUMBA_CACHE_DIR to a writable directory, or "
                          f"{ENV}=torch-screen to silence this)", RuntimeWarning, stacklevel=3)
            _NUMBA.append(None)
    return _NUMBA[0]


def select_method(device: str | torch.device = "cpu", name: str | None = None) -> str:
    """The projection method for vectors on ``device``: ``name`` if given, else ``KVMEM_PROJECTION``,
    else (``auto``) bf16-screen on a CPU with bfloat16 units, fp32-screen on other CPUs, torch-screen
    on CUDA or where numba cannot load (see the module docstring)."""
    chosen = (name or os.environ.get(ENV) or "auto").lower()
    if chosen not in METHODS and chosen != "auto":
        source = "projection method" if name else ENV
        raise KvmemError(f"unknown {source} {chosen!r}; choose one of auto, {', '.join(METHODS)}")
    if chosen in ("bf16-screen", "fp32-screen") and _kernels() is None:
        raise KvmemError(f"the projection method {chosen} needs numba, which cannot load here; "
                         f"use {ENV}=torch-screen")
    if chosen != "auto":
        return chosen
    if torch.device(device).type != "cpu" or _kernels() is None:
        return "torch-screen"
    return "bf16-screen" if bf16_units() else "fp32-screen"


def prepare_basis(basis: Tensor, *, method: str, kernels=None) -> Basis:
    """``basis`` [d_model, vocab] (any dtype, any device) prepared for ``method``."""
    if method not in METHODS:
        raise KvmemError(f"unknown projection method {method!r}; choose one of {', '.join(METHODS)}")
    matrix = basis.detach().float()
    if method in ("bf16-screen", "fp32-screen"):
        matrix = matrix.cpu()
    columns = matrix.T.contiguous()  # [vocab, d]: free for a transposed weight
    norms, max_norm = _norms(columns)
    if not math.isfinite(max_norm):  # a NaN or inf anywhere makes its column's norm one
        _check_finite(columns, "basis")
    if method != "bf16-screen":
        return Basis(method, matrix, columns, norms, max_norm)
    low = columns.bfloat16()  # [vocab, d]
    error_norms, max_error = _norms(columns - low.float())
    return Basis(method, matrix, columns, norms, max_norm, low, error_norms, max_error)


def project_rows(vectors: Tensor, basis: Tensor | Basis, n: int, *, block: int | None = None,
                 method: str | None = None) -> Projection:
    """scores = vectors [rows, d_model] @ basis [d_model, vocab]; keep the n highest and lowest per row
    (n clipped to the vocabulary), in blocks of ``block`` rows (the full score matrix never exists).

    ``basis``: a tensor, or a :class:`Basis` prepared once for many calls (then ``method`` is its);
    ``method``: see :func:`select_method`. Results on the CPU."""
    if isinstance(basis, Basis):
        if method is not None and method != basis.method:
            raise KvmemError(f"the basis was prepared for {basis.method}, not {method}; prepare it again")
    else:
        basis = prepare_basis(basis, method=select_method(vectors.device, method))
    n = min(n, basis.vocab)
    rows = vectors.shape[0]
    if n <= 0 or rows == 0:
        empty = torch.empty(rows, max(n, 0))
        return Projection(empty.long(), empty, empty.long(), empty, ProjectionStats(basis.method, rows))
    vectors = vectors.detach()
    _check_finite(vectors, "vectors")
    block = block or BLOCK[basis.method]
    with torch.inference_mode():
        if basis.method in ("bf16-screen", "fp32-screen"):
            kernels = _kernels()
            if kernels is None:
                raise KvmemError(f"the projection method {basis.method} needs numba, which cannot load here; "
                                 f"use {ENV}=torch-screen")
            return _screened(kernels, vectors, basis, n, block)
        if basis.method == "torch-screen":
            return _torch_screen(vectors, basis, n, block)
        return _topk(vectors, basis, n, block)


def screen_bound(vectors: Tensor, basis: Basis, *, low: Tensor | None = None, precise: bool = True
                 ) -> tuple[Tensor, Tensor, float, Tensor]:
    """(x, y, beta, tau) of the bound eps[r, t] = x[r] ||b_t|| + y[r] ||db_t|| + beta |S[r, t]| + tau[r]
    (module docstring), x, y, tau float32 [rows], rounded up; tau is -1 for a row whose screen could
    overflow (rescored in full). ``low``: the bfloat16 vectors of a bf16 screen (else a float32
    screen, with rounded inputs unless ``precise``)."""
    d = vectors.shape[1]
    a = vectors.double()
    length = torch.linalg.vector_norm(a, dim=1)  # [rows]
    g = 2 * d * 2.0**-24 / (1 - d * 2.0**-24)
    if low is not None:
        error = torch.linalg.vector_norm(a - low.double(), dim=1)
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


def _screened(kernels, vectors: Tensor, basis: Basis, n: int, block: int) -> Projection:
    """bf16-screen / fp32-screen: a GEMM screen per block, then the numba kernel (module docstring)."""
    low = basis.method == "bf16-screen"
    threads = max(1, min(torch.get_num_threads(), kernels.numba.config.NUMBA_NUM_THREADS))
    if kernels.numba.get_num_threads() != threads:
        kernels.numba.set_num_threads(threads)
    rows = vectors.shape[0]
    top_ids, bottom_ids = np.empty((rows, n), np.int64), np.empty((rows, n), np.int64)
    top_scores, bottom_scores = np.empty((rows, n), np.float32), np.empty((rows, n), np.float32)
    candidates = np.empty(rows, np.int64)
    columns = basis.columns.numpy()
    norms = basis.norms.numpy()
    error_norms = basis.error_norms.numpy() if low else norms
    cap = _cap(n, basis.vocab)
    no_bits, no_screen = np.empty((0, 0), np.uint16), np.empty((0, 0), np.float32)
    precise = torch.get_float32_matmul_precision() == "highest"
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        a = vectors[start:stop].float().cpu().contiguous()  # [block, d]
        if low:
            a_low = a.bfloat16()
            screen = a_low @ basis.low.T  # [block, vocab] bfloat16
            x, y, beta, tau = screen_bound(a, basis, low=a_low)
            bits, values = screen.view(torch.int16).numpy().view(np.uint16), no_screen
        else:
            screen = a @ basis.matrix  # [block, vocab] float32
            x, y, beta, tau = screen_bound(a, basis, precise=precise)
            bits, values = no_bits, screen.numpy()
        kernels.screen_select(bits, values, a.numpy(), columns, norms, error_norms, x.numpy(), y.numpy(),
                              np.float32(beta), tau.numpy(), n, cap, top_ids[start:stop], top_scores[start:stop],
                              bottom_ids[start:stop], bottom_scores[start:stop], candidates[start:stop])
        del screen
    full = candidates < 0
    stats = ProjectionStats(basis.method, rows, int(candidates[~full].sum()), int(full.sum()))
    return Projection(*(torch.from_numpy(t) for t in (top_ids, top_scores, bottom_ids, bottom_scores)), stats)


def _torch_screen(vectors: Tensor, basis: Basis, n: int, block: int) -> Projection:
    """torch-screen: per row one bound E (eps at its largest over the tokens); the top 2n + 8 by S hold
    every candidate when their last is below the n-th minus 2E (likewise the bottom)."""
    device = basis.matrix.device
    vocab = basis.vocab
    keep = min(vocab, 2 * n + _SPARE)
    precise = torch.get_float32_matmul_precision() == "highest" and not (
        device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
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
                scores = _exact_gathered(a[rows], basis.columns, ids)
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


def _topk(vectors: Tensor, basis: Basis, n: int, block: int) -> Projection:
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


def _norms(rows: Tensor) -> tuple[Tensor, float]:
    """Upper bounds (float32 [n]) of each row's 2-norm, and the largest (float64 sums, rounded up)."""
    norms = _up(torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64))
    return norms, float(norms.max()) if norms.numel() else 0.0


def _up(values: Tensor) -> Tensor:
    """float64 -> float32, never below the float64 value (for values far from float32's range limits)."""
    return (values * _UP).float()


def _cap(n: int, vocab: int) -> int:
    """Candidates a side may hold before its row is rescored in full. A candidate costs what a token
    of a full rescoring costs (one exact dot product), so the cap is generous: past it the margin is
    thin everywhere (a zero vector: every token ties)."""
    return max(8 * n + 64, vocab // 16)


def _check_finite(values: Tensor, what: str) -> None:
    if not bool(torch.isfinite(values).all()):
        bad = int((~torch.isfinite(values)).any(dim=-1).sum())
        raise KvmemError(f"the projection's {what} hold NaN or inf ({bad} rows of {values.shape[0]}); "
                         f"the exact top and bottom tokens need finite weights")
