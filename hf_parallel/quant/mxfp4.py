"""MXFP4 (gpt-oss's experts): ``<name>_blocks`` uint8 [E, out, in / 32, 16], two e2m1 codes a byte (low
nibble first), ``<name>_scales`` e8m0 [E, out, in / 32]; the parameter is the transpose [E, in, out]."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..core.dtypes import torch_dtype
from ..core.errors import CheckpointError
from .base import Dequantized, Kept, Suffixed, span, take

EXPONENTS = (torch.uint8, torch.float8_e8m0fnu)  # MXFP4's scales: biased exponents (127 = 2**0)


@dataclass(frozen=True)
class MXFP4(Suffixed):
    """gpt-oss's MXFP4 experts (the config says no more)."""

    stored_as = "_blocks"
    parts = ("_blocks", "_scales")


@dataclass
class KeptMXFP4(Kept):
    holds_experts = True
    blocks: torch.Tensor  # uint8 [E, out, groups, 16]: the box's experts and outputs, the groups of its inputs
    scales: torch.Tensor  # uint8 [E, out, groups]
    offset: int  # the box's first input inside its first group
    inputs: int

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """Expert by expert into the [E, in, out] result (the temporaries: one expert's, in float32)."""
        experts, outputs = self.blocks.shape[:2]
        out = torch.empty(experts, self.inputs, outputs, dtype=dtype, device=self.blocks.device)
        table = _fp4_table(self.blocks.device)
        exponents = self.scales.view(torch.uint8) if self.scales.dtype == torch.float8_e8m0fnu else self.scales
        for e in range(experts):
            codes = self.blocks[e].to(torch.int32)
            values = torch.stack((table[codes & 0x0F], table[codes >> 4]), -1).flatten(-2)  # [o, g, 32]
            values = torch.ldexp(values, (exponents[e].to(torch.int32) - 127).unsqueeze(-1)).flatten(-2)
            out[e] = values.narrow(1, self.offset, self.inputs).T
        return out


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes


@functools.cache
def _fp4_table(device) -> torch.Tensor:
    return torch.tensor(FP4_VALUES, device=device)


class DequantizedMXFP4(Dequantized):
    """gpt-oss's MXFP4 experts: 32 e2m1 values per e8m0 scale along the input dim, the parameter their
    transpose ([E, in, out]), as transformers' ``convert_moe_packed_tensors`` makes it."""

    def __init__(self, key: str, blocks, scales):
        found, grid = tuple(blocks.get_shape()), tuple(scales.get_shape())
        if len(found) != 4 or found[-1] != 16 or grid != found[:-1]:
            raise CheckpointError(
                f"{key + '_blocks'!r} {found} and {key + '_scales'!r} {grid} are not MXFP4 experts "
                "([E, out, in / 32, 16] bytes and [E, out, in / 32] exponents)"
            )
        if torch_dtype(blocks.get_dtype()) != torch.uint8 or torch_dtype(scales.get_dtype()) not in EXPONENTS:
            raise CheckpointError(f"{key + '_blocks'!r} is {blocks.get_dtype()} and {key + '_scales'!r} "
                                  f"{scales.get_dtype()}: MXFP4 stores bytes (U8) and exponents (U8 or F8_E8M0)")
        self.blocks, self.scales, self.key = blocks, scales, key
        self.parts = {key + "_blocks": blocks, key + "_scales": scales}
        self.shape = (found[0], found[2] * 32, found[1])

    def keep(self, box, meta: bool = False) -> KeptMXFP4:
        (e0, e1), (i0, i1), (o0, o1) = box
        index = (slice(e0, e1), slice(o0, o1), span(i0, i1, 32))
        at = {"blocks": (self.key + "_blocks", index), "scales": (self.key + "_scales", index)}
        return KeptMXFP4(at, take(self.blocks, index, meta), take(self.scales, index, meta), i0 % 32, i1 - i0)
