"""The fixed histogram bins: the float-bit binning equals the documented edges, value by value."""

from __future__ import annotations

import numpy as np
import torch

from kvmem.scanning.bins import HIST_BINS, MAGNITUDE_EDGES, bin_edges, bin_index, histogram_update, reference_bin


def test_edges():
    edges = bin_edges()
    assert len(edges) == HIST_BINS + 1 == 61 and edges[0] == -np.inf and edges[-1] == np.inf
    assert edges[HIST_BINS // 2] == 0.0 and MAGNITUDE_EDGES[0] == 2**-7 and MAGNITUDE_EDGES[-1] == 2**7
    assert all(a < b for a, b in zip(edges, edges[1:]))


def test_bits_match_reference_everywhere():
    special = [0.0, -0.0, 1e-45, -1e-45, 2**-7, np.nextafter(2**-7, 0), 1.5, np.nextafter(1.5, 0), -1.5, 96.0,
               128.0, np.nextafter(128.0, 0), 1e30, -1e30, float("inf"), float("-inf")]
    values = torch.cat([torch.tensor(special, dtype=torch.float32), torch.randn(20_000) * 8,
                        torch.tensor(MAGNITUDE_EDGES, dtype=torch.float32), -torch.tensor(MAGNITUDE_EDGES)])
    assert bin_index(values).tolist() == [reference_bin(float(v)) for v in values]
    # each finite value lies inside its bin's documented edges (negative side mirrored)
    edges = bin_edges()
    for v, b in zip(values.tolist(), bin_index(values).tolist()):
        if not np.signbit(v):
            assert edges[b] <= v < edges[b + 1] or (v == np.inf and b == HIST_BINS - 1)
        else:
            assert edges[b] < v <= edges[b + 1] or (v == -np.inf and b == 0)


def test_histogram_update_counts_per_neuron():
    values = torch.randn(3, 500) * 4  # [d_ff, N]
    counts = torch.zeros(3, HIST_BINS, dtype=torch.int64)
    histogram_update(counts, values.T.contiguous())
    for neuron in range(3):
        expected = np.bincount([reference_bin(float(v)) for v in values[neuron]], minlength=HIST_BINS)
        assert counts[neuron].tolist() == expected.tolist()


def test_histogram_update_covers_every_raw_code():
    """Every float32 sign / exponent / first-mantissa-bit pattern lands in the reference bin."""
    code = torch.arange(1024, dtype=torch.int64)
    bits = ((code >> 9) << 31) | ((code & 0x1FF) << 22) | 0x12345  # any lower mantissa bits
    values = torch.tensor(bits.tolist(), dtype=torch.int64).to(torch.int32).view(torch.float32)
    values = values[torch.isfinite(values)]
    counts = torch.zeros(len(values), HIST_BINS, dtype=torch.int64)
    histogram_update(counts, values.view(1, -1))  # one position, neuron i holds value i
    assert counts.sum(1).tolist() == [1] * len(values)
    assert counts.argmax(1).tolist() == [reference_bin(float(v)) for v in values]


def test_histogram_update_returns_exact_positive_counts():
    """#{v > 0} per neuron, with +0.0, -0.0, subnormals and values beyond both end bins."""
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 2.0**-130, 1e30, -1e30, 2.0**-7, -3.0])
    values = torch.cat([special, torch.randn(490) * 16]).view(-1, 5)  # [100, 5]
    counts = torch.zeros(5, HIST_BINS, dtype=torch.int64)
    positive = histogram_update(counts, values)
    assert positive.tolist() == (values.numpy() > 0).sum(0).tolist()
    assert counts.sum(1).tolist() == [100] * 5
    for neuron in range(5):
        expected = np.bincount([reference_bin(float(v)) for v in values[:, neuron]], minlength=HIST_BINS)
        assert counts[neuron].tolist() == expected.tolist()
