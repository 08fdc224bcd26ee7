"""Many processes on torch.distributed (``torchrun``): the process group, merging states, barriers.

gloo on CPU, nccl on CUDA. Under nccl each rank works on its model's device, ``cuda:LOCAL_RANK``
(:func:`kvmem.load_model` puts it there under torchrun): that device becomes the rank's current
CUDA device, and the process group is bound to it (``device_id``), so no two ranks share a GPU.

The group's timeout bounds how long a rank waits for the others: a rank that finished its share
waits at the merge for the slowest rank, and every rank waits at the last barrier while rank 0
writes the atlas. It is :data:`DEFAULT_TIMEOUT_S` (2 hours) unless set with ``--dist-timeout``
(:func:`start`) or the environment variable ``KVMEM_DIST_TIMEOUT`` (seconds).

Nothing here schedules work: :mod:`kvmem.plan` says which blocks a rank reads. Rank 0 merges the
ranks' states one at a time, in rank order, with the one merge of a scan state
(``ScanState.merge``), so it never holds more than its running state and one rank's state.
"""

from __future__ import annotations

import os
from datetime import timedelta

from kvmem import environment
from kvmem.errors import KvmemError

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "launched", "timeout_seconds", "group_arguments", "start",
           "rank_and_world", "smallest", "merge_to_rank0", "gather_states", "barrier", "stop"]

DEFAULT_TIMEOUT_S = 7200.0  # two hours: ranks finishing a long scan at different times, then the atlas write
TIMEOUT_ENV = "KVMEM_DIST_TIMEOUT"


def launched() -> bool:
    """Whether torchrun (or another launcher setting RANK, WORLD_SIZE and MASTER_ADDR) started this process."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def timeout_seconds(requested: float | None = None) -> float:
    """The process group's timeout: ``requested``, else ``$KVMEM_DIST_TIMEOUT``, else 2 hours."""
    where = "--dist-timeout"
    if requested is None:
        text = environment.read(TIMEOUT_ENV)
        if text is None:
            return DEFAULT_TIMEOUT_S
        where = TIMEOUT_ENV
        try:
            requested = float(text)
        except ValueError:
            raise KvmemError(f"{TIMEOUT_ENV} must be a number of seconds, got {text!r}") from None
    if isinstance(requested, bool) or not isinstance(requested, (int, float)) or not requested > 0:
        raise KvmemError(f"{where} must be a positive number of seconds (e.g. 7200), got {requested!r}")
    return float(requested)


def group_arguments(device: str, *, timeout_s: float | None = None, local_rank: int | None = None) -> dict:
    """The keyword arguments of ``torch.distributed.init_process_group`` for a model on ``device``.

    CUDA: backend nccl, bound to the model's device (a bare ``"cuda"`` means ``cuda:LOCAL_RANK``);
    CPU: gloo. Both with the timeout of :func:`timeout_seconds`.
    """
    import torch

    timeout = timedelta(seconds=timeout_seconds(timeout_s))
    where = torch.device(device)
    if where.type == "cpu":
        return {"backend": "gloo", "timeout": timeout}
    if where.type != "cuda":
        raise KvmemError(f"torchrun runs kvmem on cpu (gloo) or cuda (nccl), not on {device!r}; pass --device cpu or cuda")
    if where.index is None:
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank)
    return {"backend": "nccl", "timeout": timeout, "device_id": where}


def start(device: str, *, timeout_s: float | None = None) -> tuple[int, int]:
    """(rank, world size); under torchrun, starts the process group (once) for a model on ``device``."""
    if not launched():
        return 0, 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        arguments = group_arguments(device, timeout_s=timeout_s)
        if arguments["backend"] == "nccl":
            torch.cuda.set_device(arguments["device_id"])  # this rank's collectives and allocations go there
        dist.init_process_group(**arguments)
    return dist.get_rank(), dist.get_world_size()


def rank_and_world(device: str) -> tuple[int, int]:
    """(rank, world size); starts the process group when launched by torchrun (see :func:`start`)."""
    return start(device)


def smallest(value: int, device: str) -> int:
    """The smallest of every rank's ``value`` (each rank gets the same number)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    wire = torch.tensor([value], dtype=torch.int64, device=_wire_device(device))
    dist.all_reduce(wire, op=dist.ReduceOp.MIN)
    return int(wire.item())


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def stop() -> None:
    """Wait for every rank, then close the process group (the end of a torchrun command)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _wire_device(device: str) -> str:
    """Where the bytes travel: the rank's own CUDA device under nccl (it needs CUDA tensors), else the CPU."""
    import torch.distributed as dist

    return str(group_arguments(device)["device_id"]) if dist.get_backend() == "nccl" else "cpu"


def merge_to_rank0(part, *, rank: int, world: int, to_bytes, from_bytes, merge, device: str):
    """Rank 0 receives every other rank's ``part`` in rank order and folds it in: ``merge(running, received)``.

    ``to_bytes(part) -> bytes`` and ``from_bytes(bytes) -> part`` carry a part between ranks. Rank 0
    holds its running merge and one received part at a time; it returns the merge of all ranks'
    parts, the others return their own ``part`` (after rank 0 has received it).
    """
    import torch
    import torch.distributed as dist

    wire = _wire_device(device)
    if rank != 0:
        data = torch.frombuffer(bytearray(to_bytes(part)), dtype=torch.uint8).to(wire)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=wire), dst=0)
        dist.send(data, dst=0)
        return part
    merged = part
    for source in range(1, world):
        size = torch.zeros(1, dtype=torch.int64, device=wire)
        dist.recv(size, src=source)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
        dist.recv(data, src=source)
        received = from_bytes(data.cpu().numpy().tobytes())
        del data
        merged = merge(merged, received)
        del received
    return merged


def gather_states(state, header: dict, *, rank: int, world: int, device):
    """Every rank's scan state merged on rank 0, in rank order (``ScanState.merge``); other ranks get theirs back."""
    from kvmem.scanning.checkpoint import state_from_bytes, state_to_bytes

    return merge_to_rank0(state, rank=rank, world=world, device=str(device),
                          to_bytes=lambda s: state_to_bytes(s, header),
                          from_bytes=lambda data: state_from_bytes(data, state.statistics, device=device),
                          merge=lambda a, b: a.merge(b))
