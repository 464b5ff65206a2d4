"""Data-parallel helpers: ``torchrun --nproc_per_node N -m qkv train ...`` (gloo on CPU, nccl on GPU).

Every rank builds the same model from the same seed; :class:`DistributedDataParallel`
averages gradients in ``backward()``. The loss of each rank is summed over its tokens and
divided by the *global* token count times ``1/world``, so the averaged gradient equals that of
one process training on the union of the ranks' batches.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["World", "init_distributed", "all_reduce_sum"]


class World:
    """Rank and size of the process group (``rank=0, size=1`` when not distributed)."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank, self.size = rank, size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def init_distributed(backend: str | None = None) -> World:
    """Join the process group that ``torchrun`` describes in the environment, if any."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
    return World(dist.get_rank(), dist.get_world_size())


def all_reduce_sum(value: float, world: World) -> float:
    """Sum a Python number over every rank."""
    if not world.distributed:
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # nccl reduces GPU tensors only
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())
