"""Streaming backends, and the one place that picks one for a scan.

- ``torch``: torch ops on any device (:mod:`kvmem.scanning.backends.torch_backend`);
- ``numba``: compiled CPU kernels for the heavy parts (:mod:`kvmem.scanning.backends.numba_backend`).

:func:`select_backend` is called once per scan; the name it picked goes into the manifest
(``engine.backend``), and a resume or a shard merge refuses a different one.
"""

from __future__ import annotations

import warnings

import torch

from kvmem import environment
from kvmem.errors import KvmemError
from kvmem.scanning.backends.base import Backend, BatchStatistics, ContextFn, Documents
from kvmem.scanning.backends.numba_backend import NumbaBackend
from kvmem.scanning.backends.torch_backend import TorchBackend

__all__ = ["Backend", "BatchStatistics", "ContextFn", "Documents", "BACKENDS", "ENV", "select_backend"]

BACKENDS: dict[str, type[Backend]] = {"torch": TorchBackend, "numba": NumbaBackend}
ENV = "KVMEM_KERNELS"  # environment variable naming a backend (torch or numba)

_NUMBA: list = []  # [NumbaBackend] once it loaded, [None] once it failed (warned once per process)


def _numba() -> Backend | None:
    if not _NUMBA:
        try:
            backend = NumbaBackend()
            backend.prepare()
        except Exception as error:  # numba missing, or present but unusable here (e.g. no writable cache)
            warnings.warn(f"kvmem: the compiled CPU kernels are unavailable ({type(error).__name__}: {error}); "
                          f"using the slower torch backend (set NUMBA_CACHE_DIR to a writable directory, or "
                          f"{ENV}=torch to silence this)", RuntimeWarning, stacklevel=3)
            backend = None
        _NUMBA.append(backend)
    return _NUMBA[0]


def select_backend(device: str | torch.device = "cpu", name: str | None = None) -> Backend:
    """The backend a scan on ``device`` uses: ``name`` if given, else the ``KVMEM_KERNELS``
    environment variable, else ``numba`` on a CPU and ``torch`` elsewhere. Where numba cannot load
    on a CPU, the torch backend runs, with one warning per process. Loading the numba kernels
    (from numba's disk cache; compiling them, about 4 s, once per install) happens here.
    """
    chosen = name or environment.read(ENV)
    if chosen is not None:
        chosen = chosen.lower()
        if chosen not in BACKENDS:
            source = "backend" if name else ENV
            raise KvmemError(f"unknown {source} {chosen!r}; choose one of {', '.join(BACKENDS)}")
    cpu = torch.device(device).type == "cpu"
    if chosen == "numba" and not cpu:
        raise KvmemError(f"the numba backend runs on the CPU only, not on {device}; use the torch backend "
                         f"({ENV}=torch) or --device cpu")
    if chosen == "torch" or not cpu:
        return TorchBackend()
    return _numba() or TorchBackend()
