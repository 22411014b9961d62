"""The tensor-parallel process group, created from the torchrun environment.

Deep code never reads the environment: it receives a ``Mesh``. Outside torchrun (no WORLD_SIZE)
the mesh is a single rank with no process group, and every collective is the identity.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .faults import collective, timeout_seconds
from .shm import attach, channel_for


@dataclass(frozen=True)
class Mesh:
    group: object | None
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.group is not None:
            with collective(f"barrier on rank {self.rank}"):
                dist.barrier(group=self.group)


def shutdown() -> None:
    """Leave the process group together, before interpreter exit: gloo aborts the process when its
    threads are torn down during finalization or while a peer is still mid-collective."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def default_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_seconds())


def get_mesh(tp_size: int | None = None, timeout: datetime.timedelta | None = None) -> Mesh:
    """Join (or create) the default process group; gloo on CPU, nccl on CUDA."""
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            if tp_size not in (None, 1):
                raise ValueError(
                    f"tp_size={tp_size} was asked for, but this process was not started by torchrun (WORLD_SIZE is unset or 1)"
                )
            return Mesh(None, 0, 1, torch.device("cpu"))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        with collective(f"joining the process group (rank {os.environ.get('RANK')} of {os.environ['WORLD_SIZE']})"):
            dist.init_process_group(backend=backend, timeout=timeout or default_timeout())
    world_size = dist.get_world_size()
    if tp_size not in (None, world_size):
        raise ValueError(f"tp_size={tp_size} was asked for, but the process group has world size {world_size}")
    rank = dist.get_rank()
    device = torch.device("cpu")
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    group = dist.group.WORLD if world_size > 1 else None
    if group is not None and device.type == "cpu" and channel_for(group) is None:
        with collective(f"setting up shared-memory collectives on rank {rank}"):
            attach(group, rank, world_size, timeout=(timeout or default_timeout()).total_seconds())
    return Mesh(group, rank, world_size, device)
