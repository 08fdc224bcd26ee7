"""The one device rule: which torch device a run uses.

:func:`resolve_device` turns what a user asked for (``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``)
into the device string every part of kvmem uses. ``None`` means CUDA when it is available, else
the CPU. Under torchrun (``WORLD_SIZE`` > 1 and ``LOCAL_RANK`` set) ``None`` and ``"cuda"`` resolve
to ``cuda:LOCAL_RANK``, so each rank of a machine gets its own GPU (nccl refuses two ranks on one
GPU); an explicit ``cuda:N`` is kept as asked. Anything else, CUDA on a machine without it, or a
GPU index past the machine's count is one :class:`~kvmem.errors.KvmemError` line naming what was
asked and what is available.

Importing this module does not import torch.
"""

from __future__ import annotations

import os
import re

from kvmem.errors import KvmemError

__all__ = ["DEVICE_HELP", "device_help", "resolve_device"]

DEVICE_HELP = ("torch device: cpu, cuda or cuda:N (default: cuda if available, else cpu; under torchrun "
               "cuda means cuda:LOCAL_RANK)")


def device_help(default: str | None = None) -> str:
    """Help text of a ``--device`` option whose default is ``default`` (None: the rule's own)."""
    if default is None:
        return DEVICE_HELP
    return f"torch device: cpu, cuda or cuda:N (default: {default}; under torchrun cuda means cuda:LOCAL_RANK)"

_CUDA_INDEX = re.compile(r"cuda:(\d+)")


def _available(torch) -> str:
    """What this machine offers, in words, for error messages."""
    if not torch.cuda.is_available():
        return "this machine has no CUDA device; available: cpu"
    count = torch.cuda.device_count()
    return f"available: cpu, cuda, cuda:0..cuda:{count - 1} ({count} GPU{'s' if count != 1 else ''})"


def _torchrun_rank() -> int | None:
    """LOCAL_RANK when this process is one of several torchrun ranks, else None."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    local = os.environ.get("LOCAL_RANK")
    if world > 1 and local is not None and local.strip().isdigit():
        return int(local)
    return None


def resolve_device(requested: str | None) -> str:
    """The device string for ``requested``: ``"cpu"`` or ``"cuda:N"``.

    >>> resolve_device("cpu")
    'cpu'
    """
    import torch

    if requested is not None and not isinstance(requested, str):
        requested = str(requested)  # a torch.device
    name = None if requested is None else requested.strip().lower()
    if name == "cpu":
        return "cpu"
    cuda = torch.cuda.is_available()
    if name is None and not cuda:
        return "cpu"
    if name not in (None, "cuda") and not _CUDA_INDEX.fullmatch(name):
        raise KvmemError(f"unknown device {requested!r}; choose cpu, cuda or cuda:N ({_available(torch)})")
    if not cuda:
        raise KvmemError(f"device {requested!r} asked for CUDA, but {_available(torch)}; pass --device cpu")
    count = torch.cuda.device_count()
    if name in (None, "cuda"):
        rank = _torchrun_rank()
        index = 0 if rank is None else rank
        if index >= count:
            raise KvmemError(f"torchrun LOCAL_RANK={index} needs GPU cuda:{index}, but {_available(torch)}; "
                             f"start at most {count} rank(s) per machine")
        return f"cuda:{index}"
    index = int(_CUDA_INDEX.fullmatch(name).group(1))
    if index >= count:
        raise KvmemError(f"device {requested!r} does not exist: {_available(torch)}")
    return f"cuda:{index}"
