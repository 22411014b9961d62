"""Quantized checkpoints: which formats hf_parallel reads, and a scaled FP8 weight read like a
safetensors slice (any box of it, dequantized), so every rank reads only its slice of the weight and
of its scales through the same layouts as any other tensor.

FP8 with block scales (``quant_method: "fp8"``, ``weight_block_size: [bm, bn]``; DeepSeek-V3/R1,
Qwen3-*-FP8, GLM-4.5-FP8): ``W[i, j] = q[i, j] * s[i // bm, j // bn]``, ``q`` float8 and ``s`` the
``<name>_scale_inv`` tensor beside it. A box of rows ``[a, b)`` reads the scale rows of the blocks it
touches, ``[a // bm, ceil(b / bm))``, so a shard boundary inside a block (64 of 128 rows) is exact: each
row takes the scale of the block it came from. compressed-tensors' float-quantized 8-bit weights (the
``*-FP8-dynamic`` repacks) are the same with ``<name>_scale`` per tensor, per output row (a block of one row
and every column) or per block. The weights are dequantized on each rank as its slice is
read, into the dtype asked for (as transformers does on a CPU), never whole on one rank; the model holds
plain floats and saves them so, without ``quantization_config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import CheckpointError
from .writer import SAFETENSORS_TO_TORCH

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SUPPORTED = (
    "fp8 (block-wise weight_scale_inv) and compressed-tensors float-quantized 8-bit (per-tensor, per-channel or "
    "block weight_scale), dequantized at load"
)
ACTIVATION_SCALE = "input_scale"  # static activation scales: unused once the weights are dequantized


@dataclass(frozen=True)
class ScaledFP8:
    """How a checkpoint's FP8 weights are scaled, as its config states it."""

    strategy: str  # "block": a scale per block of the weight; "channel": per output row; "tensor": one
    block: tuple[int, int] | None  # (rows, columns) each scale covers, for "block"
    suffix: str  # the scale's key: "<module>.weight" + suffix ("_scale_inv" for fp8, "_scale" for compressed-tensors)

    def block_for(self, shape) -> tuple[int, int]:
        rows, columns = shape
        return {"block": self.block, "channel": (1, columns), "tensor": (rows, columns)}[self.strategy]


def _refused(config, what: str) -> ValueError:
    return ValueError(
        f"{type(config).__name__} has a quantization_config ({what}): hf_parallel reads {SUPPORTED}; not MXFP4, "
        "compressed-tensors' int4/int8 pack-quantized, GPTQ, AWQ, bitsandbytes, HQQ, torchao or per-tensor fp8 yet "
        "(their weights would load without their scales); load a dequantized (bf16 / fp32) copy of the checkpoint"
    )


def _compressed_tensors(config, get) -> ScaledFP8:
    """compressed-tensors' float-quantized format: every group's weights 8-bit floats, symmetric, one strategy."""
    found = {
        (w.get("num_bits"), w.get("type"), w.get("symmetric", True), w.get("strategy"),
         tuple(w.get("block_structure") or ()))
        for w in (group.get("weights") or {} for group in (get("config_groups") or {}).values())
    }  # fmt: skip
    if get("format") != "float-quantized" or len(found) != 1:
        raise _refused(config, f"quant_method='compressed-tensors', format={get('format')!r}, weights {sorted(found)}")
    ((bits, kind, symmetric, strategy, block),) = found
    if (bits, kind, symmetric) != (8, "float", True) or strategy not in ("tensor", "channel", "block"):
        raise _refused(config, f"quant_method='compressed-tensors', {bits}-bit {kind} weights, strategy {strategy!r}")
    return ScaledFP8(strategy, block or None, "_scale")


def read_quantization(config) -> ScaledFP8 | None:
    """The quantization a config declares (None: none), removed from the config (the model holds
    plain floats and saves them so); anything hf_parallel does not read is refused by name, before
    any weight is read."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    get = quantization.get if isinstance(quantization, dict) else lambda key, default=None: getattr(
        quantization, key, default
    )
    method, block = get("quant_method"), get("weight_block_size")
    method = str(getattr(method, "value", method))  # transformers' QuantizationMethod enum, or its string
    if method == "compressed-tensors":
        found = _compressed_tensors(config, get)
    elif method == "fp8" and block:
        found = ScaledFP8("block", tuple(int(n) for n in block), "_scale_inv")
    else:
        raise _refused(config, f"quant_method={method!r}" + (", per-tensor (no weight_block_size)" * (method == "fp8")))
    del config.quantization_config
    return found


def companion_keys(key: str) -> set[str]:
    """The keys read with the weight ``key`` (its scale, in either format's name) or made moot by its
    dequantization (the module's activation scale)."""
    module = key.rpartition(".")[0]
    return {key + "_scale_inv", key + "_scale", f"{module}.{ACTIVATION_SCALE}"}


class DequantizedSlice:
    """A block-scaled FP8 weight, read like a safetensors slice: ``[index]`` with step-1 slices gives
    that box of the dequantized weight (float32), reading only the box and the scales of its blocks."""

    def __init__(self, key: str, weight, scale, quantization: ScaledFP8):
        shape, found = tuple(weight.get_shape()), tuple(scale.get_shape())
        if len(shape) != 2:
            raise CheckpointError(f"{key!r} is FP8 of shape {shape}; hf_parallel dequantizes matrices")
        self.key, self.weight, self.scale, self.block = key, weight, scale, quantization.block_for(shape)
        want = tuple(-(-n // b) for n, b in zip(shape, self.block))
        if found != want and not (want == (1, 1) and math.prod(found) == 1):
            raise CheckpointError(
                f"{key!r} {shape} scaled per {quantization.strategy} (blocks of {self.block}) needs a "
                f"{key + quantization.suffix!r} of shape {want}, and it is {found}: written otherwise than the config "
                "says?"
            )
        if found != want:  # one scale for the tensor, stored as [1] or []
            self.scale = scale[:].reshape(1, 1) if found else scale[()].reshape(1, 1)

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
        if scales.shape[0] > 1:  # several blocks down the box: a scale per row (else one, broadcast)
            scales = scales.repeat_interleave(bm, 0)[r0 - r0 // bm * bm :][: r1 - r0]
        if scales.shape[1] > 1:
            scales = scales.repeat_interleave(bn, 1)[:, c0 - c0 // bn * bn :][:, : c1 - c0]
        return self.weight[r0:r1, c0:c1].float() * scales


def readable(handle, files: dict[str, str], key: str, quantization: ScaledFP8 | None):
    """``key``'s safetensors slice (``handle(file)``: the file opened), or, stored in FP8 with its scale
    beside it, a ``DequantizedSlice`` of it. A float8 weight without its scale, or FP8 in a checkpoint
    whose config declares no quantization, is refused by name."""
    weight = handle(files[key]).get_slice(key)
    dtype = weight.get_dtype()  # safetensors' code, or a torch dtype (a pickle checkpoint's)
    if (SAFETENSORS_TO_TORCH.get(dtype) if isinstance(dtype, str) else dtype) not in FP8:
        return weight
    scale = None if quantization is None else key + quantization.suffix
    if scale not in files:
        raise CheckpointError(
            f"{files[key]}: {key!r} is {weight.get_dtype()} with no "
            + ("quantization_config in the config" if quantization is None else f"{scale!r} beside it")
            + ": its scales are unknown, so its values would load wrong"
        )
    return DequantizedSlice(key, weight, handle(files[scale]).get_slice(scale), quantization)


def dequantized_sources(files: dict[str, str], sources: dict, handle, quantization: ScaledFP8 | None) -> dict:
    """Parameter name -> ``DequantizedSlice`` for every parameter read from one key stored in FP8
    (per-expert keys are dequantized tile by tile: ``ShardReader.fused``)."""
    out = {}
    for name, key in sources.items():
        if isinstance(key, str):
            found = readable(handle, files, key, quantization)
            if isinstance(found, DequantizedSlice):
                out[name] = found
    return out
