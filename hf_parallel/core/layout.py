"""Layouts: how one full tensor maps onto per-rank shards along one dim.

A layout is pure data (no torch.distributed). A rank's local tensor comes out of the full one with
``extract`` (the loader, through safetensors ``get_slice``); the full tensor, or any box of it, goes
back together from the ranks' local tensors with ``place`` / ``assemble`` (the save, block by block). Because both directions come from the same ranges,
load-then-save is the identity by construction (property-tested in tests/test_layout.py).

Every layout is a list, per rank, of half-open ranges along ``dim`` that the rank holds, in the
order they appear in its local tensor. The named constructors below cover the shapes we need:

- ``chunks(sizes)``               contiguous pieces: colwise / rowwise / vocab / experts
- ``packed(blocks, sizes)``       k blocks (gate|up, q|k|v); each rank takes its piece of every block
- ``replicated()``                every rank holds the whole tensor (``dim is None``)

Ranges of different ranks may overlap (KV heads replicated over ranks); the copies are equal, so
``holders`` takes each from the lowest rank that has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Range = tuple[int, int]
Box = tuple[Range, ...]  # (start, stop) per dim of the full tensor


@dataclass(frozen=True)
class Layout:
    """Per-rank ranges of a tensor along ``dim`` (``dim=None``: replicated on every rank)."""

    dim: int | None
    ranges: tuple[tuple[Range, ...], ...]  # ranges[rank] -> ranges held by that rank, in local order
    kind: str = "chunks"
    over: str = "tp"  # the mesh dimension whose ranks ``ranges`` lists: "tp", or "ep" (experts exchanging tokens)

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

    def extract(self, full, rank: int, *, shape=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``rank``'s local tensor from ``full``: a tensor, or anything the slices of ``index`` read
        (a safetensors slice, whose ``shape`` is then given). Its pieces are copied into ``out``
        (casting if ``out`` has another dtype); without ``out`` a single piece comes as it is read
        (a view), several are concatenated."""
        pieces = [full[index] for index in self.index(tuple(full.shape) if shape is None else shape, rank)]
        if out is None:
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)
        if len(pieces) == 1:
            return out.copy_(pieces[0])
        offset = 0
        for piece in pieces:
            out.narrow(self.dim, offset, piece.shape[self.dim]).copy_(piece)
            offset += piece.shape[self.dim]
        return out

    def place(self, out: torch.Tensor | None, box: Box, fill: Callable[[int, torch.Tensor | None, Box], None]):
        """Fill ``out``, the ``box`` of the full tensor, run by run from the lowest rank holding each
        (``holders``): ``fill(rank, target, local_box)`` writes into ``target`` (a view of ``out``)
        the ``local_box`` of that rank's local tensor. The inverse of ``extract``; what gathers
        with communication (the save) sends and receives inside ``fill``, where a rank that only
        sends has no ``out`` (its targets are None)."""
        if self.dim is None:
            fill(0, out, box)
            return out
        dim, (box_start, box_stop) = self.dim, box[self.dim]
        for rank, start, stop, local_start in self.holders(box_start, box_stop):
            local_box = box[:dim] + ((local_start, local_start + stop - start),) + box[dim + 1 :]
            fill(rank, None if out is None else out.narrow(dim, start - box_start, stop - start), local_box)
        return out

    def assemble(
        self, out: torch.Tensor, local_of: Callable[[int], torch.Tensor], box: Box | None = None
    ) -> torch.Tensor:
        """``out`` filled with the ``box`` of the full tensor (all of it by default) from the ranks'
        local tensors, ``local_of(rank)``."""
        box = tuple((0, n) for n in out.shape) if box is None else box

        def copy(rank, target, local_box):
            target.copy_(local_of(rank)[as_slices(local_box)])

        return self.place(out, box, copy)

    def holders(self, start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """Who supplies ``[start, stop)`` along ``dim``: ``(rank, full_start, full_stop, local_start)``
        runs in order, each from the lowest rank holding where it starts (a replicated KV head is
        sent once). Lets a saver fetch any block of the full tensor without assembling the rest."""
        pieces = []  # (lowest rank first) rank, full start, full stop, where it sits in the local tensor
        for rank, ranges in enumerate(self.ranges):
            offset = 0
            for piece_start, piece_stop in ranges:
                pieces.append((rank, piece_start, piece_stop, offset))
                offset += piece_stop - piece_start
        return supplying_runs(pieces, start, stop, f"layout {self} along dim {self.dim}")

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
            **({"over": self.over} if self.over != "tp" else {}),  # (files written before it: "tp")
        }

    @classmethod
    def from_json(cls, data: dict) -> "Layout":
        ranges = tuple(tuple((int(start), int(stop)) for start, stop in pieces) for pieces in data["ranges"])
        dim = None if data["dim"] is None else int(data["dim"])
        return cls(dim, ranges, str(data["kind"]), str(data.get("over", "tp")))

    def describe(self) -> str:
        if self.dim is None:
            return "replicated"
        sizes = ",".join(str(self.local_size(r)) for r in range(self.world_size))
        return f"{self.kind}(dim={self.dim}, sizes=[{sizes}])"


def as_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


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


def supplying_runs(pieces: list[tuple[int, int, int, int]], start: int, stop: int, what: str) -> list:
    """Who supplies ``[start, stop)`` of a split dim, given every holder's ``pieces`` ``(rank, full start, full
    stop, local start)`` in order of preference: runs ``(rank, start, stop, local start)``, each from the first
    piece holding where it starts. ``what`` names the tensor when an index has no holder."""
    runs, at = [], start
    while at < stop:
        held = next((piece for piece in pieces if piece[1] <= at < piece[2]), None)
        if held is None:
            raise RuntimeError(f"{what}: nobody holds index {at}")
        rank, piece_start, piece_stop, local = held
        end = min(piece_stop, stop)
        runs.append((rank, at, end, local + at - piece_start))
        at = end
    return runs
