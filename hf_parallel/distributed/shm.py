"""Same-host collectives through shared memory, for CPU ranks (gloo needs ~1 ms per small all-reduce).

Decoding one token issues two all-reduces per layer of a few KB each; over gloo's loopback TCP each
costs about 1 ms on a 2-core machine, more than the layer's matmuls. When every rank of the group
runs on one host (same boot id), rank 0 creates a file in /dev/shm that all ranks map; a collective
is: copy your payload into your slot, publish a sequence number, wait until every rank has published
it, read all slots. vLLM and DeepSpeed do the same for CPU tensor parallelism, in C++.

Two slot sets alternate by sequence parity, so a rank never overwrites a slot another rank may still
be reading (it cannot publish call n+2 before everyone has published n+1, i.e. finished reading n).
Payloads larger than a slot go through gloo, chosen identically on every rank (same sizes).
Relies on x86's ordered stores (data before the flag); other CPUs keep gloo.
"""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from .faults import RankFailure

FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each
SLOT_BYTES = int(os.environ.get("HF_PARALLEL_SHM_SLOT_MB", "8")) << 20
_CHANNELS: dict = {}  # process group -> ShmChannel


class ShmChannel:
    def __init__(self, path: str, rank: int, world_size: int, timeout: float, slot_bytes: int = SLOT_BYTES):
        self.rank, self.world_size, self.timeout, self.slot_bytes = rank, world_size, timeout, slot_bytes
        self.header = world_size * FLAG_STRIDE * 8
        self.memory = torch.from_file(path, shared=True, size=self.size(world_size, slot_bytes), dtype=torch.uint8)
        self.flags = np.frombuffer(self.memory[: self.header].numpy(), dtype=np.int64)[::FLAG_STRIDE]
        self.seq = 0

    @staticmethod
    def size(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
        return world_size * FLAG_STRIDE * 8 + 2 * world_size * slot_bytes

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def _slot(self, parity: int, rank: int) -> torch.Tensor:
        start = self.header + (parity * self.world_size + rank) * self.slot_bytes
        return self.memory[start : start + self.slot_bytes]

    def _wait(self, seq: int) -> None:
        spins, deadline = 0, None
        while self.flags.min() < seq:
            spins += 1
            if spins % 256 == 0:
                os.sched_yield()  # oversubscribed cores: let the rank we wait for run
                if deadline is None:
                    deadline = time.monotonic() + self.timeout
                elif time.monotonic() > deadline:
                    late = [r for r in range(self.world_size) if self.flags[r] < seq]
                    raise RankFailure(
                        f"hf_parallel: rank(s) {late} did not reach collective #{seq} within {self.timeout:.0f}s "
                        "(a rank died, hangs, or ranks issued different collectives); set HF_PARALLEL_TIMEOUT to change"
                    )

    def exchange(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``payload`` (uint8, same size on all ranks). Read the views before the next call."""
        n = payload.numel()
        self.seq += 1
        parity = self.seq % 2
        self._slot(parity, self.rank)[:n].copy_(payload)
        self.flags[self.rank] = self.seq
        self._wait(self.seq)
        return [self._slot(parity, r)[:n] for r in range(self.world_size)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum in rank order on every rank, so all ranks get bitwise the same result."""
        parts = self.exchange(x.contiguous().reshape(-1).view(torch.uint8))
        parts = [part.view(x.dtype).view(x.shape) for part in parts]
        if x.dtype in (torch.bfloat16, torch.float16):
            return torch.stack(parts).sum(0, dtype=torch.float32).to(x.dtype)
        out = parts[0].clone()  # a tensor of its own, not a view: callers may add to it in place
        for part in parts[1:]:
            out += part
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Views of every rank's ``x`` in shared memory: consume them before the next collective."""
        parts = self.exchange(x.contiguous().reshape(-1).view(torch.uint8))
        return [part.view(x.dtype).view(x.shape) for part in parts]


def host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return socket.gethostname() + ":" + f.read().strip()
    except OSError:
        return ""


def attach(group, rank: int, world_size: int, timeout: float) -> ShmChannel | None:
    """Collective over ``group``: map a shared-memory channel if every rank can, else None (gloo)."""
    usable = (
        os.environ.get("HF_PARALLEL_SHM", "1") != "0"
        and platform.machine() in ("x86_64", "AMD64")
        and os.path.isdir("/dev/shm")
    )
    hosts = [None] * world_size
    dist.all_gather_object(hosts, (usable, host_id()), group=group)
    if not all(ok for ok, _ in hosts) or len({host for _, host in hosts}) != 1 or not hosts[0][1]:
        return None
    names = [f"/dev/shm/hf_parallel-{os.getpid()}-{uuid.uuid4().hex}" if rank == 0 else None]
    dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
    path, channel = names[0], None
    created = [None] * world_size
    if rank == 0:
        try:
            with open(path, "wb") as f:
                f.truncate(ShmChannel.size(world_size))
        except OSError:
            path = None
    dist.all_gather_object(created, path is not None, group=group)  # also a barrier: the file exists
    if created[0]:
        try:
            channel = ShmChannel(path, rank, world_size, timeout)
        except (OSError, RuntimeError):  # e.g. /dev/shm too small: every rank falls back to gloo
            channel = None
    mapped = [None] * world_size
    dist.all_gather_object(mapped, channel is not None, group=group)
    if rank == 0 and path is not None and os.path.exists(path):
        os.unlink(path)  # every rank has mapped it (or given up): the mappings outlive the name
    if not all(mapped):
        return None
    _CHANNELS[group] = channel
    return channel


def channel_for(group) -> ShmChannel | None:
    return _CHANNELS.get(group)
