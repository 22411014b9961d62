"""Layouts: how one full tensor maps onto per-rank shards along one dim.

A layout is pure data (no torch.distributed). Loading reads ``pieces(rank)`` through safetensors
``get_slice``; saving inverts it with ``assemble``. Because both sides use the same object,
load-then-save is the identity by construction (property-tested in tests/test_layout.py).

Every layout is a list, per rank, of half-open ranges along ``dim`` that the rank holds, in the
order they appear in its local tensor. The named constructors below cover the shapes we need:

- ``chunks(sizes)``               contiguous pieces: colwise / rowwise / vocab / experts
- ``packed(blocks, sizes)``       k blocks (gate|up, q|k|v); each rank takes its piece of every block
- ``replicated()``                every rank holds the whole tensor (``dim is None``)

Ranges of different ranks may overlap (KV heads replicated over ranks); the copies are equal, so
``assemble`` may write each of them.
"""

from __future__ import annotations

from dataclasses import dataclass

Range = tuple[int, int]


@dataclass(frozen=True)
class Layout:
    """Per-rank ranges of a tensor along ``dim`` (``dim=None``: replicated on every rank)."""

    dim: int | None
    ranges: tuple[tuple[Range, ...], ...]  # ranges[rank] -> ranges held by that rank, in local order
    kind: str = "chunks"

    @property
    def world_size(self) -> int:
        return len(self.ranges)

    @property
    def is_replicated(self) -> bool:
        return self.dim is None

    def replica_counts(self, rank: int) -> list[int]:
        """For each of ``rank``'s pieces, how many ranks hold that same piece (replicated KV heads)."""
        held = [piece for pieces in self.ranges for piece in pieces]
        return [held.count(piece) for piece in self.ranges[rank]]

    def local_size(self, rank: int) -> int:
        return sum(stop - start for start, stop in self.ranges[rank])

    def local_shape(self, full_shape, rank: int) -> tuple[int, ...]:
        shape = list(full_shape)
        if self.dim is not None:
            self._check_fits(full_shape)
            shape[self.dim] = self.local_size(rank)
        return tuple(shape)

    def index(self, full_shape, rank: int) -> list[tuple[slice, ...]]:
        """The slices to read from the full tensor for ``rank``; concatenated along ``dim`` in order."""
        if self.dim is None:
            return [tuple(slice(None) for _ in full_shape)]
        self._check_fits(full_shape)
        lead = tuple(slice(None) for _ in range(self.dim))
        return [lead + (slice(start, stop),) for start, stop in self.ranges[rank]]

    def tiles_in_rank_order(self, full_shape) -> bool:
        """Whether the full tensor's bytes are simply rank 0's shard, then rank 1's, ... (one range
        per rank along the outermost dim, back to back: vocab-parallel embeddings, colwise weights),
        so a saver can write the shards one after another without assembling the full tensor."""
        if self.dim != 0 or any(len(pieces) != 1 for pieces in self.ranges):
            return False
        stops = [0] + [pieces[0][1] for pieces in self.ranges]
        return all(pieces[0][0] == stop for pieces, stop in zip(self.ranges, stops)) and stops[-1] == full_shape[0]

    def assemble(self, shards, full_shape):
        """Rebuild the full tensor from every rank's local shard (the inverse of ``index``).
        ``shards`` may be a generator: each shard is placed, then can be freed before the next."""
        import torch

        shards = iter(shards)
        if self.dim is None:
            return next(shards)
        self._check_fits(full_shape)
        full = None
        filled = torch.zeros(full_shape[self.dim], dtype=torch.bool)
        for rank, shard in enumerate(shards):
            if full is None:
                full = torch.empty(tuple(full_shape), dtype=shard.dtype, device=shard.device)
            offset = 0
            for start, stop in self.ranges[rank]:
                full.narrow(self.dim, start, stop - start).copy_(shard.narrow(self.dim, offset, stop - start))
                filled[start:stop] = True
                offset += stop - start
        if not bool(filled.all()):
            raise RuntimeError(f"layout {self} leaves part of dim {self.dim} of {tuple(full_shape)} unassigned")
        return full

    def _check_fits(self, full_shape) -> None:
        if self.dim >= len(full_shape):
            raise ValueError(f"layout splits dim {self.dim} but the tensor has shape {tuple(full_shape)}")
        end = max((stop for rank in self.ranges for _, stop in rank), default=0)
        if end > full_shape[self.dim]:
            raise ValueError(
                f"layout reaches index {end} along dim {self.dim}, but the tensor has shape {tuple(full_shape)}"
            )

    def to_json(self) -> dict:
        return {
            "dim": self.dim,
            "ranges": [[list(piece) for piece in pieces] for pieces in self.ranges],
            "kind": self.kind,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Layout":
        ranges = tuple(tuple((int(start), int(stop)) for start, stop in pieces) for pieces in data["ranges"])
        return cls(None if data["dim"] is None else int(data["dim"]), ranges, str(data["kind"]))

    def describe(self) -> str:
        if self.dim is None:
            return "replicated"
        sizes = ",".join(str(self.local_size(r)) for r in range(self.world_size))
        return f"{self.kind}(dim={self.dim}, sizes=[{sizes}])"


def even_sizes(total: int, world_size: int) -> list[int]:
    """Split ``total`` as evenly as possible; the first ``total % world_size`` ranks get one more."""
    return [total // world_size + (rank < total % world_size) for rank in range(world_size)]


def sizes_to_ranges(sizes, unit: int = 1) -> list[Range]:
    """[(start, stop)] per rank for contiguous pieces of ``sizes[rank] * unit`` elements."""
    starts = [sum(sizes[:rank]) for rank in range(len(sizes))]
    return [(start * unit, (start + size) * unit) for start, size in zip(starts, sizes)]


def chunks(dim: int, sizes, unit: int = 1) -> Layout:
    """Contiguous pieces of ``sizes[rank] * unit`` elements, rank after rank."""
    return Layout(dim, tuple((piece,) for piece in sizes_to_ranges(sizes, unit)), "chunks")


def per_rank(dim: int, ranges, kind: str = "chunks") -> Layout:
    """One explicit (start, stop) per rank; ranges may overlap (replicated KV heads)."""
    return Layout(dim, tuple((piece,) for piece in ranges), kind)


def packed(dim: int, blocks, block_ranges) -> Layout:
    """``len(blocks)`` consecutive blocks of the given lengths; ``block_ranges[b][rank]`` is the
    (start, stop) that rank holds inside block ``b``. The local tensor is the rank's pieces in
    block order, so model code that splits a packed output (``gate, up = x.chunk(2)``) still works."""
    offsets = [sum(blocks[:b]) for b in range(len(blocks))]
    world_size = len(block_ranges[0])
    ranges = tuple(
        tuple(
            (offset + per_rank[rank][0], offset + per_rank[rank][1]) for offset, per_rank in zip(offsets, block_ranges)
        )
        for rank in range(world_size)
    )
    return Layout(dim, ranges, "packed")


def replicated(world_size: int) -> Layout:
    return Layout(None, tuple(() for _ in range(world_size)), "replicated")
