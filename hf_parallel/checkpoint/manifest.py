"""The per-rank checkpoint format, and reading any slice of a full tensor from it.

A distributed save leaves in its directory one safetensors file per rank, holding that rank's local
tensors under their checkpoint keys (replicated tensors only in rank 0's), and one manifest:

    {"format": "hf_parallel.distributed", "version": 1, "world_size": 4, "save_id": "…",
     "files": ["model-rank-00000-of-00004-<id>.safetensors", …],          # index = rank
     "tensors": {key: {"shape": […], "dtype": "BF16", "ranks": [0, 1, 2, 3],
                       "layout": {"dim": 0, "ranges": [[[0, 64]], …], "kind": "chunks"}}}}

The layout is the loader's own ``Layout``, so a full tensor is rebuilt without a process group,
and any rank of any world size can read just the part it needs (``DistributedSlice``): resharding
is reading the intersection of the box it wants with each saved piece. A tensor saved as pieces no
layout describes (the stored parts of a weight kept quantized: each rank's boxes, the scales of a
block two ranks share overlapping) lists them instead: ``"pieces": [[file index, name, box], ...]``.
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors import SafetensorError, safe_open

from ..core.layout import Layout, as_slices
from ..core.errors import CheckpointError
from .keys import FusedSource
from ..core.tiles import Tile, TiledTensor, disjoint, union_volume
from ..core.dtypes import SAFETENSORS_DTYPES, SAFETENSORS_TO_TORCH

FORMAT, VERSION = "hf_parallel.distributed", 1


def manifest_entry(
    shape, dtype_name: str, layout: Layout, fused: FusedSource | None = None, first_file: int = 0
) -> dict:
    """``fused``: the per-expert keys the parameter was loaded from, which consolidation writes back.
    ``first_file``: the file of the layout's rank 0 (a later pipeline stage's files follow the earlier ones')."""
    ranks = [0] if layout.is_replicated else list(range(layout.world_size))
    entry = {"shape": list(shape), "dtype": dtype_name, "ranks": ranks, "layout": layout.to_json()}
    if first_file:
        entry["first_file"] = first_file
    if fused is not None:
        entry["fused_from"] = {"keys": [list(keys) for keys in fused.keys], "concat_dim": fused.concat_dim}
    return entry


def pieces_entry(shape, dtype_name: str, pieces: list) -> dict:
    """A tensor saved as pieces: (file index, its name in that file, its box in the tensor) each."""
    return {"shape": list(shape), "dtype": dtype_name,
            "pieces": [[file, name, [list(edge) for edge in box]] for file, name, box in pieces]}  # fmt: skip


class DistributedCheckpoint:
    """A directory's manifest and rank files, opened like a safetensors handle (``get_slice``).

    Opening checks every rank file's header against the manifest (names, shapes, dtypes), so a
    missing, stale or mismatched rank file fails here, by name, before any data is read."""

    def __init__(self, manifest_path: str):
        self.path = manifest_path
        root = os.path.dirname(os.path.abspath(manifest_path))
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
            if (manifest.get("format"), manifest.get("version")) != (FORMAT, VERSION):
                raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r}")
            names = [str(name) for name in manifest["files"]]
            self.first_file = {str(key): int(e.get("first_file", 0)) for key, e in manifest["tensors"].items()}
            self.pieces = {
                str(key): [(int(f), str(name), tuple((int(a), int(b)) for a, b in box)) for f, name, box in pieces]
                for key, e in manifest["tensors"].items() if (pieces := e.get("pieces")) is not None
            }  # fmt: skip
            self.tensors = {
                str(key): self._parse(entry, len(names) - self.first_file[str(key)]) if key not in self.pieces
                else (tuple(int(n) for n in entry["shape"]), SAFETENSORS_TO_TORCH[entry["dtype"]], None, [])
                for key, entry in manifest["tensors"].items()
            }  # fmt: skip
            self.fused = {
                str(key): FusedSource(
                    tuple(tuple(map(str, k)) for k in e["fused_from"]["keys"]), e["fused_from"]["concat_dim"]
                )
                for key, e in manifest["tensors"].items()
                if "fused_from" in e
            }
        except (ValueError, KeyError, TypeError, IndexError) as error:
            raise CheckpointError(
                f"{manifest_path}: not an hf_parallel {FORMAT} v{VERSION} manifest ({type(error).__name__}: {error})"
            ) from None
        if any(os.path.basename(name) != name or name in ("", ".", "..") for name in names):
            raise CheckpointError(f"{manifest_path}: file names must be plain names inside the directory: {names}")
        self.files = [os.path.join(root, name) for name in names]
        self._handles: dict[int, object] = {}
        for key, (shape, dtype, layout, ranks) in self.tensors.items():
            for rank in ranks:
                self._check_piece(key, shape, dtype, layout, rank)
            self._check_pieces(key, shape)
            for file, name, box in self.pieces.get(key, ()):
                self._check_saved(file, name, tuple(b - a for a, b in box), dtype, f"it holds {key!r}'s piece {box} as")

    def file_of(self, key: str, rank: int) -> int:
        """The file index of layout rank ``rank`` of ``key``."""
        return self.first_file[key] + rank

    def piece(self, key: str, rank: int):
        """Layout rank ``rank``'s saved piece of ``key`` (a safetensors slice of its file)."""
        return self.handle(self.file_of(key, rank)).get_slice(key)

    def handle(self, rank: int):
        """File ``rank``, opened (memory-mapped) on first use."""
        if rank not in self._handles:
            self._handles[rank] = self._open(self.files[rank])
        return self._handles[rank]

    def release(self) -> None:
        """Drop the mappings: pages read so far stop counting in this process's memory once no
        tensor read from them is alive (consolidation streams the whole checkpoint through)."""
        self._handles.clear()

    @staticmethod
    def _parse(entry: dict, world_size: int):
        """``world_size``: the files from the entry's first one on."""
        shape = tuple(int(n) for n in entry["shape"])
        dtype = SAFETENSORS_TO_TORCH[entry["dtype"]]
        layout = Layout.from_json(entry["layout"])
        ranks = [int(r) for r in entry["ranks"]]
        if not 0 < layout.world_size <= world_size or not ranks or not all(0 <= r < layout.world_size for r in ranks):
            raise ValueError(f"layout of {layout.world_size} ranks / ranks {ranks} for {world_size} files")
        if not layout.is_replicated:
            reach = 0
            for start, stop in sorted(piece for pieces in layout.ranges for piece in pieces):
                reach = max(reach, stop) if start <= reach else -1
            if reach != shape[layout.dim]:  # a gap, or ranges past the end
                raise ValueError(f"layout ranges do not cover dim {layout.dim} of shape {shape} exactly")
        return shape, dtype, layout, ranks

    @staticmethod
    def _open(file: str):
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: listed in the manifest, but missing (an incomplete copy or save?)")
        try:
            return safe_open(file, framework="pt")
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file}: not a valid safetensors file: {error}") from None

    def _check_pieces(self, key: str, shape) -> None:
        """A tensor saved as pieces: each in a listed file, a box inside the tensor, together covering it."""
        pieces = self.pieces.get(key, [])
        for file, name, box in pieces:
            inside = len(box) == len(shape) and all(0 <= a < b <= n for (a, b), n in zip(box, shape))
            if not 0 <= file < len(self.files) or not inside:
                raise CheckpointError(f"{self.path}: {key!r}'s piece {name!r} ({box} in file {file}) is not inside "
                                      f"the tensor {shape} or a listed file")  # fmt: skip
        if key in self.pieces and union_volume([box for _, _, box in pieces]) != math.prod(shape):
            raise CheckpointError(f"{self.path}: {key!r}'s pieces do not cover the tensor {shape}")

    def _check_piece(self, key, shape, dtype, layout, rank) -> None:
        want = layout.local_shape(shape, rank)
        self._check_saved(self.file_of(key, rank), key, want, dtype, f"rank {rank} holds")

    def _check_saved(self, index: int, name: str, want, dtype, what: str) -> None:
        file, handle = self.files[index], self.handle(index)
        if name not in handle.keys():
            raise CheckpointError(f"{file}: the manifest says it holds {name!r}, but it does not")
        found = handle.get_slice(name)
        if tuple(found.get_shape()) != tuple(want) or found.get_dtype() != SAFETENSORS_DTYPES[dtype]:
            raise CheckpointError(
                f"{file}: {name!r} is {found.get_dtype()} {tuple(found.get_shape())}, but the manifest says "
                f"{what} {SAFETENSORS_DTYPES[dtype]} {tuple(want)}"
            )

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, key: str) -> TiledTensor:
        if key in self.pieces:  # overlapping pieces made disjoint; each read from its file
            shape, dtype, _, _ = self.tensors[key]
            tiles = [Tile(box, self._piece_reader(file, name)) for file, name, box in self.pieces[key]]
            return TiledTensor(f"{self.path}: {key!r}", shape, dtype, disjoint(tiles))
        return DistributedSlice(self, key)

    def _piece_reader(self, file: int, name: str):
        return lambda box: self.handle(file).get_slice(name)[as_slices(box)]


class DistributedSlice(TiledTensor):
    """One full tensor of a distributed checkpoint: a tile per distinct saved piece."""

    def __init__(self, checkpoint: DistributedCheckpoint, key: str):
        shape, dtype, self.layout, self.ranks = checkpoint.tensors[key]
        self.checkpoint, self.key = checkpoint, key
        super().__init__(f"{checkpoint.path}: {key!r}", shape, dtype, list(self._tiles(shape)))

    def _tiles(self, shape):
        dim, seen = self.layout.dim, set()
        if dim is None:
            yield Tile(tuple((0, n) for n in shape), self._reader(0, None, 0))
            return
        for rank in self.ranks:
            offset = 0
            for start, stop in self.layout.ranges[rank]:
                if (start, stop) not in seen:  # a replicated piece (KV head) is read from one rank
                    seen.add((start, stop))
                    box = tuple((start, stop) if d == dim else (0, n) for d, n in enumerate(shape))
                    yield Tile(box, self._reader(rank, dim, offset))
                offset += stop - start

    def _reader(self, rank: int, dim: int | None, offset: int):
        """Reads a box of the tile from the rank's local tensor, whose ``dim`` starts at ``offset``."""

        def read(box):
            local = tuple((a + offset, b + offset) if d == dim else (a, b) for d, (a, b) in enumerate(box))
            return self.checkpoint.piece(self.key, rank)[as_slices(local)]

        return read

    def saved_as(self, layout: Layout, rank: int) -> torch.Tensor | None:
        """``rank``'s own saved tensor (a view of its file), when it was saved with this very layout."""
        if layout == self.layout and rank in self.ranks and not layout.is_replicated:
            return self.checkpoint.piece(self.key, rank)[:]
        return None
