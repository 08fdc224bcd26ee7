"""How the C allocator (glibc's malloc) treats memory that torch frees, for loops that run tensors
through a model batch after batch in one process.

By default glibc hands freed memory back to the operating system soon: a block over the mmap
threshold (128 KiB at start, raised as such blocks are freed, to at most 32 MiB) when it is freed,
and the free top of the heap once it passes twice that threshold. A forward frees hundreds of
megabytes of temporaries at the end of each layer, so the next layer and the next batch fault the
same pages in again. Where a page's first touch is slow
(a virtual machine: about 7 µs a page on the machines this was measured on, against a fraction of a
µs on bare metal), that costs several percent of a forward.

- :func:`keep_freed_memory` keeps freed blocks under 32 MiB in the heap and trims it only past
  1 GiB of free top. The ``kvmem`` command calls it at start; in a notebook, call it yourself. It
  changes nothing on a C library other than glibc.
- :func:`release_freed_memory` hands every freed page back (``malloc_trim``): the scan calls it
  every 16 batches, so its resident memory does not creep as batch shapes change.
"""

from __future__ import annotations

import ctypes

__all__ = ["keep_freed_memory", "release_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

MMAP_THRESHOLD = 32 << 20  # blocks this large or larger are mapped apart (glibc's largest allowed value)
TRIM_THRESHOLD = 1 << 30  # the heap's free top is handed back past this

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)

_LIBC: list = []  # [the C library] once loaded, [None] where it is not glibc


def _glibc():
    if not _LIBC:
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc's own functions, absent elsewhere
        except (OSError, AttributeError):
            libc = None
        _LIBC.append(libc)
    return _LIBC[0]


def keep_freed_memory() -> bool:
    """Keep memory that the process frees for its next allocations (see the module docstring).
    Returns whether the allocator took the settings (False where the C library is not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    mapped = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trimmed = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mapped and trimmed)


def release_freed_memory() -> None:
    """Hand memory freed by earlier batches back to the OS (glibc keeps some otherwise, and the
    batches' temporaries differ in size from batch to batch, so peak RSS would creep up)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
