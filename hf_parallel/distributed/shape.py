"""The shape of a mesh: its sizes, which global ranks each group holds, and its text. Pure data
(no torch, no processes), so the CLI, the dry run and the mesh itself share one owner of these facts.

The world is ``pp x sp x tp``: the ranks of one TP group are adjacent, TP groups sit inside SP
groups, and each pipeline stage is a contiguous run of ranks. With a TP size per stage
(``stage_tp_sizes``: variable tensor parallelism) stage i holds ``sp * stage_tp_sizes[i]`` ranks
and the world is their sum.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshShape:
    """The sizes of a mesh and which global ranks each of its groups holds (no processes needed)."""

    stage_tp_sizes: tuple[int, ...]
    sp: int = 1

    @classmethod
    def of(cls, world_size: int | None, tp_size=None, sp_size=1, pp_size=1, stage_tp_sizes=None) -> MeshShape:
        """The shape the user asked for, checked against ``world_size``; ``tp_size=None`` takes
        whatever the other dimensions leave of the world (``world_size=None``: no world to fill,
        ``tp_size=None`` counts as 1)."""
        for name, value in (("tp_size", tp_size), ("sp_size", sp_size), ("pp_size", pp_size)):
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
                if world_size % (sp_size * pp_size):
                    raise ValueError(
                        f"world size {world_size} is not a multiple of pp_size x sp_size = {pp_size} x {sp_size}"
                    )
                tp_size = world_size // (sp_size * pp_size)
            stages = (tp_size,) * pp_size
        shape = cls(stages, sp_size)
        if world_size is not None and shape.world_size != world_size:
            needs = (
                f"sp_size x sum(stage_tp_sizes) = {sp_size} x {sum(stages)}"
                if stage_tp_sizes is not None
                else f"pp_size x sp_size x tp_size = {pp_size} x {sp_size} x {stages[0]}"
            )
            raise ValueError(
                f"{asked(tp_size=tp_size, sp_size=sp_size, pp_size=pp_size, stage_tp_sizes=stage_tp_sizes)} was "
                f"asked for, but the process group has world size {world_size} (the mesh needs {needs} = "
                f"{shape.world_size} ranks)"
            )
        return shape

    @classmethod
    def requested(cls, tp_size=None, sp_size=1, pp_size=1, stage_tp_sizes=None) -> MeshShape:
        """The shape these sizes ask for, before any process exists (``tp_size=None`` counts as 1)."""
        return cls.of(None, tp_size=tp_size, sp_size=sp_size, pp_size=pp_size, stage_tp_sizes=stage_tp_sizes)

    @property
    def world_size(self) -> int:
        return self.sp * sum(self.stage_tp_sizes)

    @property
    def num_stages(self) -> int:
        return len(self.stage_tp_sizes)

    def __str__(self) -> str:
        """``tp=2 x sp=2``, or ``pp=2 (tp per stage [2, 1])``: the layout, as every message names it."""
        stages = self.stage_tp_sizes
        text = f"tp={stages[0]}" if len(stages) == 1 else f"pp={len(stages)} (tp per stage {list(stages)})"
        return text + (f" x sp={self.sp}" if self.sp > 1 else "")

    def _first(self, stage: int) -> int:
        return self.sp * sum(self.stage_tp_sizes[:stage])

    def global_rank(self, stage: int, sp: int, tp: int) -> int:
        return self._first(stage) + sp * self.stage_tp_sizes[stage] + tp

    def position(self, rank: int) -> tuple[int, int, int]:
        """(stage, sp index, tp index) of a global rank."""
        for stage, tp in enumerate(self.stage_tp_sizes):
            offset = rank - self._first(stage)
            if offset < self.sp * tp:
                return stage, offset // tp, offset % tp
        raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        return tuple(range(self._first(stage), self._first(stage + 1)))

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every group of ``dim``, in the order every rank creates them. ``pp`` joins the ranks at
        the same (sp, tp) position of every stage; under variable TP only the positions every stage
        has (tp index below the smallest stage's TP size), and a rank past them pipes through no group."""
        stages = range(len(self.stage_tp_sizes))
        if dim == "world":
            return [tuple(range(self.world_size))]
        if dim == "tp":
            return [
                tuple(self.global_rank(st, s, t) for t in range(self.stage_tp_sizes[st]))
                for st in stages
                for s in range(self.sp)
            ]
        if dim == "sp":
            return [
                tuple(self.global_rank(st, s, t) for s in range(self.sp))
                for st in stages
                for t in range(self.stage_tp_sizes[st])
            ]
        if dim == "pp":
            return [
                tuple(self.global_rank(st, s, t) for st in stages)
                for s in range(self.sp)
                for t in range(min(self.stage_tp_sizes))
            ]
        raise ValueError(f"unknown mesh dimension {dim!r}; the mesh has world, pp, tp, sp and ep")


def asked(**sizes) -> str:
    """The sizes a user asked for, as they wrote them (``tp_size=2, sp_size=2``), or ``one rank``."""
    return ", ".join(f"{name}={value}" for name, value in sizes.items() if value not in (None, 1)) or "one rank"
