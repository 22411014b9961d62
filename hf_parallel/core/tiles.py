"""A full tensor that exists on disk only as tiles (per-rank files of a distributed save, per-expert
keys of a fused MoE parameter), read like a safetensors slice: any box of it, touching only the
tiles it overlaps, and only their overlapping part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .layout import Box, box_shape
from .errors import CheckpointError


@dataclass(frozen=True)
class Tile:
    box: Box  # where the tile sits in the full tensor
    read: Callable[[Box], torch.Tensor]  # a sub-box, in the tile's own coordinates (same number of dims)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(start < stop for start, stop in out) else None


def subtract(a: Box, b: Box) -> list[Box]:
    """``a`` less ``b``, as disjoint boxes (none when ``b`` covers ``a``)."""
    inside = intersect(a, b)
    if inside is None:
        return [a]
    out, rest = [], list(a)
    for dim, ((a0, a1), (i0, i1)) in enumerate(zip(a, inside)):
        sides = [part for part in ((a0, i0), (i1, a1)) if part[0] < part[1]]  # before and after b along dim
        out += [tuple(rest[:dim]) + (part,) + tuple(rest[dim + 1 :]) for part in sides]
        rest[dim] = (i0, i1)
    return out


def _uncovered(box: Box, earlier: list[Box]) -> list[Box]:
    """What of ``box`` none of ``earlier`` covers, as disjoint boxes."""
    parts = [box]
    for other in earlier:
        parts = [rest for part in parts for rest in subtract(part, other)]
    return parts


def union_volume(boxes: list[Box]) -> int:
    """Elements of the union of boxes that may overlap."""
    covered: list[Box] = []
    for box in boxes:
        covered += _uncovered(box, covered)
    return sum(_volume(box) for box in covered)


def disjoint(tiles: list[Tile]) -> list[Tile]:
    """Tiles that may overlap (pieces two ranks both hold, equal where they overlap) as disjoint ones
    covering the same union: each later tile keeps only what the earlier ones do not cover."""
    out: list[Tile] = []
    for tile in tiles:
        for part in _uncovered(tile.box, [earlier.box for earlier in out]):
            origin = _relative(part, tile.box)
            out.append(Tile(part, lambda box, read=tile.read, origin=origin: read(_shift(box, origin))))
    return out


def _shift(box: Box, origin: Box) -> Box:
    return tuple((start + o, stop + o) for (start, stop), (o, _) in zip(box, origin))


class TiledTensor:
    """``tiles`` must not overlap (drop identical replicas before) and must cover ``shape``."""

    def __init__(self, name: str, shape, dtype: torch.dtype, tiles: list[Tile]):
        self.name, self.shape, self.dtype, self.tiles = name, tuple(shape), dtype, tiles

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> torch.dtype:
        return self.dtype

    def __getitem__(self, index) -> torch.Tensor:
        """``index``: step-1 slices (missing trailing dims mean whole)."""
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(self.shape) - len(index))
        return self.read(tuple(s.indices(n)[:2] for s, n in zip(index, self.shape)))

    def read(self, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """One tile holding the whole box gives its read as is (a view of the file when the reader
        allows); else the tiles' parts are placed into ``out`` (a new tensor if None)."""
        parts = [(tile, intersect(tile.box, box)) for tile in self.tiles]
        parts = [(tile, part) for tile, part in parts if part is not None]
        for tile, part in parts:
            if part == box:
                return tile.read(_relative(box, tile.box))
        if out is None:
            out = torch.empty(box_shape(box), dtype=self.dtype)
        for tile, part in parts:
            target = out[tuple(slice(p0 - b0, p1 - b0) for (p0, p1), (b0, _) in zip(part, box))]
            target.copy_(tile.read(_relative(part, tile.box)))
        if sum(_volume(part) for _, part in parts) != _volume(box):
            raise CheckpointError(f"{self.name}: its saved pieces do not tile the box {box} exactly")
        return out


def _relative(box: Box, origin: Box) -> Box:
    return tuple((start - o, stop - o) for (start, stop), (o, _) in zip(box, origin))


def _volume(box: Box) -> int:
    return math.prod(box_shape(box))
