"""A safetensors file written tensor by tensor, so a saver holds one tensor at a time, not the model.

The header (names, dtypes, shapes, offsets) is declared up front, as the format requires; each
tensor's bytes are then appended straight from its storage, without a copy.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager

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
}


SAFETENSORS_TO_TORCH = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


TIMES: Counter = Counter()  # save phase -> seconds on this rank (gather, write, fsync, rename): the benchmark's profile


@contextmanager
def timed(phase: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        TIMES[phase] += time.perf_counter() - start


def safetensors_header(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[bytes, dict[str, int]]:
    """A file's leading bytes (length, JSON header, padding) and where each tensor's bytes start in
    the file, tensors in the order of ``specs``."""
    header, offset, starts = {}, 0, {}
    for key, (shape, dtype) in specs.items():
        size = nbytes(shape, dtype)
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        starts[key] = offset
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    lead = len(raw).to_bytes(8, "little") + raw
    return lead, {key: len(lead) + start for key, start in starts.items()}


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in the order the header was declared."""

    def __init__(self, path: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        lead, _ = safetensors_header(specs)
        self.pending = list(specs.items())
        self.file = open(path, "wb")
        self.file.write(lead)

    def write(self, key: str, tensor: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """``tensor``, or its row blocks in order (shards along dim 0), each written as it comes."""
        expected_key, (shape, dtype) = self.pending.pop(0)
        if key != expected_key:
            raise RuntimeError(f"writer expected {expected_key} next, got {key}")
        written = 0
        for block in [tensor] if isinstance(tensor, torch.Tensor) else tensor:
            if block.dtype != dtype or block.dim() != len(shape) or tuple(block.shape[1:]) != tuple(shape[1:]):
                raise RuntimeError(
                    f"writer expected {key} {tuple(shape)} {dtype} (or row blocks of it), "
                    f"got {tuple(block.shape)} {block.dtype}"
                )
            written += block.numel()
            with timed("write"):
                self.file.write(host_bytes(block.detach().cpu().contiguous()))
        if written != math.prod(shape):
            raise RuntimeError(
                f"writer expected {key} {tuple(shape)}, got {written} of its {math.prod(shape)} elements"
            )

    def close(self) -> None:
        if self.pending:
            raise RuntimeError(f"safetensors file closed with {len(self.pending)} tensor(s) unwritten")
        with timed("fsync"):
            self.file.flush()
            os.fsync(self.file.fileno())
        self.file.close()


def pwrite_tensor(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """``tensor``'s bytes into file ``fd`` at ``offset`` (other ranks may be writing elsewhere in it)."""
    tensor = tensor.detach().cpu().contiguous()
    data = memoryview(host_bytes(tensor)).cast("B")
    with timed("write"):
        while data:
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written


def host_bytes(tensor: torch.Tensor):
    """A contiguous host tensor's bytes, as a buffer over its memory (no copy). Not ``.numpy()``:
    that marks the storage unresizable for good, and FSDP frees its unsharded parameters by
    resizing their storage to nothing."""
    return (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()) if tensor.nbytes else b""
