"""Weights held quantized on each rank (``from_pretrained(..., keep_quantized=True)``): a rank keeps its
slice of each quantized weight as the checkpoint stores it (FP8 and its block scales, packed integers,
MXFP4) and dequantizes it module by module in the forward, so at rest it holds about the quantized bytes
(FP8: half of bf16) and, in a forward, one module's weight in the compute dtype besides.

Between calls the parameter's slot holds a ``KeptPlaceholder``: its local shape and dtype on the meta
device (so shape checks and the plan see the weight), refusing any computation (a meta tensor alone would
not: ``F.linear`` of a CPU input and a meta weight returns uninitialised memory). The module's forward
pre-hook puts the dequantized weight there and its forward hook puts the placeholder back, so anything
reading the weight outside its module's call fails loudly, never with a stale or wrong value.
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
        parts = [piece.dequantize(self.dtype) for piece in self.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


class KeptPlaceholder(nn.Parameter):
    """What a kept weight's slot holds between calls: its shape, dtype and device (meta), nothing to compute
    with: any other use raises, naming it."""

    METADATA = {getattr(torch.Tensor, name).__get__ for name in (
        "shape", "dtype", "device", "requires_grad", "ndim", "is_meta", "grad", "grad_fn", "is_leaf", "layout",
        "is_sparse", "is_quantized", "is_cuda", "is_cpu", "itemsize", "nbytes", "output_nr", "_version")}
    METADATA |= {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
                 torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.data_ptr, torch.Tensor.__hash__,
                 torch.Tensor.__repr__}  # fmt: skip

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            f"{getattr(func, '__name__', func)} on a weight held quantized (keep_quantized=True): it is dequantized "
            "only inside its own module's call; load without keep_quantized to use the weights otherwise"
        )


def placeholder(local_shape, dtype) -> KeptPlaceholder:
    return KeptPlaceholder(torch.empty(local_shape, dtype=dtype, device="meta"), requires_grad=False)


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


def gathered_part(weight: KeptWeight, suffix: str, tp, device) -> torch.Tensor | None:
    """The whole stored part ``suffix`` of a kept weight on the TP group's first rank (None elsewhere), as
    the checkpoint held it: every rank's elements placed where they came from (runs that overlap, the
    scales of a block two ranks share, agree). Where each piece goes travels as an object to every rank,
    which all check that the pieces cover the part (else all refuse, before any byte moves); the bytes go
    as bytes (float8 does not pickle), on ``device`` (the groups')."""
    if suffix in weight.constants:
        return weight.constants[suffix].cpu() if tp.rank == 0 else None
    shape, dtype = weight.stored[suffix]
    mine = [(index, t) for piece in weight.pieces for part, (index, t) in piece.stored().items() if part == suffix]
    places = [[(index, tuple(t.shape)) for index, t in mine]]
    if tp.size > 1:
        mine_only, places = places[0], [None] * tp.size
        with collective(f"listing the pieces of {weight.key + suffix} (kept quantized) on rank {tp.ranks[tp.rank]}"):
            dist.all_gather_object(places, mine_only, group=tp.group)
    filled = torch.zeros(shape, dtype=torch.bool)
    for index, _ in (piece for pieces in places for piece in pieces):
        filled[() if math.prod(shape) == 1 else index] = True
    if not filled.all():
        raise RuntimeError(f"{weight.key + suffix}: the ranks' kept pieces do not cover it; refusing to write it")
    if tp.rank != 0:
        with collective(f"sending {weight.key + suffix} (kept quantized) to rank {tp.ranks[0]}"):
            for _, tensor in mine:
                dist.send(tensor.reshape(-1).contiguous().view(torch.uint8).to(device), group_dst=0, group=tp.group)
        return None
    full = torch.empty(shape, dtype=dtype)
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
            full[index] = tensor.cpu()
    return full
