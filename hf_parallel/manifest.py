"""The per-rank checkpoint format, and reading any slice of a full tensor from it.

A distributed save leaves in its directory one safetensors file per rank, holding that rank's local
tensors under their checkpoint keys (replicated tensors only in rank 0's), and one manifest:

    {"format": "hf_parallel.distributed", "version": 1, "world_size": 4, "save_id": "…",
     "files": ["model-rank-00000-of-00004-<id>.safetensors", …],          # index = rank
     "tensors": {key: {"shape": […], "dtype": "BF16", "ranks": [0, 1, 2, 3],
                       "layout": {"dim": 0, "ranges": [[[0, 64]], …], "kind": "chunks"}}}}

The layout is the loader's own ``Layout``, so a full tensor is rebuilt without a process group,
and any rank of any world size can read just the part it needs (``DistributedSlice``): resharding
is reading the intersection of the box it wants with each saved piece.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError
from .layout import Layout
from .writer import SAFETENSORS_TO_TORCH

MANIFEST_FILE = "hf_parallel_manifest.json"
FORMAT, VERSION = "hf_parallel.distributed", 1


def rank_file_name(rank: int, world_size: int, save_id: str) -> str:
    """The save id keeps a new save from overwriting files an older manifest still points to."""
    return f"model-rank-{rank:05d}-of-{world_size:05d}-{save_id}.safetensors"


def manifest_entry(shape, dtype_name: str, layout: Layout) -> dict:
    ranks = [0] if layout.is_replicated else list(range(layout.world_size))
    return {"shape": list(shape), "dtype": dtype_name, "ranks": ranks, "layout": layout.to_json()}


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
            self.tensors = {str(key): self._parse(entry, len(names)) for key, entry in manifest["tensors"].items()}
        except (ValueError, KeyError, TypeError, IndexError) as error:
            raise CheckpointError(
                f"{manifest_path}: not an hf_parallel {FORMAT} v{VERSION} manifest ({type(error).__name__}: {error})"
            ) from None
        if any(os.path.basename(name) != name or name in ("", ".", "..") for name in names):
            raise CheckpointError(f"{manifest_path}: file names must be plain names inside the directory: {names}")
        self.files = [os.path.join(root, name) for name in names]
        self.handles = [self._open(file) for file in self.files]
        for key, (shape, dtype, layout, ranks) in self.tensors.items():
            for rank in ranks:
                self._check_piece(key, shape, dtype, layout, rank)

    @staticmethod
    def _parse(entry: dict, world_size: int):
        shape = tuple(int(n) for n in entry["shape"])
        dtype = SAFETENSORS_TO_TORCH[entry["dtype"]]
        layout = Layout.from_json(entry["layout"])
        ranks = [int(r) for r in entry["ranks"]]
        if layout.world_size != world_size or not ranks or not all(0 <= r < world_size for r in ranks):
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

    def _check_piece(self, key, shape, dtype, layout, rank) -> None:
        file, handle = self.files[rank], self.handles[rank]
        if key not in handle.keys():
            raise CheckpointError(f"{file}: the manifest says it holds {key!r}, but it does not")
        found = handle.get_slice(key)
        want = layout.local_shape(shape, rank)
        if tuple(found.get_shape()) != want or found.get_dtype() != self._dtype_name(dtype):
            raise CheckpointError(
                f"{file}: {key!r} is {found.get_dtype()} {tuple(found.get_shape())}, but the manifest says "
                f"rank {rank} holds {self._dtype_name(dtype)} {want}"
            )

    @staticmethod
    def _dtype_name(dtype: torch.dtype) -> str:
        return next(name for name, d in SAFETENSORS_TO_TORCH.items() if d == dtype)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, key: str) -> "DistributedSlice":
        return DistributedSlice(self, key)


class DistributedSlice:
    """One full tensor of a distributed checkpoint; indexing reads only the saved pieces it overlaps."""

    def __init__(self, checkpoint: DistributedCheckpoint, key: str):
        self.checkpoint, self.key = checkpoint, key
        self.shape, self.dtype, self.layout, self.ranks = checkpoint.tensors[key]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> torch.dtype:
        return self.dtype

    def saved_as(self, layout: Layout, rank: int) -> torch.Tensor | None:
        """``rank``'s own saved tensor (a view of its file), when it was saved with this very layout."""
        if layout == self.layout and rank in self.ranks and not layout.is_replicated:
            return self.checkpoint.handles[rank].get_slice(self.key)[:]
        return None

    def _pieces(self):
        """(rank, start, stop, offset in the rank's local tensor) along the saved dim, each range once."""
        seen = set()
        for rank in self.ranks:
            offset = 0
            for start, stop in self.layout.ranges[rank]:
                if (start, stop) not in seen:
                    seen.add((start, stop))
                    yield rank, start, stop, offset
                offset += stop - start

    def __getitem__(self, index) -> torch.Tensor:
        """``index``: a tuple of step-1 slices (missing trailing dims mean whole)."""
        index = index if isinstance(index, tuple) else (index,)
        box = [s.indices(n)[:2] for s, n in zip(index + (slice(None),) * (len(self.shape) - len(index)), self.shape)]
        dim = self.layout.dim
        if dim is None:
            return self._read(0, box)
        want_start, want_stop = box[dim]
        overlapping = [p for p in self._pieces() if p[1] < want_stop and want_start < p[2]]
        whole = next((p for p in overlapping if p[1] <= want_start and want_stop <= p[2]), None)
        if whole is not None:  # one rank's file holds all of it (same world size): a view, no copy
            return self._read(whole[0], self._local(box, dim, whole))
        out = torch.empty([stop - start for start, stop in box], dtype=self.dtype)
        covered = torch.zeros(want_stop - want_start, dtype=torch.bool)
        for piece in overlapping:
            start, stop = max(piece[1], want_start), min(piece[2], want_stop)
            part = [*box[:dim], (start, stop), *box[dim + 1 :]]
            out.narrow(dim, start - want_start, stop - start).copy_(self._read(piece[0], self._local(part, dim, piece)))
            covered[start - want_start : stop - want_start] = True
        if not bool(covered.all()):
            raise CheckpointError(
                f"{self.checkpoint.path}: the saved pieces of {self.key!r} do not cover [{want_start}, {want_stop}) "
                f"of dim {dim}"
            )
        return out

    @staticmethod
    def _local(box, dim: int, piece) -> list:
        """``box`` (full-tensor coordinates) in the coordinates of the rank's local tensor."""
        _, start, _, offset = piece
        return [*box[:dim], (box[dim][0] - start + offset, box[dim][1] - start + offset), *box[dim + 1 :]]

    def _read(self, rank: int, box) -> torch.Tensor:
        return self.checkpoint.handles[rank].get_slice(self.key)[tuple(slice(a, b) for a, b in box)]
