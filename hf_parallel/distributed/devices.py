"""Where this rank computes and what its process groups carry: the one owner of both facts.

A rank's **compute device** holds every parameter, buffer and scratch tensor of its model. Its
**wire** is the device whose tensors the groups' backend moves: NCCL (or XCCL) carries the
accelerator's memory, gloo carries the host's. The two differ when several ranks share one GPU
(NCCL refuses two ranks on one device, so their groups are gloo groups: a laptop GPU, a one-card test
machine) or when a user runs a GPU model over gloo; a point-to-point message then goes through pinned
host memory (``to_wire``), while gloo's collectives stage accelerator tensors themselves. vLLM keeps a
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
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

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


def activate(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator (kernels and NCCL streams land there)."""
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)


def to_wire(tensor: torch.Tensor, wire: torch.device) -> torch.Tensor:
    """``tensor`` contiguous on ``wire``: an accelerator tensor bound for gloo goes through pinned host
    memory (the copy is synchronous: the bytes must be there before the backend reads them)."""
    if tensor.device == wire:
        return tensor.contiguous()
    if wire.type == "cpu":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor)
    return tensor.to(wire).contiguous()


def host_staging(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A page-locked host buffer to read a tensor bound for ``device`` into, or None on the CPU. From
    pageable memory the driver copies through a pinned buffer of its own and the host waits for it;
    from this one the copy is queued (``non_blocking``) and the next read overlaps it. torch's caching
    host allocator holds the buffer back from reuse until its copy is done (vLLM's loaders stage so)."""
    return None if device.type == "cpu" else torch.empty(shape, dtype=dtype, pin_memory=True)
