"""One mesh for every dimension: the process groups of pipeline stages, sequence and tensor parallelism.

The mesh's shape (``shape.py``: ``dp_replicate x dp_shard x pp x cp x sp x tp``, a TP size per stage)
says which ranks each group holds; this module creates the groups. ``ep`` holds the ranks of distinct
experts: with ``ep_size``, TP ranks times ranks borrowed from the data dimensions, exchanging tokens
(``ep_replicas``: the ranks holding the same experts); without, the TP group. ``model`` is one model replica's
ranks; ``fsdp`` and ``dp_replicate`` are what FSDP2 shards and replicates over (``device_mesh``).

Every process group is created here, once per mesh shape, in the same order on every rank
(``new_group`` is collective over the whole world); everything else asks the mesh for a group by
name. Deep code never reads the environment: it receives a ``Mesh``. Outside torchrun (no
WORLD_SIZE) every dimension has one rank and no process group, and every collective is the identity.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import ops
from .devices import DeviceBackend, activate, default_backend, device_identity, group_backend, this_device
from .faults import collective, group_timeout_seconds
from .shape import MeshShape, asked
from .shm import attach, attach_pipes, channel_for

DIMS = ("pp", "tp", "sp", "model", "dp", "dp_shard", "dp_replicate", "fsdp", "ulysses", "cp", "ep", "ep_replicas")
FSDP_DIMS = ("dp_replicate", "fsdp", "ep_replicas")  # what FSDP2 shards over: created even with one rank
SHM_DIMS = ("tp", "sp", "model", "ulysses", "ep")  # groups that carry activations or logits: shared memory on one host


@dataclass(frozen=True)
class Dim:
    """One dimension's group as this rank sees it."""

    name: str
    rank: int  # this rank's index in the group
    ranks: tuple[int, ...]  # the group's global ranks, in group order
    group: object | None  # the process group; None when it has one rank or there are no processes

    @property
    def size(self) -> int:
        return len(self.ranks)


class Mesh:
    """Every dimension's group for this rank: ``mesh.tp``, ``mesh.sp``, ``mesh.pp``, ``mesh.ep``,
    ``mesh.world``, or ``mesh[name]``."""

    def __init__(
        self, shape: MeshShape, rank: int, device_backend: DeviceBackend, groups: dict[tuple[int, ...], object]
    ):
        self.shape, self.rank = shape, rank
        self.device = device_backend.device  # where this rank computes: every parameter, buffer and scratch tensor
        self.wire = device_backend.wire  # where the groups' backend moves tensors from (``devices.py``)
        self.metadata = device_backend.metadata  # where headers (dtypes and shapes) travel: the host where it can
        self.backend = device_backend.backend
        self._groups = groups  # ranks -> process group (only the groups this rank belongs to)
        self._subgroups: dict = {}
        self._device_mesh = self._expert_device_mesh = None
        self.pipes: dict = {}  # (sender, receiver) -> ShmPipe between adjacent stages' first ranks on one host
        self.dims = {dim: self._dim(dim, shape.groups(dim)) for dim in ("world", *DIMS)}

    def _dim(self, name: str, groups: list[tuple[int, ...]]) -> Dim:
        mine = next((ranks for ranks in groups if self.rank in ranks), (self.rank,))
        return Dim(name, mine.index(self.rank), mine, self._groups.get(mine) if len(mine) > 1 else None)

    @classmethod
    def dry_run(cls, rank: int = 0, **sizes) -> Mesh:
        """``rank``'s view of a mesh with no processes (``hf-parallel plan``): sizes, no groups."""
        return cls(MeshShape.requested(**sizes), rank, DeviceBackend(torch.device("cpu"), "gloo"), {})

    def __getitem__(self, name: str) -> Dim:
        if name not in self.dims:
            raise KeyError(f"unknown mesh dimension {name!r}; the mesh has {', '.join(self.dims)}")
        return self.dims[name]

    tp = property(lambda self: self["tp"])
    sp = property(lambda self: self["sp"])  # the whole sequence group (cp x Ulysses ranks)
    ulysses = property(lambda self: self["ulysses"])  # adjacent ranks trading tokens for heads
    cp = property(lambda self: self["cp"])  # the ring: the ranks at one Ulysses index of every Ulysses group
    pp = property(lambda self: self["pp"])
    ep = property(lambda self: self["ep"])
    dp = property(lambda self: self["dp"])
    fsdp = property(lambda self: self["fsdp"])
    model = property(lambda self: self["model"])
    world = property(lambda self: self["world"])

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica (each replica sees its own batch)."""
        return self.shape.replica(self.rank)

    @property
    def holds_copy(self) -> bool:
        """Whether another rank (sequence index 0 of the first data-parallel replica) holds the same
        shards as this one, so that saving leaves this rank out."""
        return self.sp.rank != 0 or self.dp.rank != 0

    @property
    def holds_experts_of_main(self) -> bool:
        """Whether this rank is in rank 0's EP group under ``ep_size``: its experts are ones the save gathers,
        even where the rest of its shards are a data-parallel copy (``holds_copy``)."""
        return self.shape.ep > 1 and 0 in self.ep.ranks

    def device_mesh(self):
        """The ``torch.distributed`` DeviceMesh FSDP2 shards over: ``fsdp`` (1-D), or
        ``(dp_replicate, fsdp)`` for HSDP; built from the mesh's own groups."""
        from torch.distributed.device_mesh import DeviceMesh

        if self._device_mesh is None:
            shard = self["fsdp"].ranks
            if self.shape.dp_replicate == 1:
                self._device_mesh = DeviceMesh.from_group(
                    self._groups[shard], self.device.type, mesh_dim_names=("fsdp",)
                )
            else:
                rows = self["dp_replicate"].ranks
                layout = [next(g for g in self.shape.groups("fsdp") if r in g) for r in rows]
                self._device_mesh = DeviceMesh.from_group(
                    [self._groups[rows], self._groups[shard]], self.device.type, mesh=layout,
                    mesh_dim_names=("dp_replicate", "fsdp"),
                )  # fmt: skip
        return self._device_mesh

    def expert_device_mesh(self):
        """The 1-D DeviceMesh FSDP2 shards experts over under ``ep_size``: the ranks holding the same experts
        (torchtitan's ``dp_shard_mod_ep``, here every data rank outside the EP group)."""
        from torch.distributed.device_mesh import DeviceMesh

        if self._expert_device_mesh is None:
            group = self._groups[self["ep_replicas"].ranks]
            self._expert_device_mesh = DeviceMesh.from_group(group, self.device.type, mesh_dim_names=("ep_replicas",))
        return self._expert_device_mesh

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def stage(self) -> int:
        return self.shape.position(self.rank)[0]

    @property
    def num_stages(self) -> int:
        return self.shape.num_stages

    @property
    def leads_stage(self) -> bool:
        """Whether this rank is its pipeline stage's first (it speaks for the stage)."""
        return self.tp.rank == 0 and self.sp.rank == 0

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks of ``stage`` in this rank's model replica."""
        return self.shape.stage_ranks(stage, self.replica)

    def barrier(self) -> None:
        group = self.world.group
        if group is not None:
            with collective(f"barrier on rank {self.rank}"):
                dist.barrier(group=group)

    def per_stage(self, value, what: str) -> list:
        """Every pipeline stage's ``value`` as its first rank has it, in stage order, on every rank
        (collective over the world; ``what`` names it in a RankFailure)."""
        if self.world.group is None:
            return [value]
        everyone = [None] * self.world_size
        with collective(f"{what} (rank {self.rank})"):
            dist.all_gather_object(everyone, (self.stage, value if self.leads_stage else None), group=self.world.group)
        firsts = dict(item for item in everyone if item[1] is not None)  # one first rank per stage
        return [firsts[stage] for stage in range(self.num_stages)]

    def subgroup(self, dim: str, partition) -> object | None:
        """This rank's part of its ``dim`` group, split by ``partition(size)`` (lists of indices
        into a group of that size; e.g. the ranks sharing a replicated KV head). Collective: every
        rank calls it with the same partition; the groups are created once per partition."""
        if not self._groups:  # one rank, or a dry run: no processes to group
            return None
        parts = [
            tuple(tuple(ranks[i] for i in part) for part in partition(len(ranks))) for ranks in self.shape.groups(dim)
        ]
        key = (dim, tuple(parts))
        if key not in self._subgroups:
            mine = None
            for members in (members for group_parts in parts for members in group_parts):
                group = self._new_group(members)
                if self.rank in members:
                    mine = group
            self._subgroups[key] = mine
        return self._subgroups[key]

    def _new_group(self, ranks: tuple[int, ...]):
        if len(ranks) < 2:
            return None
        return _new_group(ranks, self.world_size, default_timeout(self.backend), self.backend)

    def __str__(self) -> str:
        """``rank 3: pp 1/2, tp 1/2, sp 0/1``: this rank's stage, then its index in each group (and in
        the data-parallel replicas, when there are several: ``dp 1/2``)."""
        dims = ("tp", "sp", "dp") if self.dp.size > 1 else ("tp", "sp")
        where = {"pp": (self.stage, self.num_stages), **{d: (self[d].rank, self[d].size) for d in dims}}
        return f"rank {self.rank}: " + ", ".join(f"{d} {i}/{n}" for d, (i, n) in where.items())

    __repr__ = __str__


_MESHES: dict[MeshShape, Mesh] = {}  # one mesh (and one set of process groups) per shape


def shutdown() -> None:
    """Leave the process group together, before interpreter exit: gloo aborts the process when its
    threads are torn down during finalization or while a peer is still mid-collective."""
    if dist.is_initialized():
        dist.barrier()
    _leave_at_exit()


SETTLE_SECONDS = 0.1  # at exit, the GIL is let go this long for the process groups' threads


def _leave_at_exit() -> None:
    """Let the process groups' threads finish, then destroy the groups, while the interpreter still
    runs (registered at exit once a mesh exists). A gloo worker thread finishes a collective's work
    (an all-gather: the Trainer's, accelerate's, ours) just after the caller has it back, and then
    releases the work's tensors, whose Python objects need the GIL. When the program ends right
    then, the thread asks for the GIL during finalization, is made to exit inside a destructor, and
    the process aborts: "terminate called without an active exception" (the core dump's stack,
    torch 2.13, pytorch#190489: a race, which a run that ends right after an all-gather can lose). Destroying
    the groups alone does not join those threads; sleeping hands them the GIL (a mitigation: a thread held
    up longer on a loaded host could still lose the race, which only torch joining its workers closes;
    ``test_exit.py`` checks that runs end cleanly). No peer is waited for; after an uncaught exception
    the groups are left to the process's end (a backend's destroy may wait for peers)."""
    _MESHES.clear()
    if dist.is_initialized():
        time.sleep(SETTLE_SECONDS)
        if getattr(sys, "last_value", None) is None:
            dist.destroy_process_group()


def default_timeout(backend: str) -> datetime.timedelta:
    """A process group's timeout on ``backend`` (``faults.group_timeout_seconds``: NCCL's outlasts the bound)."""
    return datetime.timedelta(seconds=group_timeout_seconds(backend))


def get_mesh(
    tp_size: int | None = None,
    *,
    sp_size: int = 1,
    pp_size: int = 1,
    stage_tp_sizes=None,
    fsdp_size: int = 1,
    dp_replicate_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    timeout: datetime.timedelta | None = None,
) -> Mesh:
    """The mesh of this shape over torchrun's ranks, joining (or creating) the default process
    group first, on the device ``devices.this_device`` picks (host tensors over gloo, an accelerator's
    over its own collective library; the mesh's groups are gloo groups where ranks share a device). Its
    groups are created on the first call. One process (no torchrun) computes on the accelerator too,
    when there is one (``HF_PARALLEL_DEVICE=cpu`` keeps it on the host)."""
    sizes = dict(tp_size=tp_size, sp_size=sp_size, pp_size=pp_size, stage_tp_sizes=stage_tp_sizes,
                 fsdp_size=fsdp_size, dp_replicate_size=dp_replicate_size, cp_size=cp_size,
                 ep_size=ep_size)  # fmt: skip
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            if MeshShape.requested(**sizes).world_size != 1:  # malformed sizes: the same errors as under torchrun
                raise ValueError(
                    f"{asked(**sizes)} was asked for, but this process was not started by torchrun "
                    "(WORLD_SIZE is unset or 1)"
                )
            device = this_device()
            activate(device)
            return Mesh(MeshShape((1,)), 0, DeviceBackend(device, default_backend(device)), {})
        device = this_device()
        activate(device)
        backend = default_backend(device)
        with collective(f"joining the process group (rank {os.environ.get('RANK')} of {os.environ['WORLD_SIZE']})"):
            dist.init_process_group(backend=backend, timeout=timeout or default_timeout(backend))
    shape = MeshShape.of(dist.get_world_size(), **sizes)
    if not _MESHES:
        atexit.unregister(_leave_at_exit)  # registered once, however often meshes are made anew
        atexit.register(_leave_at_exit)
    if shape not in _MESHES:
        _MESHES[shape] = _create(shape, timeout)
    return _MESHES[shape]


def _new_group(ranks: tuple[int, ...], world_size: int, timeout: datetime.timedelta, backend: str):
    """The process group of ``ranks`` with ``backend`` (collective over the world; a sentinel on a rank
    outside it), registered by name for the compiled collectives."""
    if len(ranks) == world_size and backend == str(dist.get_backend()):
        group = dist.group.WORLD
    else:
        group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
    ops.register(group)
    return group


def _create(shape: MeshShape, timeout: datetime.timedelta | None) -> Mesh:
    rank = dist.get_rank()
    device = this_device()
    activate(device)
    device_backend = DeviceBackend(device, str(dist.get_backend()))
    if device.type != "cpu":  # which ranks share a device, over gloo (NCCL cannot even be asked when they do)
        identities = [None] * shape.world_size
        with collective(f"comparing the ranks' devices on rank {rank}"):
            probe = dist.new_group(backend="gloo")
            dist.all_gather_object(identities, device_identity(device), group=probe)
            dist.destroy_process_group(probe)
        device_backend = DeviceBackend(device, group_backend(device_backend.backend, device, identities))
    timeout = timeout or default_timeout(device_backend.backend)
    groups = {}
    with collective(f"creating the process groups of the mesh on rank {rank}"):
        for dim in ("world", *DIMS):  # the same order on every rank: new_group is collective over the world
            for ranks in shape.groups(dim):
                fsdp = shape.dp > 1 and dim in FSDP_DIMS and (dim != "ep_replicas" or shape.ep > 1)
                if ranks in groups or (len(ranks) < 2 and not fsdp):
                    continue
                group = _new_group(ranks, shape.world_size, timeout, device_backend.backend)
                if rank in ranks:
                    groups[ranks] = group
                else:
                    groups.setdefault(ranks, None)
    mesh = Mesh(shape, rank, device_backend, {ranks: g for ranks, g in groups.items() if g is not None})
    if mesh.wire.type != "cpu" and mesh.world.group is not None:
        # the world's communicator made now, by every rank: NCCL requires a batch of point-to-point operations
        # that is a group's first operation to include all of its ranks, and a pipeline's swaps are two ranks'
        with collective(f"starting the world's {mesh.wire.type} communicator on rank {rank}"):
            dist.all_reduce(torch.zeros(1, device=device), group=mesh.world.group)
    if device.type == "cpu":
        for dim in SHM_DIMS:  # in a fixed order: attaching is collective over each group
            d = mesh[dim]
            if d.group is not None and channel_for(d.group) is None:
                with collective(f"setting up shared-memory collectives for {dim} on rank {rank}"):
                    attach(d.group, d.rank, d.size, timeout=timeout.total_seconds())
        if shape.num_stages > 1:
            with collective(f"setting up shared-memory pipes between pipeline stages on rank {rank}"):
                mesh.pipes = attach_pipes(shape.stage_links(), rank, shape.world_size, timeout.total_seconds())
    return mesh
