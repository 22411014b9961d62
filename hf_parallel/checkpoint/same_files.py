"""Every rank reads the same checkpoint: a rank that sees other files (a stale copy on a node, another
path) would silently assemble a model from two. Their headers are compared before any weight is read."""

from __future__ import annotations

import hashlib
import os

import torch.distributed as dist

from ..core.errors import CheckpointError
from ..distributed.faults import collective


def _header_digest(file: str) -> str:
    """What every rank must agree on about one file: its size and its header (names, dtypes, shapes,
    offsets) hashed; the first MiB of a pickle or config. Cheap: tensor data is not read."""
    digest = hashlib.sha256(str(os.path.getsize(file)).encode())
    with open(file, "rb") as f:
        if file.endswith(".safetensors"):  # already validated: the length prefix is sane
            digest.update(f.read(int.from_bytes(f.read(8), "little")))
        else:
            digest.update(f.read(1 << 20))
    return digest.hexdigest()


def check_same_checkpoint(path: str, files: dict[str, str], mesh) -> None:
    """Every rank must read the same checkpoint; one that sees other files (a stale copy on a
    node, another path) would silently assemble a model from two. Compares hashed headers."""
    if mesh.world.group is None:
        return
    config = os.path.join(path, "config.json")
    mine = {os.path.basename(f): _header_digest(f) for f in sorted(set(files.values()) | {config}) if os.path.isfile(f)}
    everyone = [None] * mesh.world_size
    with collective(f"{path}: comparing checkpoint headers across ranks (rank {mesh.rank})"):
        dist.all_gather_object(everyone, mine, group=mesh.world.group)
    for rank, theirs in enumerate(everyone[1:], start=1):
        differ = sorted(name for name in set(theirs) | set(everyone[0]) if theirs.get(name) != everyone[0].get(name))
        if differ:
            raise CheckpointError(
                f"{path}: rank {rank} sees a different checkpoint than rank 0 (files whose header or size differ, "
                f"or that only one of them has: {', '.join(differ)}); every rank must load the same files"
            )
