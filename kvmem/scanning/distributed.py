"""Many processes on torch.distributed (``torchrun``): ranks, gathering states, barriers.

gloo on CPU, nccl on CUDA. Nothing here schedules work: :mod:`kvmem.plan` says which blocks a
rank reads, and :func:`kvmem.scanning.accumulator.merge_states` merges what they found.
"""

from __future__ import annotations

import os

__all__ = ["rank_and_world", "gather_states", "barrier"]


def rank_and_world(device: str) -> tuple[int, int]:
    """(rank, world size); starts the process group when launched by torchrun with WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def gather_states(state, header: dict, *, rank: int, world: int, device):
    """Every rank's state to rank 0, merged there in rank order; other ranks get theirs back."""
    import torch
    import torch.distributed as dist

    from kvmem.scanning.checkpoint import state_from_bytes, state_to_bytes

    # the bytes travel as uint8 tensors on the backend's device (nccl needs CUDA tensors)
    wire = "cuda" if dist.get_backend() == "nccl" else "cpu"
    data = torch.frombuffer(bytearray(state_to_bytes(state, header)), dtype=torch.uint8).to(wire)
    sizes = [torch.zeros(1, dtype=torch.int64, device=wire) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=wire))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=wire)
    padded[:data.numel()] = data
    received = [torch.zeros(longest, dtype=torch.uint8, device=wire) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, received, dst=0)
    if rank != 0:
        return state
    merged = None
    for size, blob in zip(sizes, received):
        part = state_from_bytes(bytes(blob[:int(size.item())].cpu().numpy()), device=device)
        merged = part if merged is None else merged.merge(part)
    return merged
