"""What every quantized format shares: a box of a weight as stored (``Kept``), a weight read like a
safetensors slice (``Dequantized``: any box, dequantized, reading only that box and the scales of its
blocks), and the arithmetic of blocks and packed words. A rank reads its slice of a quantized weight through
the same layouts as any other tensor, never dequantized whole on one rank; a shard boundary inside a block
is exact (each row takes the scale of the block it came from)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import NamedTuple

import torch

from ..core.dtypes import torch_dtype
from ..core.errors import CheckpointError



SUPPORTED = (
    "fp8 (block-wise weight_scale_inv), compressed-tensors float-quantized 8-bit (per-tensor, per-channel or block "
    "weight_scale) and pack-quantized 4/8-bit integers (per group or channel, with or without zero points), "
    "mxfp4 (gpt-oss's experts), gptq (4 or 8 bits, formats gptq and gptq_v2, act-order) and awq (4 bits, version gemm, "
    "zero points)"
)


class Suffixed:
    """A format whose parts are keyed by a suffix on the weight's key (``<name>_scale``)."""

    stored_as: str | None  # the part whose key marks the weight as stored in parts (None: its own key)

    def part_key(self, key: str, part: str) -> str:
        return key + part

    def weight_key(self, stored: str) -> str:
        return stored[: -len(self.stored_as)]


def refused(config, what: str) -> ValueError:
    return ValueError(
        f"{type(config).__name__} has a quantization_config ({what}): hf_parallel reads {SUPPORTED}; not "
        "GPTQ's 2 or 3 bits or its other formats, AWQ's other versions, bitsandbytes, HQQ, torchao, fp8 without "
        "weight_block_size, compressed-tensors' other formats or its KV-cache "
        "scales yet (their weights would load without their scales); load a dequantized (bf16 / fp32) copy"
    )


def config_text(value) -> str:
    """A config's string, or transformers' enum of it (``QuantizationMethod.GPTQ``, ``AwqFormat.GEMM``)."""
    return str(getattr(value, "value", value)).lower()


def span(start: int, stop: int, size: int) -> slice:
    """The blocks of ``size`` that elements ``[start, stop)`` touch."""
    return slice(start // size, -(-stop // size))


def spread(per_block: torch.Tensor, dim: int, size: int, offset: int, count: int) -> torch.Tensor:
    """Values held per block of ``size`` along ``dim``, one per element of the ``count`` elements from
    ``offset`` in the first block; one block stays one (it broadcasts)."""
    if per_block.shape[dim] == 1:
        return per_block
    return per_block.repeat_interleave(size, dim).narrow(dim, offset, count)


def box_of(index, shape) -> list[tuple[int, int]]:
    """A tuple of step-1 slices (or fewer) as (start, stop) per dim."""
    index = index if isinstance(index, tuple) else (index,)
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for part, n in zip(index, shape):
        start, stop, step = part.indices(n)
        if step != 1:
            raise IndexError(f"a quantized weight is read in runs, not with step {step}")
        out.append((start, stop))
    return out


def take(part, index: tuple, meta: bool) -> torch.Tensor:
    """``part[index]`` (a safetensors slice or a tensor); with ``meta``, only its shape and dtype (no read)."""
    if not meta or isinstance(part, torch.Tensor):
        return part[index] if not meta else part[index].to("meta")
    shape = [len(range(*s.indices(n))) for s, n in zip(index, part.get_shape())] + part.get_shape()[len(index) :]
    return torch.empty(shape, dtype=torch_dtype(part.get_dtype()), device="meta")


@dataclass
class Kept:
    """One box of a quantized weight as stored: the elements of its parts that the box needs, dequantized
    on demand (``dequantize``: float32) so a rank can hold a weight quantized and compute with it; ``at``:
    each part's field -> (its key, where the elements sit in the stored tensor), to save it back."""

    at: dict[str, tuple[str, tuple]]
    holds_experts = False  # its tensors' leading dim is the experts' (MXFP4's fused experts), dequantized with it

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device) -> "Kept":
        return replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def stored(self) -> dict[str, tuple[tuple, torch.Tensor]]:
        """Part key -> (where in the stored tensor, the elements this box holds)."""
        return {key: (index, getattr(self, field)) for field, (key, index) in self.at.items()}


class GroupedValues(NamedTuple):
    """A kept box of integers in groups of inputs, as kernels take them: ``W[o, i] = (values[o, i] - zero[g, o])
    * scales[g, o]`` with ``g = groups[i]``, every value unsigned (GPTQ / AWQ as stored; compressed-tensors'
    offset as stored)."""

    values: torch.Tensor  # [outputs, inputs] uint8
    zero: torch.Tensor  # [the box's groups, outputs] float32
    scales: torch.Tensor  # [the box's groups, outputs] float32
    groups: torch.Tensor  # [inputs] int64: each input's row in zero and scales
    group: int  # the format's inputs per group
    bits: int


class Dequantized:
    """A quantized weight read like a safetensors slice: ``[index]`` (step-1 slices) gives that box of
    the dequantized weight, in float32, reading only the box and the scales of its blocks (``keep``: the
    box as stored; with ``meta``, only its parts' shapes, for a plan's bytes). ``on(device)``: the box's
    stored parts go to ``device`` and are dequantized there (a GPU: the bytes that cross are the
    quantized ones, and the arithmetic is the GPU's)."""

    shape: tuple[int, ...]
    parts: dict  # key -> its safetensors slice (the parts a box reads elements of)
    constants: Mapping[str, torch.Tensor] = MappingProxyType({})  # key -> a part written whole
    device: torch.device = torch.device("cpu")  # where a box is dequantized

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def on(self, device: torch.device) -> "Dequantized":
        self.device = device
        return self

    def __getitem__(self, index) -> torch.Tensor:
        kept = self.keep(box_of(index, self.shape))
        return (kept if self.device.type == "cpu" else kept.to(self.device)).dequantize()  # float32, as floats read


def check_scales(key: str, scale, shape, block, name: str) -> None:
    """The scales of a weight of ``shape`` scaled per ``block`` are a grid of one per block (a single scale
    may be stored as [1] or []); another shape is refused naming the key."""
    found = tuple(scale.get_shape())
    want = tuple(-(-n // b) for n, b in zip(shape, block))
    if found == want or (want == (1, 1) and math.prod(found) == 1):
        return
    raise CheckpointError(
        f"{key!r} {tuple(shape)} scaled per blocks of {tuple(block)} needs a {name!r} of shape {want}, and it is "
        f"{found}: written otherwise than the config says?"
    )


def codes(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """A matrix of int32 words, each ``32 // bits`` unsigned values (uint8) along ``dim``: value i at bit
    ``i * bits``, standing for element ``order[i]`` of the word's run (None: element i). Read through the
    words' bytes (little-endian, as every host and GPU torch runs on): byte b holds values 2b and 2b + 1 (its
    low and high nibble) at 4 bits, value b at 8; a quarter of the memory traffic of shifting int32 words."""
    data = words.contiguous().view(torch.uint8).view(*words.shape, 4)
    values = data if bits == 8 else torch.stack((data & 0x0F, data >> 4), -1).view(*words.shape, 8)
    if order is not None:
        values = values[..., [order.index(n) for n in range(len(order))]]
    return values.flatten(1) if dim == 1 else values.transpose(1, 2).flatten(0, 1)
