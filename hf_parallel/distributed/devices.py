"""Where this rank computes and what its process groups carry: the one owner of both facts.

A rank's **compute device** holds every parameter, buffer and scratch tensor of its model. Its
**wire** is the device whose tensors the groups' backend moves: NCCL (or XCCL) carries the
accelerator's memory, gloo carries the host's. The two differ when several ranks share one GPU
(NCCL refuses two ranks on one device, so their groups are gloo groups: a laptop GPU, a one-card test
machine) or when a user runs a GPU model over gloo; a point-to-point message then goes through host
memory (``to_wire``), while gloo's collectives stage accelerator tensors themselves. vLLM keeps a
CPU group and a device group per ``GroupCoordinator``; here one backend serves every group of a mesh,
and the mesh asks ``wire_of`` once.

The choice is made of pure functions of what the process sees, so each case is tested without the
hardware:
- ``choose_device``: ``HF_PARALLEL_DEVICE`` (``cpu``, ``cuda``, ``cuda:1``) first; else an accelerator
  with a collective library (``torch.accelerator``: CUDA, XPU; not MPS) at index ``LOCAL_RANK`` modulo the
  visible devices (one visible device per process, as schedulers set ``CUDA_VISIBLE_DEVICES``, is index
  0); else the CPU;
- ``default_backend``: ``"cpu:gloo,cuda:nccl"`` for an accelerator (host tensors over gloo, device
  tensors over NCCL, whose communicators start at their first use), gloo on the CPU;
- ``group_backend``: once the default group is up, every rank's device identity (host and device
  UUID) is gathered over gloo; where two ranks share a device, the mesh's groups are gloo groups.
A process group the user created first keeps its backend unless ranks share a device.

Host tensors bound for a GPU (a load's slices, on CUDA) cross through a ring of a few reused pinned chunks
(``PinnedRing``): the copy is queued while the host fills the next chunk, and the page-locked memory a
process holds is the ring's, whatever the size of the tensors (``chunk_plan``, pure, cuts them).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from typing import Callable

import torch

DEVICE_ENV = "HF_PARALLEL_DEVICE"
COLLECTIVE_BACKENDS = {"cuda": "nccl", "xpu": "xccl"}  # what carries each accelerator's memory between ranks
HOST_BACKENDS = ("gloo", "mpi")  # what carries host memory


@dataclass(frozen=True)
class DeviceBackend:
    """A rank's compute device and the backend of its mesh's process groups."""

    device: torch.device
    backend: str  # as ``init_process_group`` / ``new_group`` take it ("gloo", "nccl", "cpu:gloo,cuda:nccl")

    @property
    def wire(self) -> torch.device:
        return wire_of(self.backend, self.device)

    @property
    def metadata(self) -> torch.device:
        return metadata_device(self.backend, self.device)


def backend_for(backend: str, device_type: str) -> str | None:
    """The backend a (possibly mixed, ``"cpu:gloo,cuda:nccl"``) backend string uses for ``device_type``."""
    if ":" not in backend:
        return backend
    by_device = dict(part.split(":") for part in backend.split(","))
    return by_device.get(device_type)


def wire_of(backend: str, device: torch.device) -> torch.device:
    """The device whose tensors ``backend`` moves for a rank computing on ``device``: the device itself
    when its backend is the accelerator's collective library, else the host."""
    if device.type == "cpu":
        return device
    return device if backend_for(backend, device.type) == COLLECTIVE_BACKENDS.get(device.type) else torch.device("cpu")


def metadata_device(backend: str, device: torch.device) -> torch.device:
    """Where a message's header (its dtype and shape) travels: the host whenever the backend carries
    host tensors (gloo, or ``"cpu:gloo,cuda:nccl"`` beside NCCL), so a receiver reads a shape without
    waiting for its device and a sender writes one without a copy to it (vLLM's CPU group beside its
    device group); only a backend that carries the accelerator's memory alone (a user's ``"nccl"``
    group) takes headers on the wire."""
    return torch.device("cpu") if backend_for(backend, "cpu") in HOST_BACKENDS else wire_of(backend, device)


def choose_device(
    *, requested: str | None, accelerator: str | None, device_count: int, local_rank: int
) -> torch.device:
    """This rank's compute device (``accelerator``: ``torch.accelerator``'s device type, or None)."""
    if requested:
        device = torch.device(requested)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, local_rank % max(device_count, 1))
    elif accelerator in COLLECTIVE_BACKENDS and device_count > 0:  # not MPS unasked: no collectives, no fp64
        device = torch.device(accelerator, local_rank % device_count)
    else:
        return torch.device("cpu")
    if device.type != "cpu" and not 0 <= device.index < device_count:
        raise ValueError(f"{DEVICE_ENV}={requested!r}: this process sees {device_count} {device.type} device(s)")
    return device


def default_backend(device: torch.device) -> str:
    """The default process group's backend for a rank computing on ``device``."""
    if device.type == "cpu" or device.type not in COLLECTIVE_BACKENDS:
        return "gloo"
    return f"cpu:gloo,{device.type}:{COLLECTIVE_BACKENDS[device.type]}"


def group_backend(initialized: str, device: torch.device, identities: list[str]) -> str:
    """The mesh groups' backend: the default group's, or gloo where two ranks compute on one device
    (``identities``: every rank's ``device_identity``)."""
    if device.type != "cpu" and len(set(identities)) < len(identities):
        return "gloo"
    return initialized


def device_identity(device: torch.device) -> str:
    """What tells two ranks' devices apart: the host and the device's UUID (its index where the
    backend reports none)."""
    if device.type == "cpu":
        return f"{socket.gethostname()}:cpu:{os.getpid()}"
    properties = torch.get_device_module(device.type).get_device_properties(device.index)
    return f"{socket.gethostname()}:{device.type}:{getattr(properties, 'uuid', device.index)}"


def this_device() -> torch.device:
    """``choose_device`` with this process's environment and hardware."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return choose_device(
        requested=os.environ.get(DEVICE_ENV),
        accelerator=accelerator.type if accelerator is not None else None,
        device_count=torch.accelerator.device_count() if accelerator is not None else 0,
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))),
    )


def free_bytes(device: torch.device) -> int | None:
    """Memory that could be allocated on ``device`` now: the accelerator's free bytes and what its caching
    allocator holds unused, or the host's available bytes (``MemAvailable``); None where it cannot be read."""
    try:
        if device.type != "cpu":
            module = torch.get_device_module(device.type)
            return module.mem_get_info(device)[0] + module.memory_reserved(device) - module.memory_allocated(device)
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, RuntimeError, AttributeError):
        return None


def memory_id(device: torch.device) -> float:
    """A number naming the memory ``device``'s tensors take, the same for every rank sharing it: the host's for
    the CPU, the accelerator's own otherwise (48 bits of a hash: exact in a float64)."""
    name = socket.gethostname() if device.type == "cpu" else device_identity(device)
    return float(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "big"))


def activate(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator (kernels and NCCL streams land there)."""
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)


def to_wire(tensor: torch.Tensor, wire: torch.device) -> torch.Tensor:
    """``tensor`` contiguous on ``wire``. An accelerator tensor bound for gloo is copied into plain host
    memory, synchronously (the bytes must be there before the backend reads them, so pinned memory would
    buy no overlap; the driver stages the copy through buffers of its own, and none is held per tensor)."""
    if tensor.device == wire:
        return tensor.contiguous()
    if wire.type == "cpu":
        return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
    return tensor.to(wire).contiguous()


def host_staging(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A page-locked host buffer to read a tensor bound for ``device`` into, or None on the CPU. From
    pageable memory the driver copies through a pinned buffer of its own and the host waits for it;
    from this one the copy is queued (``non_blocking``) and the next read overlaps it. torch's caching
    host allocator holds the buffer back from reuse until its copy is done (vLLM's loaders stage so).
    Each buffer is the tensor's size and stays in that cache: ``pinned_ring`` bounds the memory on CUDA."""
    return None if device.type == "cpu" else torch.empty(shape, dtype=dtype, pin_memory=True)


CHUNK_BYTES = 64 << 20  # one pinned chunk of the staging ring
RING_CHUNKS = 2  # one filled on the host while the other's copy runs


def chunk_plan(numel: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """The element ranges ``[start, stop)`` in which ``numel`` elements of ``itemsize`` bytes cross
    chunks of ``chunk_bytes``: whole elements, each range filling a chunk but the last (one element
    to a chunk where an element is larger)."""
    per = max(1, chunk_bytes // itemsize)
    return [(start, min(start + per, numel)) for start in range(0, numel, per)]


class PinnedRing:
    """A few host chunks of ``chunk_bytes``, reused in turn, through which host tensors reach ``device``
    chunk by chunk: a chunk is filled on the host, its copy queued (``non_blocking``), an event recorded
    after it, and the chunk is filled again only once that event has passed, so the host fills one while
    the device copies another and the pinned memory stays ``chunks`` x ``chunk_bytes``, allocated on
    first use and kept. Page-locked on CUDA; on the CPU (the tests' device) plain memory, copied
    synchronously, no events. One thread's: a loader's."""

    def __init__(self, device: torch.device, chunks: int = RING_CHUNKS, chunk_bytes: int = CHUNK_BYTES):
        self.device, self.chunk_bytes = device, chunk_bytes
        self.buffers: list[torch.Tensor | None] = [None] * chunks
        self._events: list = [None] * chunks
        self._next = 0

    def _take(self) -> int:
        """The next chunk's index, once the copy that last read it is done."""
        index, self._next = self._next, (self._next + 1) % len(self.buffers)
        if self._events[index] is not None:
            self._events[index].synchronize()
            self._events[index] = None
        if self.buffers[index] is None:
            pin = self.device.type == "cuda"
            self.buffers[index] = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pin)
        return index

    def _chunk(self, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.buffers[index][: numel * dtype.itemsize].view(dtype)

    def _send(self, index: int, chunk: torch.Tensor, out: torch.Tensor) -> None:
        """Queue ``chunk`` (of buffer ``index``) into ``out`` on the device, cast there; mark its end."""
        if chunk.dtype == out.dtype:
            out.copy_(chunk, non_blocking=True)
        else:  # across in the source's dtype, cast by a kernel on the device
            out.copy_(chunk.to(out.device, non_blocking=True))
        if self.device.type == "cuda":
            self._events[index] = torch.cuda.Event()
            self._events[index].record(torch.cuda.current_stream(self.device))

    def copy_(self, out: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """``out`` (contiguous, on the device) filled from ``host`` (its shape, any dtype), a chunk at a
        time; returns ``out``, whose last copies may still be queued (the stream orders later use)."""
        if not out.is_contiguous() or out.shape != host.shape:
            raise ValueError(f"a staged copy needs a contiguous target of the source's shape: {out.shape} {host.shape}")
        source, target = host.reshape(-1), out.view(-1)
        for start, stop in chunk_plan(source.numel(), source.element_size(), self.chunk_bytes):
            index = self._take()
            chunk = self._chunk(index, stop - start, source.dtype)
            chunk.copy_(source[start:stop])
            self._send(index, chunk, target[start:stop])
        return out

    def load(self, out: torch.Tensor, dtype: torch.dtype, write: Callable[[torch.Tensor], object]) -> torch.Tensor:
        """``out`` (contiguous, on the device) filled with what ``write(into)`` writes into a host tensor
        of ``out``'s shape in ``dtype``: a chunk itself where it fits in one (written there, no other host
        copy), else plain host memory then ``copy_``. Returns ``out``, its copies queued as ``copy_``'s."""
        if out.numel() * dtype.itemsize > self.chunk_bytes:
            host = torch.empty(out.shape, dtype=dtype)
            write(host)
            return self.copy_(out, host)
        if not out.is_contiguous():
            raise ValueError(f"a staged copy needs a contiguous target: {out.shape}, strides {out.stride()}")
        index = self._take()
        chunk = self._chunk(index, out.numel(), dtype)
        write(chunk.view(out.shape))
        self._send(index, chunk, out.view(-1))
        return out


_RINGS: dict[torch.device, PinnedRing] = {}


def pinned_ring(device: torch.device) -> PinnedRing | None:
    """This process's ring for ``device``: on CUDA only (None elsewhere: the CPU has nothing to stage, and
    other accelerators keep ``host_staging``)."""
    if device.type != "cuda":
        return None
    if device not in _RINGS:
        _RINGS[device] = PinnedRing(device)
    return _RINGS[device]
