"""numba's thread count beside torch's, for the compiled kernels (imported only where numba is installed).

numba's first parallel call starts its OpenMP thread pool, and starting it sets the process's OpenMP
thread count, torch's included, to NUMBA_NUM_THREADS (the number of cores): a caller who set torch to
more threads than cores would find the count changed by a scan. :func:`set_numba_threads` starts the
pool itself and puts torch's count back.
"""

from __future__ import annotations

import numba
import torch

__all__ = ["set_numba_threads"]


def set_numba_threads(count: int) -> None:
    """numba's threads set to ``count`` (at most NUMBA_NUM_THREADS); torch's thread count is left as it was."""
    torch_threads = torch.get_num_threads()
    count = max(1, min(count, numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != count:  # the first call starts numba's pool
        numba.set_num_threads(count)
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
