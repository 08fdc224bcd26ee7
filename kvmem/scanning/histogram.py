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

__all__ = ["HIST_BINS", "MAGNITUDE_EDGES", "bin_edges", "bin_index", "histogram_update"]

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


def histogram_update(counts, values_t, neuron_offsets) -> None:
    """counts [d_ff, HIST_BINS] int64 += per-neuron histogram of values_t [d_ff, N] (float32, neuron-major:
    each neuron's indices are then adjacent, which keeps the bincount's writes local)."""
    import torch

    index = bin_index(values_t)
    index.add_(neuron_offsets.view(-1, 1))  # neuron_offsets [d_ff] = arange(d_ff) * HIST_BINS, int32
    counts.view(-1).add_(torch.bincount(index.view(-1), minlength=counts.numel()))


def reference_bin(value: float) -> int:
    """Plain-Python definition of the bin of one value (used by tests to check :func:`bin_index`)."""
    magnitude = abs(value)
    edges = np.asarray(MAGNITUDE_EDGES)
    j = int(np.searchsorted(edges, magnitude, side="right"))
    negative = np.signbit(np.float32(value))
    return (N_MAGNITUDE - 1 - j) if negative else (N_MAGNITUDE + j)
