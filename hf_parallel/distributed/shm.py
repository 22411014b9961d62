"""Same-host collectives through shared memory, for CPU ranks: small all-reduces without gloo's loopback TCP.

Decoding one token issues two all-reduces per layer of a few KB each; over gloo's loopback TCP each
can cost more than the layer's matmuls. When every rank of the group
runs on one host (same boot id), rank 0 creates a file in /dev/shm that all ranks map; a collective
is: copy your payload into your slot, publish a sequence number, wait until every rank has published
it, read all slots. vLLM and DeepSpeed do the same for CPU tensor parallelism, in C++.

Two slot sets alternate by sequence parity, so a rank never overwrites a slot another rank may still
be reading (it cannot publish call n+2 before everyone has published n+1, i.e. finished reading n).
Payloads larger than a slot go through gloo, chosen identically on every rank (same sizes).
Relies on x86's ordered stores (data before the flag); other CPUs keep gloo.

The same step carries more than sums: an all-to-all (SP's Ulysses exchange, uneven pieces copied
straight from their views into a slot's part per rank, in byte windows when a piece is larger), and
a broadcast with its header in one step (the SP batch, the last pipeline stage's output). Between
pipeline stages, where only two ranks talk and the sender must not wait, ``ShmPipe`` is a ring per
direction instead (``attach_pipes``).
"""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid
from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from .faults import RankFailure
from .headers import DTYPES, HEADER_LENGTH, MAX_DIMS, empty_from, header_of
from .liveness import exit_message, identity, watchable

FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each
SLOT_BYTES = int(os.environ.get("HF_PARALLEL_SHM_SLOT_MB", "8")) << 20
LIVENESS_S = 0.5  # how often a wait looks whether its peers' processes still run
PIPE_SLOT_BYTES = 1 << 20  # a pipe's ring: 8 slots of 1 MiB (a larger message streams through it)
_CHANNELS: dict = {}  # process group -> ShmChannel


class ShmChannel:
    def __init__(self, path: str, rank: int, world_size: int, timeout: float, slot_bytes: int = SLOT_BYTES,
                 peers: list | None = None):  # fmt: skip
        self.rank, self.world_size, self.timeout, self.slot_bytes = rank, world_size, timeout, slot_bytes
        self.peers = watchable(dict(enumerate(peers))) if peers else None  # each rank's process (liveness.py)
        self.header = world_size * FLAG_STRIDE * 8
        self.memory = torch.from_file(path, shared=True, size=self.size(world_size, slot_bytes), dtype=torch.uint8)
        self.flags = np.frombuffer(self.memory[: self.header].numpy(), dtype=np.int64)[::FLAG_STRIDE]
        self.seq = 0
        # every slot's view, made once: a decoded token runs ~60 collectives, each of them on these views
        self.slots = [[self._slot(parity, rank) for rank in range(world_size)] for parity in (0, 1)]

    @staticmethod
    def size(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
        return world_size * FLAG_STRIDE * 8 + 2 * world_size * slot_bytes

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def _slot(self, parity: int, rank: int) -> torch.Tensor:
        start = self.header + (parity * self.world_size + rank) * self.slot_bytes
        return self.memory[start : start + self.slot_bytes]

    def _wait(self, seq: int, what: str = "") -> None:
        def missing() -> list[int]:
            return [r for r in range(self.world_size) if self.flags[r] < seq]

        def late() -> str:
            return f"rank(s) {missing()} did not reach collective #{seq}" + (f" ({what})" if what else "")

        gone = lambda: exit_message(self.peers, missing())  # noqa: E731
        wait_until(lambda: self.flags.min() >= seq, self.timeout, late, spin_only=True, gone=gone)

    def _round(self, write, what: str = "") -> list[torch.Tensor]:
        """One step of the protocol: ``write(my slot)``, publish, wait for every rank; every rank's
        slot of this step (read them before the next call). ``what`` names it in a RankFailure."""
        self.seq += 1
        slots = self.slots[self.seq % 2]
        write(slots[self.rank])
        self.flags[self.rank] = self.seq
        if self.flags.min() < self.seq:
            self._wait(self.seq, what)
        return slots

    def exchange(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``payload`` (uint8, same size on all ranks). Read the views before the next call."""
        n = payload.numel()
        return [slot[:n] for slot in self._round(lambda slot: slot[:n].copy_(payload))]

    def all_to_all(self, sends: list[torch.Tensor], receives: list[torch.Tensor], largest: int) -> None:
        """``sends[j]`` into rank j's ``receives[this rank]`` (any shapes, strides and sizes; same
        dtype): a slot holds one part per rank. ``largest``, the largest piece in bytes between any
        two ranks, the same on every rank, says how many steps: one when it fits a part (each piece
        copied straight from its view into the slot and out into its place), else byte windows."""
        receives[self.rank].copy_(sends[self.rank])
        part = self.slot_bytes // self.world_size // 64 * 64
        if largest <= part:

            def typed(slot, rank, like):
                return slot[rank * part : rank * part + like.nbytes].view(like.dtype).view(like.shape)

            def write(slot):
                for rank, send in enumerate(sends):
                    if rank != self.rank:
                        typed(slot, rank, send).copy_(send)

            slots = self._round(write)
            for rank, receive in enumerate(receives):
                if rank != self.rank:
                    receive.copy_(typed(slots[rank], self.rank, receive))
            return
        sends = [send.contiguous().reshape(-1).view(torch.uint8) for send in sends]
        flat = [  # where the windows land (this rank's own piece was copied above)
            None if rank == self.rank else receive.new_empty(receive.shape).reshape(-1).view(torch.uint8)
            for rank, receive in enumerate(receives)
        ]
        for step in range(-(-largest // part)):
            window = slice(step * part, (step + 1) * part)

            def write(slot):
                for rank, send in enumerate(sends):
                    piece = send[window]
                    if rank != self.rank and piece.numel():
                        slot[rank * part : rank * part + piece.numel()].copy_(piece)

            slots = self._round(write)
            for rank, receive in enumerate(flat):
                piece = None if receive is None else receive[window]
                if piece is not None and piece.numel():
                    piece.copy_(slots[rank][self.rank * part : self.rank * part + piece.numel()])
        for rank, receive in enumerate(receives):
            if rank != self.rank:
                receive.copy_(flat[rank].view(receive.dtype).view(receive.shape))

    def broadcast(self, x: torch.Tensor | None, src: int, what: str = "") -> torch.Tensor | None:
        """Rank ``src``'s ``x`` (None elsewhere) on every rank, header and bytes in one step; None on
        every rank when it does not fit a slot or a header (the caller goes through gloo)."""
        header_bytes = HEADER_LENGTH * 8
        fits = (
            x is not None and header_bytes + x.nbytes <= self.slot_bytes and x.dtype in DTYPES and x.dim() <= MAX_DIMS
        )

        def write(slot):
            if x is None:
                return
            header = header_of(x, "cpu") if fits else torch.full((HEADER_LENGTH,), -1, dtype=torch.int64)
            slot[:header_bytes].view(torch.int64).copy_(header)
            if fits:
                slot[header_bytes : header_bytes + x.nbytes].view(x.dtype).view(x.shape).copy_(x)

        slot = self._round(write, what)[src]
        header = slot[:header_bytes].view(torch.int64)
        if int(header[0]) < 0:
            return None
        if x is not None:
            return x
        out = empty_from(header, "cpu")
        return out.copy_(slot[header_bytes : header_bytes + out.nbytes].view(out.dtype).view(out.shape))

    def all_reduce(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Sum in rank order on every rank, so all ranks get bitwise the same result. Low precision
        is accumulated in fp32 and rounded once; for two ranks that is what adding in the dtype does
        (torch adds bf16/fp16 on the CPU in fp32 and rounds once), without the conversions. The sum
        is written into ``into`` (``x`` itself, when the caller gives it up) or a new tensor; never a
        view of shared memory: callers (autograd's too) may add to it in place."""
        flat = x.reshape(-1)
        n = flat.numel()
        slots = self._round(lambda slot: slot.view(x.dtype)[:n].copy_(flat))
        parts = [slot.view(x.dtype)[:n].view(x.shape) for slot in slots]
        if self.world_size == 2 or x.dtype not in (torch.bfloat16, torch.float16):
            out = torch.add(parts[0], parts[1], out=into)
            for part in parts[2:]:
                out += part
            return out
        total = parts[0].to(torch.float32)
        for part in parts[1:]:
            total += part
        return total.to(x.dtype) if into is None else into.copy_(total)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Views of every rank's ``x`` in shared memory: consume them before the next collective."""
        parts = self.exchange(x.contiguous().reshape(-1).view(torch.uint8))
        return [part.view(x.dtype).view(x.shape) for part in parts]


def wait_until(ready, timeout: float, late, spin_only: bool = False, gone=None) -> None:
    """Spin until ``ready()``, yielding the core (oversubscribed cores: let the rank we wait for
    run); past a millisecond, nap between looks unless ``spin_only`` (a pipeline stage may wait a
    whole stage's forward). Past ``timeout`` seconds: RankFailure with ``late()``'s account. ``gone()``,
    looked at every ``LIVENESS_S`` of waiting: why the wait can never end (a peer's process exited), or None;
    a RankFailure names it then, not at the timeout."""
    spins, start, looked = 0, None, 0.0
    while not ready():
        spins += 1
        if spins % 256 == 0:
            os.sched_yield()
            now = time.monotonic()
            if start is None:
                start = looked = now
            elif gone is not None and now - looked > LIVENESS_S and (why := gone()):
                raise RankFailure(f"hf_parallel: {late()}: {why}, so it never will (the others wait no longer)")
            elif now - start > timeout:
                raise RankFailure(
                    f"hf_parallel: {late()} within {timeout:.0f}s (a rank died, hangs, or ranks issued different "
                    "collectives); set HF_PARALLEL_TIMEOUT to change"
                )
            elif not spin_only and now - start > 1e-3:
                time.sleep(50e-6)
            if gone is not None and now - looked > LIVENESS_S:
                looked = now


def usable() -> bool:
    """Whether this rank may use shared memory at all: x86 (ordered stores), /dev/shm, not turned off."""
    return (
        os.environ.get("HF_PARALLEL_SHM", "1") != "0"
        and platform.machine() in ("x86_64", "AMD64")
        and os.path.isdir("/dev/shm")
    )


def one_host(ranks: list[tuple[bool, str]]) -> bool:
    """Whether ranks that reported ``(usable(), host_id())`` may share memory: all can, on one known host."""
    return all(ok for ok, _ in ranks) and len({host for _, host in ranks}) == 1 and bool(ranks[0][1])


def host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return socket.gethostname() + ":" + f.read().strip()
    except OSError:
        return ""


def attach(group, rank: int, world_size: int, timeout: float, slot_bytes: int = SLOT_BYTES) -> ShmChannel | None:
    """Collective over ``group``: map a shared-memory channel if every rank can, else None (gloo)."""
    hosts = [None] * world_size
    dist.all_gather_object(hosts, (usable(), host_id(), identity()), group=group)
    if not one_host([host[:2] for host in hosts]):
        return None
    names = [f"/dev/shm/hf_parallel-{os.getpid()}-{uuid.uuid4().hex}" if rank == 0 else None]
    dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
    path, channel = names[0], None
    created = [None] * world_size
    if rank == 0:
        try:
            with open(path, "wb") as f:
                f.truncate(ShmChannel.size(world_size, slot_bytes))
        except OSError:
            path = None
    dist.all_gather_object(created, path is not None, group=group)  # also a barrier: the file exists
    if created[0]:
        try:
            channel = ShmChannel(path, rank, world_size, timeout, slot_bytes, peers=[host[2] for host in hosts])
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


class ShmPipe:
    """One direction between two ranks of one host (a pipeline stage's sends to the next): a ring of
    ``slots`` the sender fills and the receiver empties, counted by two counters on cache lines of
    their own; a message larger than a slot takes several, in order, matched in order as gloo
    matches one tag. A send never waits, as gloo's ``isend`` does not: what the ring cannot take
    yet stays queued (views of the message, which must not change until ``drain``) and moves in
    whenever this rank waits on a pipe. So two stages sending to each other never wait on each
    other's full rings (1F1B's forwards one way, gradients the other)."""

    def __init__(self, path: str, timeout: float, slots: int = 8, slot_bytes: int = PIPE_SLOT_BYTES,
                 peer: dict | None = None):  # fmt: skip
        self.timeout, self.slots, self.slot_bytes = timeout, slots, slot_bytes
        self.peer = watchable(peer) if peer else None  # {rank: identity} of the other end (liveness.py)
        self.memory = torch.from_file(path, shared=True, size=self.size(slots, slot_bytes), dtype=torch.uint8)
        self.counters = np.frombuffer(self.memory[: 2 * FLAG_STRIDE * 8].numpy(), dtype=np.int64)[::FLAG_STRIDE]
        self.written = self.taken = 0  # this end's own count (the other end's is read from memory)
        self.queued: deque = deque()  # pieces sent but not yet in the ring

    @staticmethod
    def size(slots: int = 8, slot_bytes: int = PIPE_SLOT_BYTES) -> int:
        return 2 * FLAG_STRIDE * 8 + slots * slot_bytes

    def _slot(self, count: int) -> torch.Tensor:
        start = 2 * FLAG_STRIDE * 8 + (count % self.slots) * self.slot_bytes
        return self.memory[start : start + self.slot_bytes]

    def _pieces(self, flat: torch.Tensor):
        for start in range(0, max(flat.numel(), 1), self.slot_bytes):
            yield flat[start : start + self.slot_bytes]

    def send(self, data: torch.Tensor) -> None:
        """Queue ``data`` (contiguous, on the CPU) and move what fits into the ring."""
        self.queued.extend(self._pieces(data.reshape(-1).view(torch.uint8)))
        _SENDING.add(self)
        self.push()

    def push(self) -> bool:
        """Move queued pieces into the ring while it has room; whether some are left."""
        while self.queued and self.written - self.counters[1] < self.slots:
            piece = self.queued.popleft()
            self._slot(self.written)[: piece.numel()].copy_(piece)
            self.written += 1
            self.counters[0] = self.written
        if not self.queued:
            _SENDING.discard(self)
        return bool(self.queued)

    def recv(self, out: torch.Tensor, what: str) -> torch.Tensor:
        """The next message, into ``out`` (contiguous, on the CPU, of the message's size)."""

        def arrived() -> bool:
            push_all()
            return self.counters[0] > self.taken

        for piece in self._pieces(out.reshape(-1).view(torch.uint8)):
            wait_until(arrived, self.timeout, lambda: f"{what}: nothing arrived",
                       gone=lambda: exit_message(self.peer, list(self.peer or ())))  # fmt: skip
            piece.copy_(self._slot(self.taken)[: piece.numel()])
            self.taken += 1
            self.counters[1] = self.taken
        return out


_SENDING: set = set()  # pipes of this process with queued pieces


def push_all() -> bool:
    """Move every pipe's queued pieces that fit; whether some are left."""
    return any([pipe.push() for pipe in list(_SENDING)])


def drain(timeout: float, what: str) -> None:
    """Wait until every piece this process sent is in its ring (the messages may change after)."""
    def gone() -> str | None:
        return next(filter(None, (exit_message(pipe.peer, list(pipe.peer or ())) for pipe in _SENDING)), None)

    wait_until(lambda: not push_all(), timeout, lambda: f"{what}: the receiving stage took nothing", gone=gone)


def attach_pipes(links: list[tuple[int, int]], rank: int, world_size: int, timeout: float, **ring) -> dict:
    """Collective over the world: a pipe for every ``(sender, receiver)`` of ``links`` (the same list
    on every rank) whose two ranks share a host; this rank's, by link. The sender creates the file,
    the receiver maps it, then the name goes (the mappings outlive it). ``ring``: ShmPipe's sizes."""
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (usable(), host_id(), uuid.uuid4().hex, identity()))
    token = everyone[0][2]
    shared = [(a, b) for a, b in links if one_host([everyone[a][:2], everyone[b][:2]])]
    path = {link: f"/dev/shm/hf_parallel-{token}-{link[0]}-{link[1]}" for link in shared}
    pipes, created, mapped = {}, [None] * world_size, [None] * world_size
    mine = [link for link in shared if link[0] == rank]
    for link in mine:
        try:
            with open(path[link], "wb") as f:
                f.truncate(ShmPipe.size(**ring))
            pipes[link] = ShmPipe(path[link], timeout, **ring, peer={link[1]: everyone[link[1]][3]})
        except (OSError, RuntimeError):  # e.g. /dev/shm full: this link stays on gloo
            pass
    dist.all_gather_object(created, sorted(pipes))
    made = {tuple(link) for links_of in created for link in links_of}
    for link in shared:
        if link[1] == rank and link in made:
            try:
                pipes[link] = ShmPipe(path[link], timeout, **ring, peer={link[0]: everyone[link[0]][3]})
            except (OSError, RuntimeError):
                pass
    dist.all_gather_object(mapped, sorted(pipes))
    both = [tuple(link) for links_of in mapped for link in links_of]
    for link in mine:
        if os.path.exists(path[link]):
            os.unlink(path[link])
    return {link: pipe for link, pipe in pipes.items() if both.count(link) == 2}
