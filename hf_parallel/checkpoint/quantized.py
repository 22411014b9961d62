"""Quantized checkpoints: which formats hf_parallel reads, and a block-scaled FP8 weight read like a
safetensors slice (any box of it, dequantized), so every rank reads only its slice of the weight and
of its scales through the same layouts as any other tensor.

FP8 with block scales (``quant_method: "fp8"``, ``weight_block_size: [bm, bn]``; DeepSeek-V3/R1,
Qwen3-*-FP8, GLM-4.5-FP8): ``W[i, j] = q[i, j] * s[i // bm, j // bn]``, ``q`` float8 and ``s`` the
``<name>_scale_inv`` tensor beside it. A box of rows ``[a, b)`` reads the scale rows of the blocks it
touches, ``[a // bm, ceil(b / bm))``, so a shard boundary inside a block (64 of 128 rows) is exact: each
row takes the scale of the block it came from. The weights are dequantized on each rank as its slice is
read, into the dtype asked for (as transformers does on a CPU), never whole on one rank; the model holds
plain floats and saves them so, without ``quantization_config``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" is scaled by "<module>.weight_scale_inv"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names
SUPPORTED = "fp8 (block-wise weight_scale_inv, dequantized at load)"


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint's FP8 block quantization, as its config states it."""

    block: tuple[int, int]  # (rows, columns) of the weight each scale covers


def read_quantization(config) -> BlockFP8 | None:
    """The quantization a config declares (None: none), removed from the config (the model holds
    plain floats and saves them so); anything hf_parallel does not read is refused by name, before
    any weight is read."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    get = quantization.get if isinstance(quantization, dict) else lambda key, default=None: getattr(
        quantization, key, default
    )
    method, block = str(get("quant_method")), get("weight_block_size")
    if method != "fp8" or not block:
        what = f"quant_method={method!r}" + (", per-tensor (no weight_block_size)" if method == "fp8" else "")
        raise ValueError(
            f"{type(config).__name__} has a quantization_config ({what}): hf_parallel reads {SUPPORTED}; not "
            "compressed-tensors, MXFP4, GPTQ, AWQ, bitsandbytes, HQQ, torchao or per-tensor FP8 yet (their weights "
            "would load without their scales); load a dequantized (bf16 / fp32) copy of the checkpoint"
        )
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return BlockFP8(tuple(int(n) for n in block))


def scale_key(key: str) -> str:
    return key + SCALE_SUFFIX


class DequantizedSlice:
    """A block-scaled FP8 weight, read like a safetensors slice: ``[index]`` with step-1 slices gives
    that box of the dequantized weight (float32), reading only the box and the scales of its blocks."""

    def __init__(self, key: str, weight, scale, quantization: BlockFP8):
        self.key, self.weight, self.scale, self.block = key, weight, scale, quantization.block
        shape, found = tuple(weight.get_shape()), tuple(scale.get_shape())
        want = tuple(-(-n // b) for n, b in zip(shape, self.block))
        if len(shape) != 2 or found != want:
            raise CheckpointError(
                f"{key!r} {shape} in blocks of {self.block} needs a {scale_key(key)!r} of shape {want}, and it is "
                f"{found}: written with another weight_block_size than the config's?"
            )

    def get_shape(self) -> list[int]:
        return list(self.weight.get_shape())

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (2 - len(index))
        (r0, r1), (c0, c1) = (s.indices(n)[:2] for s, n in zip(index, self.get_shape()))
        (bm, bn) = self.block
        scales = self.scale[r0 // bm : -(-r1 // bm), c0 // bn : -(-c1 // bn)].float()
        scales = scales.repeat_interleave(bm, 0).repeat_interleave(bn, 1)
        scales = scales[r0 - r0 // bm * bm :][: r1 - r0, c0 - c0 // bn * bn :][:, : c1 - c0]
        return self.weight[r0:r1, c0:c1].float() * scales


def readable(handle, files: dict[str, str], key: str, quantization: BlockFP8 | None):
    """``key``'s safetensors slice (``handle(file)``: the file opened), or, stored in FP8 with its scale
    beside it, a ``DequantizedSlice`` of it. A float8 weight without its scale, or FP8 in a checkpoint
    whose config declares no quantization, is refused by name."""
    weight = handle(files[key]).get_slice(key)
    if not isinstance(weight.get_dtype(), str) or weight.get_dtype() not in FP8_DTYPES:
        return weight
    if quantization is None or scale_key(key) not in files:
        raise CheckpointError(
            f"{files[key]}: {key!r} is {weight.get_dtype()} with no "
            + ("quantization_config in the config" if quantization is None else f"{scale_key(key)!r} beside it")
            + ": its scales are unknown, so its values would load wrong"
        )
    return DequantizedSlice(key, weight, handle(files[scale_key(key)]).get_slice(scale_key(key)), quantization)


def dequantized_sources(files: dict[str, str], sources: dict, handle, quantization: BlockFP8 | None) -> dict:
    """Parameter name -> ``DequantizedSlice`` for every parameter read from one key stored in FP8
    (per-expert keys are dequantized tile by tile: ``ShardReader.fused``)."""
    out = {}
    for name, key in sources.items():
        if isinstance(key, str):
            found = readable(handle, files, key, quantization)
            if isinstance(found, DequantizedSlice):
                out[name] = found
    return out
