"""The top and bottom n tokens of every row of ``vectors @ basis``, exactly, at the machine's GEMM speed:
the one place that picks a method (:func:`select_method`), and the numba methods' wrapper.

What a score is, the tie order and the screen's error bound (with its proof): :mod:`kvmem.scanning.projection_rules`.

**Methods** (``method=``, else the ``KVMEM_PROJECTION`` environment variable, else ``auto``):

- ``bf16-screen``: a bfloat16 GEMM screens every score, a numba kernel keeps the candidates the error
  bound cannot exclude and rescores them exactly (CPU). Chosen by ``auto`` on a CPU that
  multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16), with torch's oneDNN and numba usable.
- ``fp32-screen``: the same with a float32 GEMM screen (CPU, numba); ``auto`` on other CPUs.
- ``torch-screen``: a float32 GEMM screen, ``torch.topk`` of 2n + 8 per side, exact rescoring in torch
  (any device); ``auto`` on CUDA, and on a CPU where numba cannot load.
- ``fp32-topk``: a float32 GEMM and ``torch.topk`` (the first kvmem's way): the GEMM's rounding in the
  scores, the tie rule only among the n kept. Explicit only.

The three screens give the same ids and scores to the bit; where the margin is too thin (more than
``cap`` candidates on a side, e.g. an all-zero vector where every token ties, or scores near
float32's range) a row is rescored in full. :class:`ProjectionStats` counts both.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
from torch import Tensor

from kvmem import environment
from kvmem.errors import KvmemError
from kvmem.scanning.projection_rules import (
    CPU_METHODS,
    EXACT_METHODS,
    METHODS,
    Basis,
    Projection,
    ProjectionStats,
    check_finite,
    keeps_fp32_inputs,
    prepare_basis,
    screen_bound,
)
from kvmem.scanning.projection_torch import fp32_topk, torch_screen

__all__ = ["Projection", "ProjectionStats", "Basis", "METHODS", "EXACT_METHODS", "ENV", "BLOCK", "score_rule", "select_method",
           "prepare_basis", "project_rows", "bf16_units", "screen_bound"]

ENV = "KVMEM_PROJECTION"  # environment variable naming a method
BLOCK = {"bf16-screen": 256, "fp32-screen": 512, "torch-screen": 512, "fp32-topk": 512}  # rows per GEMM (CPU)
CUDA_BLOCK = 4096  # rows per GEMM on a GPU (fewer, larger launches)

_NUMBA: list = []  # [kernels module] once they loaded, [None] once they failed (warned once per process)


@functools.lru_cache(maxsize=1)
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

            for method in CPU_METHODS:  # compiles or loads the kernel for both screens (bfloat16 and float32 bits)
                _screened(projection_kernels, torch.ones(2, 4), prepare_basis(torch.eye(4), method=method), 1, 2)
            _NUMBA.append(projection_kernels)
        except Exception as error:  # numba missing, or present but unusable here (e.g. no writable cache)
            warnings.warn(f"kvmem: the compiled projection kernels are unavailable ({type(error).__name__}: {error}); "
                          f"projecting with torch-screen (set NUMBA_CACHE_DIR to a writable directory, or "
                          f"{ENV}=torch-screen to silence this)", RuntimeWarning, stacklevel=3)
            _NUMBA.append(None)
    return _NUMBA[0]


def _requested(name: str | None) -> str:
    """The method asked for: ``name``, else ``KVMEM_PROJECTION``, else ``auto`` (checked, lower case)."""
    chosen = (name or environment.read(ENV) or "auto").lower()
    if chosen not in METHODS and chosen != "auto":
        source = "projection method" if name else ENV
        raise KvmemError(f"unknown {source} {chosen!r}; choose one of auto, {', '.join(METHODS)}")
    return chosen


def score_rule(name: str | None = None) -> str:
    """What the scores of the method :func:`select_method` would choose are, known without loading a
    kernel: ``exact`` for every exact method (``auto`` picks one on every device), else the method's
    name. A projection cache is keyed by it, so a cached entry is read without loading any kernel."""
    chosen = _requested(name)
    return "exact" if chosen == "auto" or chosen in EXACT_METHODS else chosen


def select_method(device: str | torch.device = "cpu", name: str | None = None) -> str:
    """The projection method for vectors on ``device``: ``name`` if given, else ``KVMEM_PROJECTION``,
    else (``auto``) bf16-screen on a CPU with bfloat16 units, fp32-screen on other CPUs, torch-screen
    on CUDA or where numba cannot load (see the module docstring)."""
    chosen = _requested(name)
    if chosen in CPU_METHODS and _kernels() is None:
        raise KvmemError(f"the projection method {chosen} needs numba, which cannot load here; "
                         f"use {ENV}=torch-screen")
    if chosen != "auto":
        return chosen
    if torch.device(device).type != "cpu" or _kernels() is None:
        return "torch-screen"
    return "bf16-screen" if bf16_units() else "fp32-screen"


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
    check_finite(vectors, "vectors")
    block = block or (CUDA_BLOCK if basis.matrix.device.type == "cuda" else BLOCK[basis.method])
    with torch.inference_mode():
        if basis.method in CPU_METHODS:
            kernels = _kernels()
            if kernels is None:
                raise KvmemError(f"the projection method {basis.method} needs numba, which cannot load here; "
                                 f"use {ENV}=torch-screen")
            return _screened(kernels, vectors, basis, n, block)
        if basis.method == "torch-screen":
            return torch_screen(vectors, basis, n, block)
        return fp32_topk(vectors, basis, n, block)


def _screened(kernels, vectors: Tensor, basis: Basis, n: int, block: int) -> Projection:
    """bf16-screen / fp32-screen: a GEMM screen per block, then the numba kernel (module docstring)."""
    low = basis.method == "bf16-screen"
    kernels.use_threads(torch.get_num_threads())  # numba's threads set to torch's
    rows = vectors.shape[0]
    top_ids, bottom_ids = np.empty((rows, n), np.int64), np.empty((rows, n), np.int64)
    top_scores, bottom_scores = np.empty((rows, n), np.float32), np.empty((rows, n), np.float32)
    candidates = np.empty(rows, np.int64)
    columns = basis.columns.numpy()
    norms = basis.norms.numpy()
    error_norms = basis.error_norms.numpy() if low else norms
    buffers = kernels.scratch(4 * torch.get_num_threads(), basis.vocab, n, _cap(n, basis.vocab))
    vectors = vectors.float().cpu().contiguous()  # [rows, d]
    # the bound's row terms for every row at once: small torch ops pay a thread barrier each
    if low:
        lowered = vectors.bfloat16()
        x, y, beta, tau = screen_bound(vectors, basis, low=lowered)
    else:
        lowered = vectors
        x, y, beta, tau = screen_bound(vectors, basis, precise=keeps_fp32_inputs(torch.device("cpu")))
    a, x, y, tau = vectors.numpy(), x.numpy(), y.numpy(), tau.numpy()
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        screen = basis.screen_buffer(stop - start, lowered.dtype)  # [block, vocab]
        torch.mm(lowered[start:stop], basis.low.T if low else basis.matrix, out=screen)
        if low:
            bits, shift = screen.view(torch.int16).numpy().view(np.uint16), 16
        else:
            bits, shift = screen.view(torch.int32).numpy().view(np.uint32), 0
        kernels.screen_select(bits, shift, a[start:stop], columns, norms, error_norms, x[start:stop], y[start:stop],
                              np.float32(beta), tau[start:stop], n, top_ids[start:stop], top_scores[start:stop],
                              bottom_ids[start:stop], bottom_scores[start:stop], candidates[start:stop], *buffers)
    full = candidates < 0
    stats = ProjectionStats(basis.method, rows, int(candidates[~full].sum()), int(full.sum()))
    return Projection(*(torch.from_numpy(t) for t in (top_ids, top_scores, bottom_ids, bottom_scores)), stats)


def _cap(n: int, vocab: int) -> int:
    """Candidates a side may hold before its row is rescored in full. A candidate costs what a token
    of a full rescoring costs (one exact dot product), so the cap is generous: past it the margin is
    thin everywhere (a zero vector: every token ties)."""
    return max(8 * n + 64, vocab // 16)
