"""Fixed, documented histogram bins for memory coefficients, and a fast exact binning.

Bins are sign-symmetric and logarithmic with two bins per octave, edges at 2^e and 1.5·2^e:

    magnitude bins (30):  [0, 2^-7), [2^-7, 1.5·2^-7), [1.5·2^-7, 2^-6), ..., [1.5·2^6, 2^7), [2^7, inf)
    HIST_BINS = 60: bins 0..29 hold negative values (most negative first), 30..59 non-negative ones.

So bin 30 is [0, 2^-7), bin 29 is (-2^-7, -0]; a value v < 0 lands in bin 29 - j where j is
the magnitude bin of |v|. Float32 bits give the bin directly: the exponent and the first
mantissa bit of |v| are ``(bits & 0x7fffffff) >> 22``. NaN is not expected (never produced by
a finite model); it would land in an end bin.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HIST_BINS", "MAGNITUDE_EDGES", "bin_edges", "bin_index", "histogram_update", "reference_bin", "bin_of", "positive_counts"]

_LOW_EXP = -7  # smallest finite edge 2^-7
_HIGH_EXP = 7  # largest finite edge 2^7
_CODE_LOW = (127 + _LOW_EXP) * 2  # (exponent field * 2 + first mantissa bit) of 2^-7
N_MAGNITUDE = 2 * (_HIGH_EXP - _LOW_EXP) + 2  # 30
HIST_BINS = 2 * N_MAGNITUDE  # 60

# finite edges of the magnitude bins, ascending: 2^-7, 1.5*2^-7, 2^-6, ..., 1.5*2^6, 2^7
MAGNITUDE_EDGES = tuple(float(m * 2.0**e) for e in range(_LOW_EXP, _HIGH_EXP) for m in (1.0, 1.5)) + (2.0**_HIGH_EXP,)


def bin_edges() -> list[float]:
    """The 61 edges of the 60 bins, -inf .. inf; bin b is [edges[b], edges[b+1]) for b >= 30,
    (edges[b], edges[b+1]] for b < 30 (negative side, mirrored)."""
    magnitudes = [0.0, *MAGNITUDE_EDGES, float("inf")]
    return [-m for m in reversed(magnitudes[1:])] + magnitudes


def bin_index(values):
    """Bin of each float32 value (torch tensor of any shape) -> int32 tensor in [0, HIST_BINS)."""
    import torch

    bits = values.contiguous().view(torch.int32)
    code = (bits & 0x7FFFFFFF) >> 22  # exponent field * 2 + first mantissa bit
    code.sub_(_CODE_LOW - 1).clamp_(0, N_MAGNITUDE - 1)  # magnitude bin j
    return torch.where(bits < 0, (N_MAGNITUDE - 1) - code, N_MAGNITUDE + code)


_RAW_CODES = 1024  # sign bit, 8 exponent bits and the first mantissa bit of a float32: (bits >> 22) & 0x3FF


def _raw_to_bin():
    """[1024] int64: the bin of every raw code (sign << 9 | exponent << 1 | first mantissa bit)."""
    import torch

    code = torch.arange(_RAW_CODES, dtype=torch.int32)
    magnitude = (code & 0x1FF).sub(_CODE_LOW - 1).clamp(0, N_MAGNITUDE - 1)
    return torch.where(code >= 512, (N_MAGNITUDE - 1) - magnitude, N_MAGNITUDE + magnitude).to(torch.int64)


_LUT: dict = {}


def _tables(d_ff: int, device):
    import torch

    key = (str(device), d_ff)
    if key not in _LUT:
        # neuron offsets for the bincount index: (bits >> 22) * d_ff + neuron + 512 * d_ff >= 0
        lut = _raw_to_bin().to(device)
        rows = (torch.arange(_RAW_CODES, device=device) - 512) & 0x3FF  # bincount row -> raw code
        _LUT[key] = (lut, torch.arange(d_ff, dtype=torch.int32, device=device) + 512 * d_ff, lut[rows])
    return _LUT[key]


def bin_of(values):
    """Bin of each value of a float32 tensor [..., d_ff] -> int64 tensor (same bins as :func:`bin_index`)."""
    import torch

    lut = _tables(values.shape[-1], values.device)[0]
    raw = (values.contiguous().view(torch.int32) >> 22) & 0x3FF
    return lut.index_select(0, raw.view(-1)).view(raw.shape)  # index_select: 6x faster than lut[raw]


def histogram_update(counts, values):
    """counts [d_ff, HIST_BINS] int64 += per-neuron histogram of values [N, d_ff] float32.

    One arithmetic shift gives each value's raw code (sign, exponent and first mantissa bit:
    1024 possible); one bincount over ``code * d_ff + neuron`` (code-major, which keeps its writes
    local) counts them; a fixed lookup folds the raw codes into the 60 bins. Same bins as
    :func:`bin_index`. Returns the raw counts [1024, d_ff] by shifted bits (see :func:`positive_counts`).
    """
    import torch

    n, d_ff = values.shape
    device = values.device
    _, neurons, row_lut = _tables(d_ff, device)
    # (bits >> 22) is sign-extended: -512..511, sign bit set below 0; offset it to 0..1023 with the neuron
    index = torch.add(neurons, values.contiguous().view(torch.int32) >> 22, alpha=d_ff)  # one pass for * and +
    # row r counts the values whose shifted bits are r - 512, i.e. raw code (r - 512) & 0x3FF
    per_row = torch.bincount(index.view(-1), minlength=_RAW_CODES * d_ff).view(_RAW_CODES, d_ff)
    folded = torch.zeros(HIST_BINS, d_ff, dtype=torch.int64, device=device)
    folded.index_add_(0, row_lut, per_row)
    counts += folded.T
    return per_row


def positive_counts(per_row, values):
    """#{m > 0} per neuron [d_ff] int64 from :func:`histogram_update`'s counts [1024, d_ff] (row 512 + c
    holds raw code c: codes 1..511 are positive; code 0 holds +0.0 and the smallest positive
    subnormals, which are counted from the values only when it is not empty)."""
    import torch

    positive = per_row[513:].sum(dim=0)
    if bool(per_row[512].any()):
        positive += torch.count_nonzero((values > 0) & (values < 2.0**-127), dim=0)
    return positive


def reference_bin(value: float) -> int:
    """Plain-Python definition of the bin of one value (used by tests to check :func:`bin_index`)."""
    magnitude = abs(value)
    edges = np.asarray(MAGNITUDE_EDGES)
    j = int(np.searchsorted(edges, magnitude, side="right"))
    negative = np.signbit(np.float32(value))
    return (N_MAGNITUDE - 1 - j) if negative else (N_MAGNITUDE + j)
