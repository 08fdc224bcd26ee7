"""An independent oracle for projections: numpy float64, the products summed in index order, then
float32; the top n by (score descending, token id ascending), the bottom n by (score ascending, token
id ascending). Nothing of kvmem in it."""

from __future__ import annotations

import numpy as np


def exact_scores(vectors: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """float32 [rows, vocab] of vectors [rows, d] @ basis [d, vocab], float64 in index order."""
    a, b = np.asarray(vectors, np.float64), np.asarray(basis, np.float64)
    total = np.zeros((a.shape[0], b.shape[1]))
    for i in range(a.shape[1]):
        total += a[:, i, None] * b[i][None, :]
    return total.astype(np.float32)


def top_bottom(vectors: np.ndarray, basis: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """{'top_ids', 'top_scores', 'bottom_ids', 'bottom_scores'}, each [rows, min(n, vocab)]."""
    scores = exact_scores(vectors, basis)
    n = min(n, scores.shape[1])
    ids = np.arange(scores.shape[1])
    top = np.stack([np.lexsort((ids, -row))[:n] for row in scores])
    bottom = np.stack([np.lexsort((ids, row))[:n] for row in scores])
    return {"top_ids": top, "top_scores": np.take_along_axis(scores, top, 1),
            "bottom_ids": bottom, "bottom_scores": np.take_along_axis(scores, bottom, 1)}
