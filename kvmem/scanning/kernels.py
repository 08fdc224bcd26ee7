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

import numpy as np
import torch
from torch import Tensor

from kvmem.scanning.histogram import _CODE_LOW, HIST_BINS, N_MAGNITUDE, histogram_update
from kvmem.scanning.sides import _ROWS, ContextFn, Side, block_extremes

__all__ = ["BatchStatistics", "batch_statistics", "stream_side", "fold_documents", "bin_sample", "compiled_available", "scratch"]

_STRIP = 128  # neurons per strip: one strip's histogram (64 x 128 int32) stays in L1


class BatchStatistics(tuple):
    """(low, high, total, total_sq): block minima and maxima [ceil(N / rows), F] float32 and
    Σm, Σm² [F] float64."""

    __slots__ = ()

    def __new__(cls, low: Tensor, high: Tensor, total: Tensor, total_sq: Tensor):
        return super().__new__(cls, (low, high, total, total_sq))

    low = property(lambda self: self[0])
    high = property(lambda self: self[1])
    total = property(lambda self: self[2])
    total_sq = property(lambda self: self[3])


_KERNEL: list = []  # [compiled function] once compiled, [None] when numba is unavailable or switched off


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


def compiled_available() -> bool:
    """Whether the compiled CPU kernel is in use (numba importable, not switched off)."""
    return _compile() is not None


def _build():
    import numba

    from kvmem.scanning.sampling import _NO_KEY, KEY_BITS  # (sampling imports this module)

    m0 = _CODE_LOW - 1  # magnitude code at or below which the magnitude bin is 0
    last_bin = N_MAGNITUDE - 1
    strip = _STRIP

    @numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
    def statistics(acts, rows_per_block, histogram, positive, total, total_sq, low, high):  # pragma: no cover - compiled
        n, d_ff = acts.shape
        bits = acts.view(np.int32)
        for s in numba.prange((d_ff + strip - 1) // strip):
            f0 = s * strip
            f1 = min(d_ff, f0 + strip)
            w = f1 - f0
            counts = np.zeros(64 * strip, np.int32)  # counts[bin * strip + i]
            place = np.empty(strip, np.int32)
            sums = np.zeros(strip, np.float64)
            squares = np.zeros(strip, np.float64)
            above = np.zeros(strip, np.int64)
            for b0 in range(0, n, rows_per_block):
                block = b0 // rows_per_block
                lo = acts[b0, f0:f1].copy()
                hi = acts[b0, f0:f1].copy()
                for r in range(b0, min(n, b0 + rows_per_block)):
                    row = acts[r, f0:f1]
                    for i in range(w):
                        v = row[i]
                        lo[i] = v if v < lo[i] else lo[i]
                        hi[i] = v if v > hi[i] else hi[i]
                        d = np.float64(v)
                        sums[i] += d
                        squares[i] += d * d
                        above[i] += 1 if v > 0 else 0
                    code = bits[r, f0:f1]
                    for i in range(w):
                        t = code[i] >> 22  # sign, exponent and first mantissa bit (arithmetic shift)
                        j = min(max((t & 0x1FF) - m0, 0), last_bin)  # magnitude bin
                        place[i] = (N_MAGNITUDE + (j ^ (t >> 31))) * strip + i  # j ^ -1 = -1 - j for v < 0
                    for i in range(w):
                        counts[place[i]] += 1
                low[block, f0:f1] = lo
                high[block, f0:f1] = hi
            for i in range(w):
                total[f0 + i] = sums[i]
                total_sq[f0 + i] = squares[i]
                positive[f0 + i] += above[i]
                for b in range(HIST_BINS):
                    histogram[f0 + i, b] += counts[b * strip + i]

    @numba.njit(inline="always")
    def insert(values, kept, slots, entered, f, v, c, mark, largest, ordered):  # pragma: no cover - compiled
        """Insert (v, c) into column f of a side if it enters: it beats the k-th value, or (out of
        order) ties it with a lower code. ``mark`` goes into ``entered`` at its rank."""
        k = values.shape[0]
        kth = values[k - 1, f]
        if not (v > kth if largest else v < kth):
            # a tie enters only out of order, by a lower code than the k-th's (an empty one never)
            if ordered or v != kth or not (c < kept[k - 1, f]):
                return
        p = k - 1
        while p > 0:
            u, cu = values[p - 1, f], kept[p - 1, f]
            if (u > v if largest else u < v) or (u == v and (ordered or (cu != -1 and cu < c))):
                break  # entry p - 1 stays ahead
            values[p, f], kept[p, f] = u, cu
            slots[p, f], entered[p, f] = slots[p - 1, f], entered[p - 1, f]
            p -= 1
        values[p, f], kept[p, f], slots[p, f], entered[p, f] = v, c, 0, mark

    @numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
    def side_insert(acts, codes, extremes, rows_per_block, values, kept, slots, entered, largest, ordered
                    ):  # pragma: no cover - compiled
        n, d_ff = acts.shape
        k = values.shape[0]
        for f in numba.prange(d_ff):
            for i in range(k):
                entered[i, f] = -1
            for b in range(extremes.shape[0]):
                e, kth = extremes[b, f], values[k - 1, f]
                if not ((e > kth if largest else e < kth) or (not ordered and e == kth)):
                    continue
                for r in range(b * rows_per_block, min(n, (b + 1) * rows_per_block)):
                    insert(values, kept, slots, entered, f, acts[r, f], codes[r], r, largest, ordered)

    @numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
    def document_insert(acts, codes, starts, lengths, open_value, open_code, continues, values, kept, slots,
                        entered, last_value, last_code, last_row, largest, ordered):  # pragma: no cover - compiled
        k, d_ff = values.shape
        documents = starts.shape[0]
        for f in numba.prange(d_ff):
            for i in range(k):
                entered[i, f] = -1
            for d in range(documents):
                row = starts[d]
                best = acts[row, f]
                for r in range(row + 1, row + lengths[d]):  # strictly better: the first position holding the best
                    v = acts[r, f]
                    if v > best if largest else v < best:
                        best, row = v, r
                code = codes[row]
                if d == 0 and continues and not (best > open_value[f] if largest else best < open_value[f]):
                    best, code, row = open_value[f], open_code[f], -2  # the earlier best stays (lower code)
                if d < documents - 1:
                    insert(values, kept, slots, entered, f, best, code, row, largest, ordered)
                else:
                    last_value[f], last_code[f], last_row[f] = best, code, row

    no_key = np.int64(_NO_KEY)
    golden, mix1, mix2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    drop = np.uint64(64 - KEY_BITS)

    @numba.njit(inline="always")
    def key_of(code, salt):  # pragma: no cover - compiled; position_keys of one code (_NO_KEY when empty)
        if code < 0:
            return no_key
        x = (np.uint64(code) ^ salt) + golden
        x = (x ^ (x >> np.uint64(30))) * mix1
        x = (x ^ (x >> np.uint64(27))) * mix2
        x = x ^ (x >> np.uint64(31))
        return np.int64(x >> drop)

    @numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
    def bin_insert(acts, rows, row_keys, row_codes, codes, values, last, salt):  # pragma: no cover - compiled
        d_ff, bins, q = codes.shape
        bits = acts.view(np.int32)
        for s in numba.prange((d_ff + strip - 1) // strip):
            f0 = s * strip
            w = min(d_ff, f0 + strip) - f0
            cell = np.empty(strip, np.int64)
            for i in range(rows.shape[0]):
                key, c, code = row_keys[i], row_codes[i], bits[rows[i], f0:f0 + w]
                for j in range(w):  # each neuron's bin, and whether the key is under that bin's q-th (a first cut)
                    t = code[j] >> 22
                    b = N_MAGNITUDE + (min(max((t & 0x1FF) - m0, 0), last_bin) ^ (t >> 31))
                    cell[j] = b if key <= last[b, f0 + j] else -1
                for j in range(w):
                    b = cell[j]
                    if b < 0:
                        continue
                    f = f0 + j
                    if key == last[b, f] and not (c < codes[f, b, q - 1] or codes[f, b, q - 1] < 0):
                        continue  # ties the q-th kept key with a higher code
                    p = q - 1
                    while p > 0:
                        ahead_code = codes[f, b, p - 1]
                        if ahead_code >= 0:
                            ahead = key_of(ahead_code, salt)
                            if ahead < key or (ahead == key and ahead_code < c):
                                break
                        codes[f, b, p], values[f, b, p] = ahead_code, values[f, b, p - 1]
                        p -= 1
                    codes[f, b, p], values[f, b, p] = c, acts[rows[i], f]
                    last[b, f] = key_of(codes[f, b, q - 1], salt)

    return statistics, side_insert, bin_insert, document_insert


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
    kernels[0](acts.numpy(), _ROWS, histogram.numpy(), positive.numpy(), total.numpy(), total_sq.numpy(),
           low.numpy(), high.numpy())
    return BatchStatistics(low, high, total, total_sq)


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
    for name in ("values", "codes", "slots"):
        if not getattr(side, name).is_contiguous():
            setattr(side, name, getattr(side, name).contiguous())
    entered = torch.empty(side.values.shape, dtype=torch.int64)
    kernels[1](acts.contiguous().numpy(), codes.contiguous().numpy(), extremes.contiguous().numpy(), _ROWS,
               side.values.numpy(), side.codes.numpy(), side.slots.numpy(), entered.numpy(), side.largest, ordered)
    rank, neuron = (entered >= 0).nonzero(as_tuple=True)
    if rank.numel():
        rows = entered[rank, neuron]
        side.slots[rank, neuron] = side.add_context(context_fn(rows, neuron))
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
    for name in ("values", "codes", "slots"):
        if not getattr(side, name).is_contiguous():
            setattr(side, name, getattr(side, name).contiguous())
    d_ff = acts.shape[1]
    continues = open_side is not None
    open_value = open_side.values[0].contiguous() if continues else torch.zeros(d_ff)
    open_code = open_side.codes[0].contiguous() if continues else torch.zeros(d_ff, dtype=torch.int64)
    entered = torch.empty(side.values.shape, dtype=torch.int64)
    last_value, last_code = torch.empty(d_ff), torch.empty(d_ff, dtype=torch.int64)
    last_row = torch.empty(d_ff, dtype=torch.int64)
    kernels[3](acts.contiguous().numpy(), codes.contiguous().numpy(), starts.contiguous().numpy(),
               lengths.contiguous().numpy(), open_value.numpy(), open_code.numpy(), continues, side.values.numpy(),
               side.codes.numpy(), side.slots.numpy(), entered.numpy(), last_value.numpy(), last_code.numpy(),
               last_row.numpy(), side.largest, ordered)

    def context_of(rows: Tensor, neurons: Tensor) -> Tensor:  # row -2: the open document's earlier best
        context = context_fn(rows.clamp(min=0), neurons)
        earlier = rows == -2
        if continues and bool(earlier.any()):
            context[earlier] = open_side.context[0].index_select(0, neurons[earlier])
        return context

    rank, neuron = (entered != -1).nonzero(as_tuple=True)
    if rank.numel():
        side.slots[rank, neuron] = side.add_context(context_of(entered[rank, neuron], neuron))
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
    kernels[2](acts.contiguous().numpy(), rows.numpy(), row_keys.numpy(), row_codes.numpy(), sample.codes.numpy(),
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
