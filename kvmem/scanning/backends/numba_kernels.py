"""The numba kernels of :mod:`kvmem.scanning.backends.numba_backend` (imported only where numba is installed).

Module-level functions, so that numba caches them on disk (kernels that call other compiled
functions held in closures are compiled again in every process). The bin and the key are the
rules' own functions, compiled here unchanged. numba's cache is keyed by this file: after a
change to :mod:`kvmem.scanning.histogram` or :mod:`kvmem.scanning.rules`, touch this file.
Shapes and meaning: see the wrappers in :mod:`kvmem.scanning.backends.numba_backend`.
"""

from __future__ import annotations

import numba
import numpy as np

from kvmem.scanning.histogram import HIST_BINS, bin_of_code
from kvmem.scanning.rules import key_of

__all__ = ["statistics", "side_insert", "document_insert", "bin_insert", "quadrant_counts", "window_context"]

_STRIP = 128  # neurons per strip: one strip's histogram (64 x 128 int32) stays in L1
_LINE = 16  # neurons per strip of the candidate search: one cache line of float32 coefficients
_bin = numba.njit(inline="always")(bin_of_code)
_key = numba.njit(inline="always")(key_of)


@numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def statistics(acts, rows_per_block, histogram, positive, total, total_sq, low, high):  # pragma: no cover - compiled
    n, d_ff = acts.shape
    bits = acts.view(np.int32)
    for s in numba.prange((d_ff + _STRIP - 1) // _STRIP):
        f0 = s * _STRIP
        f1 = min(d_ff, f0 + _STRIP)
        w = f1 - f0
        counts = np.zeros(64 * _STRIP, np.int32)  # counts[bin * _STRIP + i]
        place = np.empty(_STRIP, np.int32)
        sums = np.zeros(_STRIP, np.float64)
        squares = np.zeros(_STRIP, np.float64)
        above = np.zeros(_STRIP, np.int64)
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
                    place[i] = _bin(code[i] >> 22) * _STRIP + i  # sign, exponent and first mantissa bit
                for i in range(w):
                    counts[place[i]] += 1
            low[block, f0:f1] = lo
            high[block, f0:f1] = hi
        for i in range(w):
            total[f0 + i] = sums[i]
            total_sq[f0 + i] = squares[i]
            positive[f0 + i] += above[i]
            for b in range(HIST_BINS):
                histogram[f0 + i, b] += counts[b * _STRIP + i]


@numba.njit(inline="always")
def _insert(values, kept, slots, entered, i, v, c, mark, largest, ordered):  # pragma: no cover - compiled
    """Insert (v, c) into neuron i's side, held as row i of four [W, k] arrays (see :func:`_load`), if
    it enters: it beats the k-th value, or (out of order) ties it with a lower code. ``mark`` goes
    into ``entered`` at its rank."""
    k = values.shape[1]
    kth = values[i, k - 1]
    if not (v > kth if largest else v < kth):
        # a tie enters only out of order, by a lower code than the k-th's (an empty one never)
        if ordered or v != kth or not (c < kept[i, k - 1]):
            return
    p = k - 1
    while p > 0:
        u, cu = values[i, p - 1], kept[i, p - 1]
        if (u > v if largest else u < v) or (u == v and (ordered or (cu != -1 and cu < c))):
            break  # entry p - 1 stays ahead
        values[i, p], kept[i, p] = u, cu
        slots[i, p], entered[i, p] = slots[i, p - 1], entered[i, p - 1]
        p -= 1
    values[i, p], kept[i, p], slots[i, p], entered[i, p] = v, c, 0, mark


@numba.njit(inline="always")
def _load(values, kept, slots, f0, w):  # pragma: no cover - compiled
    """Columns f0 .. f0 + w of a side's [k, d_ff] arrays as contiguous [w, k] copies (entered: all -1).
    Inserting into a column in place strides by d_ff at every shift: a dense first batch cost 5 times more so."""
    k = values.shape[0]
    lv, lc, ls = np.empty((w, k), values.dtype), np.empty((w, k), kept.dtype), np.empty((w, k), slots.dtype)
    le = np.full((w, k), -1, np.int64)
    for j in range(k):
        for i in range(w):
            lv[i, j], lc[i, j], ls[i, j] = values[j, f0 + i], kept[j, f0 + i], slots[j, f0 + i]
    return lv, lc, ls, le


@numba.njit(inline="always")
def _store(values, kept, slots, entered, f0, lv, lc, ls, le):  # pragma: no cover - compiled
    for j in range(values.shape[0]):
        for i in range(lv.shape[0]):
            values[j, f0 + i], kept[j, f0 + i], slots[j, f0 + i], entered[j, f0 + i] = (lv[i, j], lc[i, j], ls[i, j],
                                                                                          le[i, j])


@numba.njit(inline="always")
def _reaching(extremes, b, f0, bar, sign):  # pragma: no cover - compiled
    """How many neurons f0 .. f0 + len(bar) have block b's extreme at or beyond their (signed) bar."""
    count = 0
    for i in range(bar.shape[0]):
        count += 1 if sign * extremes[b, f0 + i] >= bar[i] else 0
    return count


@numba.njit(inline="always")
def _bars(extremes, lv, f0, sign, bar):  # pragma: no cover - compiled
    """Each neuron's bar, signed (``sign`` · value, so larger is more extreme on either side): a coefficient
    whose signed value is below it cannot be among the k kept at the end of the batch. It is the larger
    of the k-th kept value and the k-th most extreme block extreme: k distinct rows of the batch reach
    that one, so a coefficient strictly beyond it on the wrong side has k entries ahead of it (fewer
    than k blocks: -inf). The k most extreme block extremes are kept sorted, [k, w], by a branch-free
    insertion the compiler vectorises across the strip; it is skipped where no neuron of the strip has
    more than k blocks reaching its k-th kept value (the raise could not help: a full side's later batches)."""
    w, k = lv.shape
    for i in range(w):
        bar[i] = sign * lv[i, k - 1]
    reaching = np.zeros(w, np.int64)  # blocks whose extreme reaches the k-th kept value
    for b in range(extremes.shape[0]):
        for i in range(w):
            reaching[i] += 1 if sign * extremes[b, f0 + i] >= bar[i] else 0
    if reaching.max() <= k:  # the k-th block extreme is under the k-th kept value (a later batch): no gain
        return
    best = np.full((k, w), -np.inf, np.float32)  # best[p, i]: neuron i's (p+1)-th most extreme block extreme
    e = np.empty(w, np.float32)
    for b in range(extremes.shape[0]):
        for i in range(w):
            x = sign * extremes[b, f0 + i]
            e[i] = x if x == x else -np.inf  # a NaN extreme (a batch the step refuses) bounds nothing
        for p in range(k - 1, 0, -1):
            for i in range(w):
                lower = best[p - 1, i] if best[p - 1, i] < e[i] else e[i]
                best[p, i] = lower if lower > best[p, i] else best[p, i]
        for i in range(w):
            best[0, i] = e[i] if e[i] > best[0, i] else best[0, i]
    for i in range(w):
        bar[i] = max(bar[i], best[k - 1, i])


@numba.njit(inline="always")
def _by_rows(acts, codes, extremes, rows_per_block, f0, lv, lc, ls, le, bar, sign, largest, ordered
             ):  # pragma: no cover - compiled
    """The strip's rows in order, a cache line of neurons at a time (blocks under every bar skipped)."""
    n = acts.shape[0]
    w, k = lv.shape
    for b in range(extremes.shape[0]):
        if _reaching(extremes, b, f0, bar, sign) == 0:
            continue
        for r in range(b * rows_per_block, min(n, (b + 1) * rows_per_block)):
            row = acts[r, f0:f0 + w]
            hits = 0
            for i in range(w):
                hits += 1 if sign * row[i] >= bar[i] else 0
            if hits == 0:
                continue
            for i in range(w):
                if sign * row[i] >= bar[i]:  # a tie with the bar may still enter (out of order)
                    _insert(lv, lc, ls, le, i, row[i], codes[r], r, largest, ordered)
                    bar[i] = max(bar[i], sign * lv[i, k - 1])


@numba.njit(inline="always")
def _by_neurons(acts, codes, extremes, rows_per_block, f0, lv, lc, ls, le, bar, sign, largest, ordered
                ):  # pragma: no cover - compiled
    """Neuron by neuron, only the rows of the blocks that reach its own bar."""
    n = acts.shape[0]
    w, k = lv.shape
    for i in range(w):
        f = f0 + i
        for b in range(extremes.shape[0]):
            if not sign * extremes[b, f] >= bar[i]:
                continue
            for r in range(b * rows_per_block, min(n, (b + 1) * rows_per_block)):
                v = acts[r, f]
                if sign * v >= bar[i]:
                    _insert(lv, lc, ls, le, i, v, codes[r], r, largest, ordered)
                    bar[i] = max(bar[i], sign * lv[i, k - 1])


@numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def side_insert(acts, codes, extremes, rows_per_block, values, kept, slots, entered, largest, ordered
                ):  # pragma: no cover - compiled
    d_ff = acts.shape[1]
    sign = np.float32(1.0) if largest else np.float32(-1.0)
    for s in numba.prange((d_ff + _LINE - 1) // _LINE):
        f0 = s * _LINE
        w = min(d_ff, f0 + _LINE) - f0
        lv, lc, ls, le = _load(values, kept, slots, f0, w)
        bar = np.empty(w, np.float32)
        _bars(extremes, lv, f0, sign, bar)
        # the strip's rows when its neurons share the blocks they must read, four a block on average (a
        # dense batch: one line read serves them all); else each neuron's own blocks (a full side's later
        # batches: a few blocks each, one neuron's rows strided by d_ff but few)
        shared, own = 0, 0
        for b in range(extremes.shape[0]):
            reaching = _reaching(extremes, b, f0, bar, sign)
            own += reaching
            shared += 1 if reaching > 0 else 0
        if own >= 4 * shared:
            _by_rows(acts, codes, extremes, rows_per_block, f0, lv, lc, ls, le, bar, sign, largest, ordered)
        else:
            _by_neurons(acts, codes, extremes, rows_per_block, f0, lv, lc, ls, le, bar, sign, largest, ordered)
        _store(values, kept, slots, entered, f0, lv, lc, ls, le)


@numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def document_insert(acts, codes, starts, lengths, open_value, open_code, continues, values, kept, slots,
                    entered, last_value, last_code, last_row, largest, ordered):  # pragma: no cover - compiled
    k, d_ff = values.shape
    documents = starts.shape[0]
    for f in numba.prange(d_ff):
        lv, lc, ls, le = _load(values, kept, slots, f, 1)
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
                _insert(lv, lc, ls, le, 0, best, code, row, largest, ordered)
            else:
                last_value[f], last_code[f], last_row[f] = best, code, row
        _store(values, kept, slots, entered, f, lv, lc, ls, le)


@numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def bin_insert(acts, rows, row_keys, row_codes, codes, values, last, salt):  # pragma: no cover - compiled
    d_ff, bins, q = codes.shape
    bits = acts.view(np.int32)
    for s in numba.prange((d_ff + _STRIP - 1) // _STRIP):
        f0 = s * _STRIP
        w = min(d_ff, f0 + _STRIP) - f0
        cell = np.empty(_STRIP, np.int64)
        for i in range(rows.shape[0]):
            key, c, code = row_keys[i], row_codes[i], bits[rows[i], f0:f0 + w]
            for j in range(w):  # each neuron's bin, and whether the key is under that bin's q-th (a first cut)
                b = _bin(code[j] >> 22)
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
                        ahead = _key(ahead_code, salt)
                        if ahead < key or (ahead == key and ahead_code < c):
                            break
                    codes[f, b, p], values[f, b, p] = ahead_code, values[f, b, p - 1]
                    p -= 1
                codes[f, b, p], values[f, b, p] = c, acts[rows[i], f]
                last[b, f] = _key(codes[f, b, q - 1], salt)


@numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def quadrant_counts(gate, up, counts):  # pragma: no cover - compiled
    n, d_ff = gate.shape
    for s in numba.prange((d_ff + _STRIP - 1) // _STRIP):
        f0 = s * _STRIP
        w = min(d_ff, f0 + _STRIP) - f0
        both = np.zeros(_STRIP, np.int64)
        gate_on = np.zeros(_STRIP, np.int64)
        up_on = np.zeros(_STRIP, np.int64)
        for r in range(n):
            g, u = gate[r, f0:f0 + w], up[r, f0:f0 + w]
            for i in range(w):
                a = 1 if g[i] > 0 else 0
                b = 1 if u[i] > 0 else 0
                gate_on[i] += a
                up_on[i] += b
                both[i] += a & b
        for i in range(w):
            counts[0, f0 + i] += both[i]
            counts[1, f0 + i] += gate_on[i] - both[i]
            counts[2, f0 + i] += up_on[i] - both[i]
            counts[3, f0 + i] += n - gate_on[i] - up_on[i] + both[i]


@numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def window_context(acts, rows, neurons, steps, first, end, extras, out):  # pragma: no cover - compiled
    n = acts.shape[0]
    width = steps.shape[0]
    for i in numba.prange(rows.shape[0]):
        r, f = rows[i], neurons[i]
        lo, hi = first[r], end[r]
        for j in range(width):
            a = r + steps[j]
            out[i, j] = acts[a, f] if lo <= a and a < hi and 0 <= a < n else np.float32(np.nan)
        for e in range(extras.shape[0]):
            out[i, width + e] = extras[e, r, f]
