"""What a rank holds, measured and predicted: the figures a layout is chosen by at 70B.

``held_bytes`` measures what a device would hold of some tensors (a DTensor's local shard, a plain
tensor whole, a meta tensor nothing; on the CPU a loaded slice may be a lazy view of the mapped
file, so the process's RSS would not say it). ``Footprint`` predicts, from the layout alone (before
any weight is read, as ``hf-parallel plan`` prints it), a rank's share of the weights and the
largest tensor it reads whole at the load: what a load straight into FSDP's shards holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .core.dtypes import nbytes


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes a device holds of ``tensors``, each counted once: a DTensor's local shard, a plain tensor
    whole, a meta tensor nothing."""
    total, seen = 0, set()
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not local.is_meta:
            total += local.numel() * local.element_size()
    return total


@dataclass(frozen=True)
class Footprint:
    """One rank's parameter bytes, from its layout: ``share`` (its FSDP rows of its TP shard of every
    parameter) and ``largest_slice`` (the largest TP slice of one tensor, which the load reads whole
    before keeping its rows)."""

    share: int
    largest_slice: int

    @property
    def load_peak(self) -> int:
        return self.share + self.largest_slice


def footprint(layout, dtype: torch.dtype) -> Footprint:
    """``layout``'s (a ``ModelLayout``) parameters on its mesh's rank, in ``dtype``."""
    mesh = layout.mesh
    share = largest = 0
    for entry in layout.unique_params():
        shape = tuple(entry.layout.local_shape(entry.full_shape, mesh.tp.rank))
        largest = max(largest, nbytes(shape, dtype))
        if mesh.shape.dp > 1 and shape:
            shape = (_chunk(shape[0], mesh.fsdp.rank, mesh.fsdp.size), *shape[1:])
        share += nbytes(shape, dtype)
    return Footprint(share, largest)


def _chunk(rows: int, index: int, size: int) -> int:
    """The rows ``torch.chunk`` gives chunk ``index`` of ``size`` (FSDP2's dim-0 split): the last ones may be
    short or empty."""
    chunk = -(-rows // size)
    return max(0, min(rows, (index + 1) * chunk) - index * chunk)
