"""Weights held quantized on each rank (``from_pretrained(..., keep_quantized=True)``): a rank keeps its
slice of each quantized weight as the checkpoint stores it (FP8 and its block scales, packed integers,
MXFP4) and dequantizes it module by module in the forward, so at rest it holds about the quantized bytes
(FP8: half of bf16) and, in a forward, one module's weight in the compute dtype besides.

Between calls the parameter's slot holds a placeholder on the meta device (its local shape and dtype, so
shape checks and the plan see the weight); the module's forward pre-hook puts the dequantized weight there
and its forward hook puts the placeholder back. Anything reading the weight outside its module's call
gets the placeholder and fails loudly, never a stale or wrong value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.quantized import Dequantized, Kept, box_of
from ..checkpoint.writer import torch_dtype
from ..distributed.faults import collective


@dataclass
class KeptWeight:
    """One parameter's local shard as stored: a ``Kept`` box per run of its layout, concatenated along
    the layout's dim once dequantized. ``stored``: each part of its checkpoint key (suffix -> full shape,
    dtype) and ``constants`` the parts kept whole, to save it back as it was."""

    key: str
    pieces: list[Kept]
    dim: int | None
    dtype: torch.dtype
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]]
    constants: dict[str, torch.Tensor]

    @classmethod
    def read(cls, key: str, source: Dequantized, layout, rank: int, dtype, device) -> "KeptWeight":
        index = layout.index(tuple(source.shape), rank)
        pieces = [source.keep(box_of(i, source.shape)).to(device) for i in index]
        stored = {suffix: (tuple(part.get_shape()), torch_dtype(part.get_dtype()))
                  for suffix, part in source.parts.items() if part is not None}  # fmt: skip
        return cls(key, pieces, layout.dim, dtype, stored, dict(source.constants))

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.pieces)

    def dequantize(self) -> torch.Tensor:
        parts = [piece.dequantize().to(self.dtype) for piece in self.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def placeholder(local_shape, dtype) -> nn.Parameter:
    """What a kept weight's slot holds between calls: its shape and dtype, no data."""
    return nn.Parameter(torch.empty(local_shape, dtype=dtype, device="meta"), requires_grad=False)


def hold_quantized(model: nn.Module, kept: dict[str, KeptWeight]) -> list:
    """Each kept weight dequantized into its slot for its module's call only (hooks, returned)."""
    by_module: dict[str, dict[str, KeptWeight]] = {}
    for name, weight in kept.items():
        path, _, attr = name.rpartition(".")
        by_module.setdefault(path, {})[attr] = weight
    handles = []
    for path, weights in by_module.items():
        module = model.get_submodule(path)
        resting = {attr: module._parameters[attr] for attr in weights}

        def put(module, args, weights=weights):
            for attr, weight in weights.items():
                module._parameters[attr] = nn.Parameter(weight.dequantize(), requires_grad=False)

        def take_back(module, args, output, resting=resting):
            module._parameters.update(resting)

        handles += [module.register_forward_pre_hook(put), module.register_forward_hook(take_back, always_call=True)]
    return handles


def gathered_part(weight: KeptWeight, suffix: str, tp) -> torch.Tensor | None:
    """The whole stored part ``suffix`` of a kept weight on the TP group's first rank (None elsewhere), as
    the checkpoint held it: every rank's elements placed where they came from (runs that overlap, the
    scales of a block two ranks share, agree). Where each piece goes travels as an object, its bytes as
    bytes (float8 does not pickle). A part the ranks' pieces do not cover is refused, never written."""
    if suffix in weight.constants:
        return weight.constants[suffix].cpu() if tp.rank == 0 else None
    shape, dtype = weight.stored[suffix]
    mine = [(index, t) for piece in weight.pieces for part, (index, t) in piece.stored().items() if part == suffix]
    device = mine[0][1].device
    places = [[(index, tuple(t.shape)) for index, t in mine]]
    if tp.size > 1:
        places = [None] * tp.size if tp.rank == 0 else None
        with collective(f"gathering {weight.key + suffix} (kept quantized) on rank {tp.ranks[0]}"):
            dist.gather_object([(index, tuple(t.shape)) for index, t in mine], places, group=tp.group, group_dst=0)
            for _, tensor in mine if tp.rank != 0 else ():
                dist.send(tensor.reshape(-1).contiguous().view(torch.uint8), group_dst=0, group=tp.group)
    if tp.rank != 0:
        return None
    full, filled = torch.empty(shape, dtype=dtype), torch.zeros(shape, dtype=torch.bool)
    for rank, pieces in enumerate(places):
        for n, (index, piece_shape) in enumerate(pieces):
            if rank == 0:
                tensor = mine[n][1]
            else:
                tensor = torch.empty(math.prod(piece_shape) * dtype.itemsize, dtype=torch.uint8, device=device)
                with collective(f"receiving {weight.key + suffix} from rank {tp.ranks[rank]}"):
                    dist.recv(tensor, group_src=rank, group=tp.group)
                tensor = tensor.view(dtype).reshape(piece_shape)
            if math.prod(shape) == 1:  # one scale, stored as [] or [1], held as [1, 1]
                index, tensor = (), tensor.reshape(shape)
            full[index], filled[index] = tensor.cpu(), True
    if not filled.all():
        raise RuntimeError(f"{weight.key + suffix}: the ranks' kept pieces do not cover it; refusing to write it")
    return full
