"""The dtype maps: safetensors' dtype codes and torch's dtypes, both ways, and a tensor's bytes."""

from __future__ import annotations

import math

import torch

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec)
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}


SAFETENSORS_TO_TORCH = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def torch_dtype(dtype) -> torch.dtype:
    """A slice's dtype as torch names it (safetensors slices give their codes: "F32", "BF16"; a pickle's its
    torch dtype)."""
    return dtype if isinstance(dtype, torch.dtype) else SAFETENSORS_TO_TORCH[dtype]


def nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
