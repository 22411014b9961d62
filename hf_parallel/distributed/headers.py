"""A tensor's description ahead of its bytes (dtype, rank, shape as eight int64s), so a receiver
never guesses a shape: pipeline stages' messages and shared-memory broadcasts use the same one."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
MAX_DIMS = 6
HEADER_LENGTH = 2 + MAX_DIMS


def header_of(tensor: torch.Tensor, device) -> torch.Tensor:
    if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dims between ranks")
    shape = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor([DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64, device=device)


def empty_header(device) -> torch.Tensor:
    return torch.empty(HEADER_LENGTH, dtype=torch.int64, device=device)


def empty_from(header: torch.Tensor, device) -> torch.Tensor:
    dtype, ndim, *shape = header.tolist()
    return torch.empty(shape[:ndim], dtype=DTYPES[dtype], device=device)
