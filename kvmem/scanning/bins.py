"""Fixed, documented histogram bins for memory coefficients, and a fast exact binning.

Bins are sign-symmetric and logarithmic with two bins per octave, edges at 2^e and 1.5·2^e:

    magnitude bins (30):  [0, 2^-7), [2^-7, 1.5·2^-7), [1.5·2^-7, 2^-6), ..., [1.5·2^6, 2^7), [2^7, inf)
    HIST_BINS = 60: bins 0..29 hold negative values (most negative first), 30..59 non-negative ones.

So bin 30 is [0, 2^-7), bin 29 is (-2^-7, -0]; a value v < 0 lands in bin 29 - j where j is
the magnitude bin of |v|. Float32 bits give the bin directly: the exponent and the first
mantissa bit of |v| are ``(bits & 0x7fffffff) >> 22`` (:func:`bin_of`, the one spelling
of the rule). A scan refuses non-finite coefficients (:mod:`kvmem.scanning.step`), so NaN never
reaches a histogram.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HIST_BINS", "N_MAGNITUDE", "MAGNITUDE_CODE_ZERO", "MAGNITUDE_EDGES", "bin_edges", "bin_of",
           "bin_index", "histogram_update", "histogram_fold",
           "reference_bin"]

_LOW_EXP = -7  # smallest finite edge 2^-7
_HIGH_EXP = 7  # largest finite edge 2^7
# m = exponent field * 2 + first mantissa bit of |v|; m <= MAGNITUDE_CODE_ZERO: magnitude bin 0 ([0, 2^-7))
MAGNITUDE_CODE_ZERO = (127 + _LOW_EXP) * 2 - 1
N_MAGNITUDE = 2 * (_HIGH_EXP - _LOW_EXP) + 2  # 30
HIST_BINS = 2 * N_MAGNITUDE  # 60

# finite edges of the magnitude bins, ascending: 2^-7, 1.5*2^-7, 2^-6, ..., 1.5*2^6, 2^7
MAGNITUDE_EDGES = tuple(float(m * 2.0**e) for e in range(_LOW_EXP, _HIGH_EXP) for m in (1.0, 1.5)) + (2.0**_HIGH_EXP,)


def bin_edges() -> list[float]:
    """The 61 edges of the 60 bins, -inf .. inf; bin b is [edges[b], edges[b+1]) for b >= 30,
    (edges[b], edges[b+1]] for b < 30 (negative side, mirrored)."""
    magnitudes = [0.0, *MAGNITUDE_EDGES, float("inf")]
    return [-m for m in reversed(magnitudes[1:])] + magnitudes


def bin_of(values, *, wide: bool = True):
    """Bin of each value of a float32 tensor [..., d_ff] -> int64 tensor (int32 unless ``wide``)."""
    import torch

    shifted = values.contiguous().view(torch.int32) >> 22  # m for v >= 0, m - 512 for v < 0
    j = (shifted & 0x1FF).sub_(MAGNITUDE_CODE_ZERO).clamp_(0, N_MAGNITUDE - 1)  # magnitude bin
    bins = j.bitwise_xor_(shifted >> 31).add_(N_MAGNITUDE)
    return bins.long() if wide else bins


def bin_index(values):
    """Bin of each float32 value (torch tensor of any shape) -> int32 tensor in [0, HIST_BINS)."""
    return bin_of(values, wide=False)


_LUT: dict = {}

# histogram_update's table: clamping t to [_M0 - 512, _M1] merges the small negatives into
# m = _M0 and the large positives into m = _M1 without changing any bin, so the bincount table
# needs 512 - _M0 + _M1 + 1 rows, not 1024.
_M0 = MAGNITUDE_CODE_ZERO  # m <= _M0: magnitude bin 0 ([0, 2^-7))
_M1 = _M0 + N_MAGNITUDE - 1  # m >= _M1: the last magnitude bin ([2^7, inf))
_T_LOW, _T_HIGH = _M0 - 512, _M1
_TABLE_ROWS = _T_HIGH - _T_LOW + 1
_SPLIT = -_T_LOW  # table row of t = 0: rows below hold negative values (m = row + _M0), rows from it non-negative (m = row - _SPLIT)


def _offsets(d_ff: int, device):
    """[d_ff] int32: neuron - _T_LOW * d_ff, so that t * d_ff + offset = (t - _T_LOW) * d_ff + neuron."""
    import torch

    key = ("offsets", str(device), d_ff)
    if key not in _LUT:
        _LUT[key] = torch.arange(d_ff, dtype=torch.int32, device=device) - _T_LOW * d_ff
    return _LUT[key]


def histogram_update(counts, values, index_buffer=None):
    """counts [d_ff, HIST_BINS] int64 += per-neuron histogram of values [N, d_ff] float32; returns
    #{v > 0} per neuron [d_ff] int64 (:func:`histogram_fold`, its read done at once)."""
    import torch

    from kvmem.scanning.reads import run_rounds

    positive = torch.zeros(values.shape[1], dtype=torch.int64, device=values.device)
    run_rounds([histogram_fold(counts, positive, values, index_buffer)])
    return positive


def histogram_fold(counts, positive, values, index_buffer=None):
    """counts [d_ff, HIST_BINS] int64 += per-neuron histogram of values [N, d_ff] float32, and positive
    [d_ff] int64 += #{v > 0}; the histogram now, and -> a pending step (:mod:`kvmem.scanning.reads`)
    with one read: whether a positive value below 2^-127 needs counting apart.

    One arithmetic shift gives each value's sign, exponent and first mantissa bit; a clamp merges
    the codes that share an end bin; one count over ``code * d_ff + neuron`` (code-major, which
    keeps its writes local; ``index_add_``, whose output size is given: ``bincount`` asks a GPU for
    the largest code) counts them; sums over row ranges fold the codes into the 60 bins.
    Same bins as :func:`bin_index`. ``index_buffer``: optional int32 storage of at least N·d_ff
    elements for the index (saves allocating, and faulting in, a fresh one per batch).
    """
    import torch

    n, d_ff = values.shape
    bits = values.contiguous().view(torch.int32)
    index = torch.empty_like(bits) if index_buffer is None else index_buffer[:bits.numel()].view(bits.shape)
    torch.bitwise_right_shift(bits, 22, out=index).clamp_(_T_LOW, _T_HIGH)
    torch.add(_offsets(d_ff, values.device), index, alpha=d_ff, out=index)
    # int32 counts (a cell counts at most N < 2^31 values): index_add_ runs faster than into int64
    table = torch.zeros(_TABLE_ROWS * d_ff, dtype=torch.int32, device=values.device)
    table.index_add_(0, index.view(-1), _ones(index.numel(), values.device))
    table = table.view(_TABLE_ROWS, d_ff)
    negative = table[:_SPLIT]  # row r: m = r + _M0, from _M0 (bin 0 of |v|) up to 511
    negative = torch.cat([negative[:N_MAGNITUDE - 1], negative[N_MAGNITUDE - 1:].sum(0, keepdim=True)])  # [30]: j = r
    non_negative = table[_SPLIT:]  # row r: m = r, from 0 up to _M1
    non_negative = torch.cat([non_negative[:_M0 + 1].sum(0, keepdim=True), non_negative[_M0 + 1:]])  # [30]: j
    counts[:, :N_MAGNITUDE] += negative.flip(0).T  # bin 29 - j holds negative magnitude bin j
    counts[:, N_MAGNITUDE:] += non_negative.T
    # table row _SPLIT (t = 0) holds +0.0 and the positive values below 2^-127: count those exactly when there are any
    positive += non_negative.sum(0) - table[_SPLIT]
    return _tiny_positives(positive, values, table[_SPLIT].any())


def _tiny_positives(positive, values, any_at_zero):
    from kvmem.scanning.reads import sizes

    (at_zero,) = yield sizes(any_at_zero)
    if at_zero:
        import torch

        positive += torch.count_nonzero((values > 0) & (values < 2.0**-127), dim=0)


def _ones(n: int, device):
    """[n] int32 ones without writing them: one element, expanded (``index_add_``'s source)."""
    import torch

    key = ("one", str(device))
    if key not in _LUT:
        _LUT[key] = torch.ones(1, dtype=torch.int32, device=device)
    return _LUT[key].expand(n)


def reference_bin(value: float) -> int:
    """Plain-Python definition of the bin of one value (used by tests to check :func:`bin_index`)."""
    magnitude = abs(value)
    edges = np.asarray(MAGNITUDE_EDGES)
    j = int(np.searchsorted(edges, magnitude, side="right"))
    negative = np.signbit(np.float32(value))
    return (N_MAGNITUDE - 1 - j) if negative else (N_MAGNITUDE + j)
