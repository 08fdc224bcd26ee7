"""Python's cyclic garbage collector around kvmem's heavy work.

A full collection walks every object the collector tracks. Once torch, transformers and a model
are loaded there are about half a million, and a full collection takes a quarter of a second on
a 2-core machine. One starts each time the objects that survived earlier collections grow by a
quarter, so the imports and the model load of a ``kvmem scan`` command set off eight of them (0.9
to 1.2 s of a 2,000-token command on an AMD EPYC), and a notebook's first scan two more, while
numba loads (0.5 s). Young collections walk what the load and the imports just made, once per
generation: in a notebook, importing the scan engine on the first ``kvmem.scan`` ran eight
collections of the middle generation over the model's 180,000 objects (0.21-0.23 s). Objects made
by imports and a model load live as long as the process or the model: walking them again frees
nothing.

- :func:`frozen_heap`: :func:`kvmem.scan` leaves the objects that exist when it starts out of
  collections until it ends (``gc.freeze``, then ``gc.unfreeze``). A notebook gets its collector
  back as it was, and a model deleted after the scan is freed as before.
- :func:`collections_paused`: no collection while :func:`kvmem.load_model` runs, nor while kvmem
  imports a module on first use (``kvmem.scan``, ``kvmem.open``, ...); collections resume after
  it as they were. A load leaves about 4,500 unreachable objects and no memory to take back
  (smollm2-135m: the same RSS before and after a full collection), and would otherwise run four
  full collections over a heap growing from 265,000 to 466,000 objects (0.77 s). What the block
  made is walked by the next collections as before, unless a scan freezes it first (the first
  ``kvmem.scan`` in a notebook: the engine's import 0.32-0.34 s, from 0.46-0.55 s).
- :func:`freeze_survivors`: the ``kvmem`` command's process policy. After each full collection,
  what survived it is frozen, so no object is walked by more than one full collection (a 2,000-token
  command's full collections: 0.9-1.2 s before, 0.18-0.23 s after). A frozen object is not collected
  even once it is unreachable; a process that ends with its command loses nothing by that, which
  is why this is the command's policy and not the library's. Under it, what a model load made is
  frozen as the load ends, without a collection.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap", "collections_paused", "freeze_survivors"]

_OLDEST = 2  # gc's oldest generation: a collection of it is a full collection


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside the block, the objects that existed at its start are left out of collections. Left
    as it is where something is frozen already (the caller, or :func:`freeze_survivors`, manages
    the collector)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def collections_paused() -> Iterator[None]:
    """No collection inside the block; the collector's state is restored after it, and under
    :func:`freeze_survivors` what the block made is frozen."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _freeze_after_full_collection in gc.callbacks:
            gc.freeze()
        if enabled:
            gc.enable()


def _freeze_after_full_collection(phase: str, info: dict) -> None:
    if phase == "stop" and info["generation"] == _OLDEST:
        gc.freeze()


def freeze_survivors() -> None:
    """From now on, freeze the survivors of each full collection (once per process; see the
    module docstring). For a process that ends with its work, such as the ``kvmem`` command."""
    if _freeze_after_full_collection not in gc.callbacks:
        gc.callbacks.append(_freeze_after_full_collection)
