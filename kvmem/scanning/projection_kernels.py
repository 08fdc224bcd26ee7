"""The numba kernel of the screened projection (imported only where numba is installed). The scores,
the tie rule and the error bound are in :mod:`kvmem.scanning.projection_rules`, the wrapper in
:mod:`kvmem.scanning.projection_screen`.

Per row of a block: read the screen scores S [vocab] from their bits (a bfloat16's shifted up by 16
and cast: no widened copy), bound every exact score from below (S - eps) and above (S + eps), find
the n-th largest lower bound L and the n-th smallest upper bound U, keep as candidates the tokens
with S + eps >= L (top) and S - eps <= U (bottom), rescore those exactly and order them. Tokens are
grouped in strided chunks (chunk k holds tokens k, k + K, k + 2K, ...; K = ceil(vocab / 32), at
least 2n), so one vectorised pass gives every chunk's extremes of the two bounds, and the scalar work
is confined to the few chunks that can hold a candidate. A row with more than ``cap`` candidates on
a side (near ties everywhere, e.g. a zero vector), or whose scores could overflow, is rescored in full.

Module-level functions with ``cache=True``: numba loads them from its disk cache.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from kvmem.scanning.numba_threads import set_numba_threads

__all__ = ["screen_select", "scratch", "use_threads"]

_WIDTH = 32  # tokens per chunk (at most)


def use_threads(count: int) -> None:
    """numba's threads for the kernel (at most as many as it started with; torch's count unchanged)."""
    set_numba_threads(count)


def scratch(groups: int, vocab: int, n: int, cap: int) -> tuple[np.ndarray, ...]:
    """Buffers for ``groups`` parallel tasks, made once per projection (made per task in the kernel,
    they cost page faults every few rows): chunk extremes float32 [groups, 4, chunks], candidate ids
    int64 [groups, cap] and scores float32 [groups, cap]."""
    chunks = min(vocab, max((vocab + _WIDTH - 1) // _WIDTH, 2 * n))  # at least n chunks (n <= vocab)
    return np.empty((groups, 4, chunks), np.float32), np.empty((groups, cap), np.int64), np.empty((groups, cap),
                                                                                                  np.float32)


@intrinsic
def _as_float32(typingctx, bits):  # pragma: no cover - compiled
    """The float32 whose bits are ``bits`` (uint32): a bit cast, which vectorises."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@numba.njit(inline="always")
def _score(row, t, shift):  # pragma: no cover - compiled
    """S[t] of a row of screen bits: bfloat16 (uint16, shift 16) or float32 (uint32, shift 0)."""
    return _as_float32(np.uint32(row[t]) << np.uint32(shift))


@numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def screen_select(bits, shift, vectors, columns, norms, error_norms, x, y, beta, tau, n, top_ids, top_scores,
                  bottom_ids, bottom_scores, candidates, extremes, ids, scores):  # pragma: no cover - compiled
    """bits: the screen S [rows, vocab] as bits, uint16 (bfloat16, shift 16) or uint32 (float32, shift 0).
    vectors: float32 [rows, d]; columns: float32 [vocab, d]; norms, error_norms: float32 [vocab], upper
    bounds of ||b_t|| and ||b_t - bf16(b_t)||; x, y, tau: float32 [rows] (tau < 0: rescore the row in
    full); beta: float32. The bound is eps[r, t] = x[r] * norms[t] + y[r] * error_norms[t] + beta *
    |S[r, t]| + tau[r]. Outputs: [rows, n] ids (int64) and scores (float32); candidates: int64 [rows],
    the tokens rescored on both sides, or -1 where the row was rescored in full. extremes, ids, scores:
    :func:`scratch` (its groups: the parallel tasks, each a contiguous range of rows)."""
    rows = vectors.shape[0]
    groups = extremes.shape[0]
    per_group = (rows + groups - 1) // groups
    for g in numba.prange(groups):
        for r in range(g * per_group, min(rows, (g + 1) * per_group)):
            count = -1
            if tau[r] >= 0:
                row = bits[r]
                _chunk_extremes(row, shift, norms, error_norms, x[r], y[r], beta, tau[r], extremes[g])
                count = 0
                for largest in (True, False):
                    bound = _nth_bound(extremes[g], n, largest)
                    if bound != bound:  # n > chunks: no first cut
                        count = -1
                        break
                    found = _collect(row, shift, norms, error_norms, x[r], y[r], beta, tau[r], extremes[g], bound,
                                     largest, ids[g])
                    if found > ids.shape[1]:
                        count = -1
                        break
                    count += found
                    _rescore(vectors[r], columns, ids[g], found, scores[g])
                    if largest:
                        _order(ids[g], scores[g], found, n, True, top_ids[r], top_scores[r])
                    else:
                        _order(ids[g], scores[g], found, n, False, bottom_ids[r], bottom_scores[r])
            if count < 0:
                _full_row(vectors[r], columns, n, top_ids[r], top_scores[r], bottom_ids[r], bottom_scores[r])
            candidates[r] = count


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _chunk_extremes(row, shift, norms, error_norms, x, y, beta, tau, extremes):  # pragma: no cover - compiled
    """Per strided chunk: the largest and smallest lower bound S - eps and upper bound S + eps
    (elementwise over the chunks, so it vectorises)."""
    vocab = row.shape[0]
    chunks = extremes.shape[1]
    low_max, high_max, low_min, high_min = extremes[0], extremes[1], extremes[2], extremes[3]
    low_max[:] = -np.inf
    high_max[:] = -np.inf
    low_min[:] = np.inf
    high_min[:] = np.inf
    for j in range((vocab + chunks - 1) // chunks):
        start = j * chunks
        width = min(chunks, vocab - start)
        b_row = row[start:start + width]
        n_row = norms[start:start + width]
        m_row = error_norms[start:start + width]
        for k in range(width):
            s = _score(b_row, k, shift)
            e = x * n_row[k] + y * m_row[k] + beta * abs(s) + tau
            lo = s - e
            hi = s + e
            low_max[k] = lo if lo > low_max[k] else low_max[k]
            high_max[k] = hi if hi > high_max[k] else high_max[k]
            low_min[k] = lo if lo < low_min[k] else low_min[k]
            high_min[k] = hi if hi < high_min[k] else high_min[k]


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _nth_bound(extremes, n, largest):  # pragma: no cover - compiled
    """The n-th largest chunk maximum of the lower bounds (largest) or n-th smallest chunk minimum of
    the upper bounds: n distinct tokens reach it, so it is at most the n-th largest lower bound (at
    least the n-th smallest upper bound). NaN when there are fewer than n chunks."""
    chunks = extremes.shape[1]
    if n > chunks:
        return np.float32(np.nan)
    side = extremes[0] if largest else extremes[3]
    kept = np.empty(n, np.float32)
    ids = np.zeros(n, np.int64)  # unused: every id 0
    for k in range(n):
        _offer(kept, ids, k, side[k], 0, largest)
    root = kept[0]
    for k in range(n, chunks):
        v = side[k]
        if (v > root) if largest else (v < root):  # else it ranks after every kept entry
            _sift_down(kept, ids, n, v, 0, largest)
            root = kept[0]
    return root  # the heap's root: the n-th best


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _collect(row, shift, norms, error_norms, x, y, beta, tau, extremes, bound, largest, ids):  # pragma: no cover
    """Token ids whose upper bound reaches ``bound`` (largest) or whose lower bound is at most ``bound``
    (in chunk order, not ascending); past ``len(ids)`` it stops and returns len(ids) + 1."""
    vocab = row.shape[0]
    chunks = extremes.shape[1]
    cap = ids.shape[0]
    side = extremes[1] if largest else extremes[2]
    found = 0
    for k in range(chunks):
        if not ((side[k] >= bound) if largest else (side[k] <= bound)):
            continue
        for t in range(k, vocab, chunks):
            s = _score(row, t, shift)
            e = x * norms[t] + y * error_norms[t] + beta * abs(s) + tau
            if ((s + e) >= bound) if largest else ((s - e) <= bound):
                if found == cap:
                    return cap + 1
                ids[found] = t
                found += 1
    return found


@numba.njit(cache=True, boundscheck=False, nogil=True, fastmath={"contract"})
def _rescore(a, columns, ids, count, scores):  # pragma: no cover - compiled
    """scores[k] = float32(sum over i in index order, in float64, of a[i] * columns[ids[k], i]), eight
    candidates at a time. (A float32 x float32 product is exact in float64, so a fused multiply-add
    gives the same sums as a multiply then an add.)"""
    d = a.shape[0]
    last = count - 1
    for k in range(0, count, 8):
        c0, c1, c2, c3 = columns[ids[k]], columns[ids[min(k + 1, last)]], columns[ids[min(k + 2, last)]], \
            columns[ids[min(k + 3, last)]]
        c4, c5, c6, c7 = columns[ids[min(k + 4, last)]], columns[ids[min(k + 5, last)]], \
            columns[ids[min(k + 6, last)]], columns[ids[min(k + 7, last)]]
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        for i in range(d):
            ai = np.float64(a[i])
            s0 += ai * np.float64(c0[i])
            s1 += ai * np.float64(c1[i])
            s2 += ai * np.float64(c2[i])
            s3 += ai * np.float64(c3[i])
            s4 += ai * np.float64(c4[i])
            s5 += ai * np.float64(c5[i])
            s6 += ai * np.float64(c6[i])
            s7 += ai * np.float64(c7[i])
        sums = (s0, s1, s2, s3, s4, s5, s6, s7)
        for j in range(min(8, count - k)):
            scores[k + j] = np.float32(sums[j])


@numba.njit(cache=True, boundscheck=False, nogil=True, inline="always")
def _after(s, t, s2, t2, largest):  # pragma: no cover - compiled
    """Whether (score s, id t) ranks after (s2, t2): lower (largest) or higher score, then higher id."""
    if s != s2:
        return (s < s2) if largest else (s > s2)
    return t > t2


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _offer(scores, ids, size, s, t, largest):  # pragma: no cover - compiled
    """Offer (s, t) to a bounded heap of len(scores) entries whose root ranks last; returns its new size."""
    n = scores.shape[0]
    if size < n:
        p = size
        while p > 0:  # sift up: a parent ranks after its children
            parent = (p - 1) // 2
            if not _after(s, t, scores[parent], ids[parent], largest):
                break
            scores[p], ids[p] = scores[parent], ids[parent]
            p = parent
        scores[p], ids[p] = s, t
        return size + 1
    if not _after(scores[0], ids[0], s, t, largest):
        return size  # ranks after every kept entry
    _sift_down(scores, ids, n, s, t, largest)
    return size


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _sift_down(scores, ids, size, s, t, largest):  # pragma: no cover - compiled
    """Put (s, t) at the root of heap[:size] and sift it down."""
    p = 0
    while True:
        child = 2 * p + 1
        if child >= size:
            break
        if child + 1 < size and _after(scores[child + 1], ids[child + 1], scores[child], ids[child], largest):
            child += 1
        if not _after(scores[child], ids[child], s, t, largest):
            break
        scores[p], ids[p] = scores[child], ids[child]
        p = child
    scores[p], ids[p] = s, t


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _order(ids, scores, count, n, largest, out_ids, out_scores):  # pragma: no cover - compiled
    """The first n of (ids, scores)[:count] (count >= n) by score (descending if largest, else
    ascending), ties by token id ascending: a bounded heap, then sorted in place (first = best)."""
    for j in range(n):
        _offer(out_scores, out_ids, j, scores[j], ids[j], largest)
    for j in range(n, count):
        s, t = scores[j], ids[j]
        if _after(out_scores[0], out_ids[0], s, t, largest):  # else it ranks after every kept entry
            _sift_down(out_scores, out_ids, n, s, t, largest)
    for last in range(n - 1, 0, -1):  # heap sort: the root (the last-ranked) goes to the end
        s, t = out_scores[last], out_ids[last]
        out_scores[last], out_ids[last] = out_scores[0], out_ids[0]
        _sift_down(out_scores, out_ids, last, s, t, largest)


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _full_row(a, columns, n, top_ids, top_scores, bottom_ids, bottom_scores):  # pragma: no cover - compiled
    """Every token's exact score, then the same ordering (the fall-back)."""
    vocab = columns.shape[0]
    ids = np.arange(vocab)
    scores = np.empty(vocab, np.float32)
    for t in range(0, vocab, 8):
        block = ids[t:t + 8]
        _rescore(a, columns, block, block.shape[0], scores[t:t + 8])
    _order(ids, scores, vocab, n, True, top_ids, top_scores)
    _order(ids, scores, vocab, n, False, bottom_ids, bottom_scores)
