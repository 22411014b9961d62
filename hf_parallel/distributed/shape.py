"""The shape of a mesh: its sizes, which global ranks each group holds, and its text. Pure data
(no torch, no processes), so the CLI, the dry run and the mesh itself share one owner of these facts.

The world is ``dp_replicate x dp_shard x pp x cp x sp x tp``. One *model replica* (``pp x cp x sp x tp``)
is a contiguous run of ranks: the ranks of one TP group are adjacent, TP groups sit inside SP
groups (Ulysses, adjacent ranks), SP groups inside the ring of context parallelism (``cp``). The
*sequence group* (``sp`` below, the mesh's ``sp`` dimension) is all ``cp x sp`` ranks a sequence is
split over; ``ulysses`` and ``cp`` are its two parts. Each pipeline stage is a contiguous run of
the replica's ranks. With a TP size per stage (``stage_tp_sizes``: variable tensor parallelism)
stage i holds ``sp * stage_tp_sizes[i]`` ranks and the replica is their sum. The data-parallel dimensions are outermost (slowest links):
``dp_shard`` replicas are FSDP's shard group, ``dp_replicate`` copies of those are HSDP's
replicas; every data-parallel rank sees its own batch, every rank of one replica the same one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshShape:
    """The sizes of a mesh and which global ranks each of its groups holds (no processes needed)."""

    stage_tp_sizes: tuple[int, ...]
    sp: int = 1  # the sequence group: cp x Ulysses ranks
    dp_shard: int = 1  # FSDP: replicas whose parameters, gradients and optimizer state are sharded between them
    dp_replicate: int = 1  # HSDP: copies of the FSDP group, gradients all-reduced between them
    cp: int = 1  # context parallelism: groups of sp / cp adjacent Ulysses ranks, in a ring
    ep: int = 1  # expert parallelism exchanging tokens: ranks holding distinct experts (tp x ranks of the data)

    @classmethod
    def of(
        cls, world_size: int | None, tp_size=None, sp_size=1, pp_size=1, stage_tp_sizes=None, fsdp_size=1,
        dp_replicate_size=1, cp_size=1, ep_size=1,
    ) -> MeshShape:  # fmt: skip
        """The shape the user asked for, checked against ``world_size``; ``tp_size=None`` takes
        whatever the other dimensions leave of the world (``world_size=None``: no world to fill,
        ``tp_size=None`` counts as 1)."""
        sizes = dict(tp_size=tp_size, sp_size=sp_size, pp_size=pp_size, stage_tp_sizes=stage_tp_sizes,
                     fsdp_size=fsdp_size, dp_replicate_size=dp_replicate_size, cp_size=cp_size,
                     ep_size=ep_size)  # fmt: skip
        for name, value in (
            ("tp_size", tp_size), ("sp_size", sp_size), ("pp_size", pp_size), ("fsdp_size", fsdp_size),
            ("dp_replicate_size", dp_replicate_size), ("cp_size", cp_size), ("ep_size", ep_size),
        ):  # fmt: skip
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: every mesh dimension needs a whole number of ranks, at least 1")
        if stage_tp_sizes is not None:
            stages = tuple(stage_tp_sizes)
            if not stages or not all(isinstance(t, int) and t >= 1 for t in stages):
                raise ValueError(f"stage_tp_sizes={stage_tp_sizes!r}: one TP size of at least 1 per pipeline stage")
            if tp_size is not None or pp_size not in (1, len(stages)):
                raise ValueError(
                    f"stage_tp_sizes={list(stages)} gives every stage its TP size; leave tp_size unset and "
                    f"pp_size at {len(stages)} (got tp_size={tp_size}, pp_size={pp_size})"
                )
        else:
            if tp_size is None and world_size is None:
                tp_size = 1
            elif tp_size is None:
                others = dp_replicate_size * fsdp_size * pp_size * sp_size * cp_size
                if world_size % others:
                    names, values = "pp_size x sp_size", f"{pp_size} x {sp_size}"
                    if cp_size > 1:
                        names, values = "pp_size x cp_size x sp_size", f"{pp_size} x {cp_size} x {sp_size}"
                    if dp_replicate_size * fsdp_size > 1:
                        names = f"dp_replicate_size x fsdp_size x {names}"
                        values = f"{dp_replicate_size} x {fsdp_size} x {values}"
                    raise ValueError(f"world size {world_size} is not a multiple of {names} = {values}")
                tp_size = world_size // others
            stages = (tp_size,) * pp_size
        shape = cls(stages, sp_size * cp_size, fsdp_size, dp_replicate_size, cp_size, ep_size)
        shape._check_expert_parallel()
        if world_size is not None and shape.world_size != world_size:
            names, values = (
                ("sp_size x sum(stage_tp_sizes)", f"{sp_size} x {sum(stages)}")
                if stage_tp_sizes is not None
                else ("pp_size x sp_size x tp_size", f"{pp_size} x {sp_size} x {stages[0]}")
            )
            if cp_size > 1:
                names, values = f"cp_size x {names}", f"{cp_size} x {values}"
            if shape.dp > 1:
                names, values = (
                    f"dp_replicate_size x fsdp_size x {names}",
                    f"{dp_replicate_size} x {fsdp_size} x {values}",
                )
            needs = f"{names} = {values}"
            raise ValueError(
                f"{asked(**{**sizes, 'tp_size': tp_size})} was asked for, but the process group has world size "
                f"{world_size} (the mesh needs {needs} = {shape.world_size} ranks)"
            )
        return shape

    @classmethod
    def requested(cls, **sizes) -> MeshShape:
        """The shape these sizes ask for, before any process exists (``tp_size=None`` counts as 1)."""
        return cls.of(None, **sizes)

    def _check_expert_parallel(self) -> None:
        """``ep_size`` as transformers defines it (a multiple of ``tp_size`` dividing ``fsdp_size x tp_size``),
        extended to ``dp_replicate`` and the sequence ranks: the EP group is ``tp`` times ``ep_size / tp_size``
        ranks borrowed from the data (the sequence ranks first, then FSDP's, then the replicas)."""
        if self.ep == 1:
            return
        tp, data = self.stage_tp_sizes[0], self.dp * self.sp
        if self.num_stages > 1:
            raise ValueError(
                f"ep_size={self.ep} with pp_size / stage_tp_sizes ({self}): expert parallelism exchanging tokens "
                "runs over one stage's ranks; load without ep_size (ep_plan='auto' spreads experts over the TP "
                "group) or without pipeline stages"
            )
        if self.sp > 1 and self.dp == 1:
            raise ValueError(
                f"ep_size={self.ep} with sp_size / cp_size and no fsdp_size / dp_replicate_size ({self}): the "
                "sequence ranks' gradient sums are FSDP's here, and an expert's must skip the ranks holding others; "
                "add fsdp_size or dp_replicate_size"
            )
        if self.ep % tp or data % (self.ep // tp):
            raise ValueError(
                f"ep_size={self.ep} with {self}: ep_size must be tp_size ({tp}) times a divisor of the ranks that see "
                f"distinct tokens (dp_replicate x fsdp x cp x sp = {data}); e.g. ep_size={tp * data}"
            )

    @property
    def ep_data(self) -> int:
        """Ranks of the data (and sequence) dimensions one EP group borrows."""
        return self.ep // self.stage_tp_sizes[0]

    @property
    def ulysses(self) -> int:
        """Ranks of one Ulysses group (``sp_size``): adjacent ranks of the sequence group."""
        return self.sp // self.cp

    @property
    def replica_size(self) -> int:
        """Ranks of one model replica: every pipeline stage, sequence and tensor shard once."""
        return self.sp * sum(self.stage_tp_sizes)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: each sees its own batch."""
        return self.dp_shard * self.dp_replicate

    @property
    def world_size(self) -> int:
        return self.dp * self.replica_size

    @property
    def num_stages(self) -> int:
        return len(self.stage_tp_sizes)

    def __str__(self) -> str:
        """``tp=2 x sp=2``, or ``pp=2 (tp per stage [2, 1])``: the layout, as every message names it."""
        stages = self.stage_tp_sizes
        text = f"tp={stages[0]}" if len(stages) == 1 else f"pp={len(stages)} (tp per stage {list(stages)})"
        text += f" x sp={self.ulysses}" if self.ulysses > 1 else ""
        text += f" x cp={self.cp}" if self.cp > 1 else ""
        text += f" x fsdp={self.dp_shard}" if self.dp_shard > 1 else ""
        text += f" x dp_replicate={self.dp_replicate}" if self.dp_replicate > 1 else ""
        return text + (f" (ep={self.ep})" if self.ep > 1 else "")

    def _first(self, stage: int) -> int:
        return self.sp * sum(self.stage_tp_sizes[:stage])

    def global_rank(self, stage: int, sp: int, tp: int, replica: int = 0) -> int:
        """The rank at this place of data-parallel replica ``replica`` (``replicate x dp_shard + shard``)."""
        return replica * self.replica_size + self._first(stage) + sp * self.stage_tp_sizes[stage] + tp

    def stage_links(self) -> list[tuple[int, int]]:
        """``(sender, receiver)``: every pair of adjacent stages' first ranks that exchange hidden
        states (forward) and their gradients (backward), at each SP index of each replica."""
        links = []
        for replica in range(self.dp):
            for sp in range(self.sp):
                for stage in range(self.num_stages - 1):
                    a, b = self.global_rank(stage, sp, 0, replica), self.global_rank(stage + 1, sp, 0, replica)
                    links += [(a, b), (b, a)]
        return links

    def replica(self, rank: int) -> int:
        """Which data-parallel replica a global rank belongs to."""
        return rank // self.replica_size

    def position(self, rank: int) -> tuple[int, int, int]:
        """(stage, sp index, tp index) of a global rank, inside its replica."""
        offset_in_replica = rank % self.replica_size
        for stage, tp in enumerate(self.stage_tp_sizes):
            offset = offset_in_replica - self._first(stage)
            if offset < self.sp * tp:
                return stage, offset // tp, offset % tp
        raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")

    def stage_ranks(self, stage: int, replica: int = 0) -> tuple[int, ...]:
        start = replica * self.replica_size
        return tuple(range(start + self._first(stage), start + self._first(stage + 1)))

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every group of ``dim``, in the order every rank creates them. ``pp`` joins the ranks at
        the same (sp, tp) position of every stage; under variable TP only the positions every stage
        has (tp index below the smallest stage's TP size), and a rank past them pipes through no group.
        ``model``: one replica's ranks; ``dp``: the ranks at one place of every replica, ``dp_shard``
        and ``dp_replicate`` its two parts; ``fsdp``: what FSDP shards over, the ``dp_shard`` replicas
        times the sequence group (SP folded in, as torchtitan folds its context dimension). ``ulysses``
        and ``cp``: the sequence group's two parts (adjacent ranks; the ranks at one Ulysses index
        of every Ulysses group, the ring)."""
        if dim == "world":
            return [tuple(range(self.world_size))]
        if dim in ("model", "tp", "sp", "pp"):
            return self._replica_groups(dim)
        if dim in ("ulysses", "cp"):
            return self._sequence_part_groups(dim)
        if dim in ("dp", "dp_shard", "dp_replicate", "fsdp"):
            return self._data_parallel_groups(dim)
        if dim in ("ep", "ep_replicas"):
            return self._expert_groups(dim)
        raise ValueError(
            f"unknown mesh dimension {dim!r}; the mesh has world, model, pp, tp, sp, ulysses, cp, dp, dp_shard, "
            "dp_replicate, fsdp, ep and ep_replicas"
        )

    def _expert_groups(self, dim: str) -> list[tuple[int, ...]]:
        """``ep``: the ranks holding distinct experts (``ep_size``), a rank's EP index ``data x tp + tp
        index``, borrowing ``ep_data`` consecutive data places (a data place: replica x sequence index, the
        sequence index fastest); without ``ep_size``, the TP groups (experts spread over the TP group).
        ``ep_replicas``: the ranks holding the same experts, which FSDP shards them over."""
        if self.ep == 1:
            return self._replica_groups("tp") if dim == "ep" else [(r,) for r in range(self.world_size)]
        tp, width, places = self.stage_tp_sizes[0], self.ep_data, self.dp * self.sp

        def rank(place: int, t: int) -> int:
            return self.global_rank(0, place % self.sp, t, place // self.sp)

        if dim == "ep":
            return [tuple(rank(first + i, t) for i in range(width) for t in range(tp))
                    for first in range(0, places, width)]  # fmt: skip
        return [tuple(rank(place, t) for place in range(i, places, width)) for i in range(width) for t in range(tp)]

    def _replica_groups(self, dim: str) -> list[tuple[int, ...]]:
        """The groups inside each model replica: ``model`` (all of it), ``tp``, ``sp`` and ``pp``."""
        stages, replicas = range(len(self.stage_tp_sizes)), range(self.dp)
        if dim == "model":
            return [tuple(range(r * self.replica_size, (r + 1) * self.replica_size)) for r in replicas]
        if dim == "tp":
            return [
                tuple(self.global_rank(st, s, t, r) for t in range(self.stage_tp_sizes[st]))
                for r in replicas
                for st in stages
                for s in range(self.sp)
            ]
        if dim == "sp":
            return [
                tuple(self.global_rank(st, s, t, r) for s in range(self.sp))
                for r in replicas
                for st in stages
                for t in range(self.stage_tp_sizes[st])
            ]
        return [  # pp: only the tp positions every stage has
            tuple(self.global_rank(st, s, t, r) for st in stages)
            for r in replicas
            for s in range(self.sp)
            for t in range(min(self.stage_tp_sizes))
        ]

    def _sequence_part_groups(self, dim: str) -> list[tuple[int, ...]]:
        """The sequence group's two parts: ``ulysses`` (adjacent ranks) and ``cp`` (the ring: the ranks
        at one Ulysses index of every Ulysses group)."""
        stages, replicas = range(len(self.stage_tp_sizes)), range(self.dp)
        u, cp = self.ulysses, self.cp
        inner, outer = (range(u), range(cp)) if dim == "ulysses" else (range(cp), range(u))
        index = (lambda a, b: b * u + a) if dim == "ulysses" else (lambda a, b: a * u + b)
        return [
            tuple(self.global_rank(st, index(a, b), t, r) for a in inner)
            for r in replicas
            for st in stages
            for t in range(self.stage_tp_sizes[st])
            for b in outer
        ]

    def _data_parallel_groups(self, dim: str) -> list[tuple[int, ...]]:
        """The groups across replicas: ``dp``, its parts ``dp_shard`` and ``dp_replicate``, and ``fsdp``
        (the ``dp_shard`` replicas times the sequence group)."""
        stages, replicas = range(len(self.stage_tp_sizes)), range(self.dp)
        places = [(st, s, t) for st in stages for s in range(self.sp) for t in range(self.stage_tp_sizes[st])]
        if dim == "dp":
            return [tuple(self.global_rank(*place, r) for r in replicas) for place in places]
        if dim == "dp_shard":
            return [
                tuple(self.global_rank(*place, rep * self.dp_shard + sh) for sh in range(self.dp_shard))
                for rep in range(self.dp_replicate)
                for place in places
            ]
        if dim == "dp_replicate":
            return [
                tuple(self.global_rank(*place, rep * self.dp_shard + sh) for rep in range(self.dp_replicate))
                for sh in range(self.dp_shard)
                for place in places
            ]
        return [  # fsdp
            tuple(self.global_rank(st, s, t, rep * self.dp_shard + sh) for sh in range(self.dp_shard)
                  for s in range(self.sp))
            for rep in range(self.dp_replicate)
            for st in stages
            for t in range(self.stage_tp_sizes[st])
        ]  # fmt: skip


def asked(**sizes) -> str:
    """The sizes a user asked for, as they wrote them (``tp_size=2, sp_size=2``), or ``one rank``."""
    return ", ".join(f"{name}={value}" for name, value in sizes.items() if value not in (None, 1)) or "one rank"
