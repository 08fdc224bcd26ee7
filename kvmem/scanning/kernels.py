"""Compiled CPU kernels for the streaming step, with the plain-torch path they replace.

One batch's per-neuron statistics (histogram, #{m > 0}, Σm, Σm², block extremes) read every
coefficient of an [N, F] batch. In eager torch they take a dozen passes over it, several of them
serial (the histogram is a scatter); on a CPU the kernel below reads each coefficient once, in
neuron strips spread over the cores. It is compiled with numba on first use (and cached on
disk), and used for float32 CPU tensors; elsewhere (a GPU, or numba not installed, or
``KVMEM_KERNELS=torch``) the torch path runs. Both give the same histogram, counts and extremes
to the bit; the sums differ only in rounding (see :func:`batch_statistics`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvmem.scanning.histogram import histogram_update
from kvmem.scanning.sides import _ROWS, ContextFn, Side, block_extremes

__all__ = ["BatchStatistics", "Compiled", "batch_statistics", "stream_side", "fold_documents", "bin_sample", "compiled_available", "warm_up", "scratch"]


class BatchStatistics(NamedTuple):
    """Block minima and maxima [ceil(N / rows), F] float32; Σm, Σm² [F] float64."""

    low: Tensor
    high: Tensor
    total: Tensor
    total_sq: Tensor


class Compiled(NamedTuple):
    """The numba kernels (kvmem/scanning/_compiled.py)."""

    statistics: Callable
    side_insert: Callable
    bin_insert: Callable
    document_insert: Callable


_KERNEL: list = []  # [Compiled] once compiled, [None] when numba is unavailable or switched off


def _compile():
    """The numba kernels (statistics, side_insert, bin_insert, document_insert), or None (numba missing, or KVMEM_KERNELS=torch)."""
    if _KERNEL:
        return _KERNEL[0]
    kernels = None
    if os.environ.get("KVMEM_KERNELS", "").lower() != "torch":
        try:
            kernels = _build()
        except ImportError:
            kernels = None
        except Exception as error:  # numba present but unusable here (e.g. no writable cache directory)
            warnings.warn(f"kvmem: the compiled CPU kernels are unavailable ({error}); using the slower torch "
                          "path (set NUMBA_CACHE_DIR to a writable directory, or KVMEM_KERNELS=torch to silence this)",
                          RuntimeWarning, stacklevel=2)
            kernels = None
    _KERNEL.append(kernels)
    return kernels


def _cpu_kernels(tensor: Tensor):
    """The compiled kernels when ``tensor`` is a float32 CPU tensor and they are available, else None;
    numba's threads set to torch's."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
        return None
    kernels = _compile()
    if kernels is not None:
        import numba

        threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        if numba.get_num_threads() != threads:
            numba.set_num_threads(threads)
    return kernels


def warm_up(device) -> bool:
    """Compile (or load from numba's disk cache) every kernel before a scan on ``device``, by one
    update of a tiny state that takes every path; True if the kernels are in use there."""
    if torch.device(device).type != "cpu" or _compile() is None:
        return False
    from kvmem.scanning.accumulator import close_open_document, new_layer_state, update
    from kvmem.scanning.sampling import position_keys

    state = new_layer_state(4, 2, per_document=True, context_width=1, random_samples=2, bin_samples=2,
                            sample_rate=1.0)
    codes = torch.tensor([0, 1, 1 << 32, (1 << 32) + 1])
    update(state, torch.ones(4, 4), codes, lambda rows, neurons: torch.zeros(rows.numel(), 1),
           docs=torch.tensor([0, 0, 1, 1]), keys=position_keys(codes, 0))
    close_open_document(state)
    return True


def compiled_available() -> bool:
    """Whether the compiled CPU kernel is in use (numba importable, not switched off)."""
    return _compile() is not None


def _build():
    """The compiled kernels (an ImportError where numba is not installed)."""
    from kvmem.scanning import _compiled

    return Compiled(_compiled.statistics, _compiled.side_insert, _compiled.bin_insert, _compiled.document_insert)


@torch.inference_mode()  # the scratch buffers are inference tensors
def batch_statistics(acts: Tensor, histogram: Tensor, positive: Tensor) -> BatchStatistics:
    """One batch's statistics. acts [N, F] float32; adds the batch's per-neuron histogram into
    ``histogram`` [F, HIST_BINS] int64 and its #{m > 0} into ``positive`` [F] int64, and returns
    the block extremes (as :func:`kvmem.scanning.sides.block_extremes`) and the sums.

    The compiled kernel sums in float64 along the rows; the torch path sums float32 blocks of 32
    rows, then in float64 (:func:`_column_sum`). Both are deterministic for a given batch.
    """
    n, d_ff = acts.shape
    kernels = _cpu_kernels(acts)
    if kernels is None:
        return _torch_statistics(acts, histogram, positive)
    acts = acts.contiguous()
    blocks = -(-n // _ROWS)
    low = torch.empty(blocks, d_ff, dtype=torch.float32)
    high = torch.empty(blocks, d_ff, dtype=torch.float32)
    total = torch.empty(d_ff, dtype=torch.float64)
    total_sq = torch.empty(d_ff, dtype=torch.float64)
    kernels.statistics(acts.numpy(), _ROWS, histogram.numpy(), positive.numpy(), total.numpy(), total_sq.numpy(),
           low.numpy(), high.numpy())
    return BatchStatistics(low, high, total, total_sq)


def _writable(side: Side) -> Tensor:
    """Make the side's values, codes and slots contiguous (the kernels write them in place) -> a
    fresh ``entered`` [k, F] int64 for the kernel to mark the new entries' rows in."""
    for name in ("values", "codes", "slots"):
        if not getattr(side, name).is_contiguous():
            setattr(side, name, getattr(side, name).contiguous())
    return torch.empty(side.values.shape, dtype=torch.int64)


def _add_context(side: Side, entered: Tensor, context_of: ContextFn) -> None:
    """Read the context of the entries a kernel let in (``entered`` [k, F]: their row, -1 for kept
    entries) and point their slots at it."""
    rank, neuron = (entered != -1).nonzero(as_tuple=True)
    if rank.numel():
        side.slots[rank, neuron] = side.add_context(context_of(entered[rank, neuron], neuron))


def stream_side(side: Side, acts: Tensor, codes: Tensor, context_fn: ContextFn, ordered: bool, extremes: Tensor) -> bool:
    """Insert this batch's positions that enter ``side`` (as :func:`kvmem.scanning.sides.stream_side`),
    with the compiled kernel; False (nothing done) where it does not apply.

    Each neuron walks the rows of the blocks whose extreme reaches its k-th value and inserts
    every coefficient that beats it, in row order, so a position pushed out later in the same
    batch never has its context read: only the entries still kept at the end are looked up.
    """
    kernels = _cpu_kernels(acts)
    if kernels is None:
        return False
    entered = _writable(side)
    kernels.side_insert(acts.contiguous().numpy(), codes.contiguous().numpy(), extremes.contiguous().numpy(), _ROWS,
               side.values.numpy(), side.codes.numpy(), side.slots.numpy(), entered.numpy(), side.largest, ordered)
    _add_context(side, entered, context_fn)
    return True


def fold_documents(side: Side, open_side: Side | None, acts: Tensor, codes: Tensor, starts: Tensor, lengths: Tensor,
                   context_fn: ContextFn, ordered: bool) -> Side | None:
    """Fold each complete document's best into ``side`` and return the last document's best, as
    :func:`kvmem.scanning.accumulator._fold_documents` does, with the compiled kernel (None: it does
    not apply). Documents are rows starts[s] .. starts[s] + lengths[s] - 1 of acts [N, F];
    ``open_side``: the best so far of the first document when it continues from the previous batch.

    A document's best is its most extreme value at the first position holding it; context is read
    only for the entries still kept at the end, and for the last document.
    """
    kernels = _cpu_kernels(acts)
    if kernels is None:
        return None
    entered = _writable(side)
    d_ff = acts.shape[1]
    continues = open_side is not None
    open_value = open_side.values[0].contiguous() if continues else torch.zeros(d_ff)
    open_code = open_side.codes[0].contiguous() if continues else torch.zeros(d_ff, dtype=torch.int64)
    last_value, last_code = torch.empty(d_ff), torch.empty(d_ff, dtype=torch.int64)
    last_row = torch.empty(d_ff, dtype=torch.int64)
    kernels.document_insert(acts.contiguous().numpy(), codes.contiguous().numpy(), starts.contiguous().numpy(),
               lengths.contiguous().numpy(), open_value.numpy(), open_code.numpy(), continues, side.values.numpy(),
               side.codes.numpy(), side.slots.numpy(), entered.numpy(), last_value.numpy(), last_code.numpy(),
               last_row.numpy(), side.largest, ordered)

    def context_of(rows: Tensor, neurons: Tensor) -> Tensor:  # row -2: the open document's earlier best
        context = context_fn(rows.clamp(min=0), neurons)
        earlier = rows == -2
        if continues and bool(earlier.any()):
            context[earlier] = open_side.context[0].index_select(0, neurons[earlier])
        return context

    _add_context(side, entered, context_of)
    neurons = torch.arange(d_ff)
    return Side(last_value[None], last_code[None], context_of(last_row, neurons)[None], side.largest)


def bin_sample(sample, acts: Tensor, rows: Tensor, row_keys: Tensor, row_codes: Tensor) -> bool:
    """Fold the thinned positions ``rows`` [r] (their keys and codes [r]) of acts [N, F] into a
    :class:`kvmem.scanning.sampling.BinSample` with the compiled kernel (each neuron inserts every
    position whose key is under its bin's q-th kept one); False (nothing done) where it does not apply."""
    from kvmem.scanning.sampling import _keys_or_none

    kernels = _cpu_kernels(acts)
    if kernels is None:
        return False
    if sample._last is None or not sample._last.is_contiguous():
        sample._last = _keys_or_none(sample.codes[:, :, -1], sample.seed).T.contiguous()  # [B, F]
    if not (sample.codes.is_contiguous() and sample.values.is_contiguous()):
        sample.codes, sample.values = sample.codes.contiguous(), sample.values.contiguous()
    salt = np.uint64((sample.seed * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))
    kernels.bin_insert(acts.contiguous().numpy(), rows.numpy(), row_keys.numpy(), row_codes.numpy(), sample.codes.numpy(),
               sample.values.numpy(), sample._last.numpy(), salt)
    sample._last_high = None  # the torch path's first cut, stale now
    return True


_BLOCK = 32  # rows summed in float32 before the float64 accumulation (torch path)


def _column_sum(values: Tensor) -> Tensor:
    """Σ over rows of values [N, F] -> [F] float64: float32 over blocks of 32 rows, then float64.

    A block's float32 sum errs by at most ~32·2⁻²⁴ of Σ|m| in the worst case (measured 2e-8 on
    SmolLM2's coefficients), well under a float32 coefficient's own precision, and costs a tenth of
    a float64 sum of every value on a GPU. Deterministic for a given batch.
    """
    n, width = values.shape
    full = n - n % _BLOCK
    total = values[:full].view(-1, _BLOCK, width).sum(dim=1).sum(dim=0, dtype=torch.float64)
    return total + values[full:].sum(dim=0, dtype=torch.float64) if full < n else total


def _torch_statistics(acts: Tensor, histogram: Tensor, positive: Tensor) -> BatchStatistics:
    acts = acts.float()
    low, high = block_extremes(acts)
    total = _column_sum(acts)
    total_sq = _column_sum(torch.mul(acts, acts, out=scratch(acts.shape, torch.float32, acts.device)))
    positive += histogram_update(histogram, acts, scratch(acts.shape, torch.int32, acts.device).view(-1))
    return BatchStatistics(low, high, total, total_sq)


_SCRATCH: dict[tuple[torch.dtype, str], Tensor] = {}


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """A reused buffer of ``shape`` for one batch's temporaries (one per dtype and device): a fresh
    [N, F] tensor per layer and batch would be allocated, and its pages faulted in, every time."""
    numel = 1
    for size in shape:
        numel *= size
    key = (dtype, str(device))
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)
