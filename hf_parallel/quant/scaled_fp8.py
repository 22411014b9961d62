"""FP8 weights with scales: ``quant_method: "fp8"`` with ``weight_block_size: [bm, bn]`` (DeepSeek-V3/R1,
Qwen3-*-FP8, GLM-4.5-FP8) and compressed-tensors' float-quantized 8-bit weights (the ``*-FP8-dynamic``
repacks). ``W[i, j] = q[i, j] * s[i // bm, j // bn]``, ``q`` float8 and ``s`` the ``<name>_scale_inv`` (fp8) or
``<name>_scale`` (compressed-tensors: per tensor, per output row or per block) tensor beside it. A box of rows
``[a, b)`` reads the scale rows of the blocks it touches, ``[a // bm, ceil(b / bm))``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import CheckpointError
from .base import Dequantized, Kept, Suffixed, check_scales, span, spread, take

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class ScaledFP8(Suffixed):
    """How a checkpoint's FP8 weights are scaled, as its config states it."""

    strategy: str  # "block": a scale per block of the weight; "channel": per output row; "tensor": one
    block: tuple[int, int] | None  # (rows, columns) each scale covers, for "block"
    suffix: str  # the scale's key: "<module>.weight" + suffix ("_scale_inv" for fp8, "_scale" for compressed-tensors)
    stored_as = None  # the weight keeps its own key (float8)

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.suffix,)

    def block_for(self, shape) -> tuple[int, int]:
        rows, columns = shape
        return {"block": self.block, "channel": (1, columns), "tensor": (rows, columns)}[self.strategy]


@dataclass
class KeptFP8(Kept):
    weight: torch.Tensor  # float8, the box
    scales: torch.Tensor  # of the blocks it touches
    block: tuple[int, int]
    offset: tuple[int, int]  # the box's start inside its first block

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        (rows, columns), (bm, bn), (r, c) = self.weight.shape, self.block, self.offset
        scales = self.scales.float()
        if scales.dim() != 2:  # one scale, as stored ([] or [1])
            scales = scales.reshape(1, 1)
        grid = tuple(scales.shape)
        if (r, c) == (0, 0) and (rows, columns) == (grid[0] * bm, grid[1] * bn):  # whole blocks: broadcast, no
            blocks = self.weight.float().view(grid[0], bm, grid[1], bn)  # scale spread to every element
            return (blocks * scales[:, None, :, None]).view(rows, columns).to(dtype)
        scales = spread(spread(scales, 0, bm, r, rows), 1, bn, c, columns)
        return (self.weight.float() * scales).to(dtype)


class DequantizedFP8(Dequantized):
    """A scaled FP8 matrix: ``W = q * s`` per block."""

    def __init__(self, key: str, weight, scale, quantization: ScaledFP8):
        self.shape = tuple(weight.get_shape())
        if len(self.shape) != 2:
            raise CheckpointError(f"{key!r} is FP8 of shape {self.shape}; hf_parallel dequantizes matrices")
        self.weight, self.block, self.scale_key = weight, quantization.block_for(self.shape), key + quantization.suffix
        check_scales(key, scale, self.shape, self.block, self.scale_key)
        self.key, self.scale, self.parts = key, scale, {key: weight, self.scale_key: scale}

    def keep(self, box, meta: bool = False) -> KeptFP8:
        (r0, r1), (c0, c1) = box
        (bm, bn) = self.block
        grid = tuple(self.scale.get_shape())  # a single scale is read whole, as stored ([] or [1])
        scales = (span(r0, r1, bm), span(c0, c1, bn)) if len(grid) == 2 else tuple(slice(0, n) for n in grid)
        at = {"weight": (self.key, (slice(r0, r1), slice(c0, c1))), "scales": (self.scale_key, scales)}
        weight, scales = take(self.weight, at["weight"][1], meta), take(self.scale, at["scales"][1], meta)
        return KeptFP8(at, weight, scales, self.block, (r0 % bm, c0 % bn))
