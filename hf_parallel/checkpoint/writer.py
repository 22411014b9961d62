"""A safetensors file written tensor by tensor, so a saver holds one tensor at a time, not the model.

The header (names, dtypes, shapes, offsets) is declared up front, as the format requires; each
tensor's bytes are then appended straight from its storage, without a copy.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import mmap
import os
import time
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from ..core.dtypes import SAFETENSORS_DTYPES, nbytes

TIMES: Counter = Counter()  # save phase -> seconds on this rank (gather, write, fsync, rename): the benchmark's profile


@contextmanager
def timed(phase: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        TIMES[phase] += time.perf_counter() - start


def safetensors_header(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> bytes:
    """A file's leading bytes (length, JSON header, padding), tensors in the order of ``specs``."""
    header, offset = {}, 0
    for key, (shape, dtype) in specs.items():
        size = nbytes(shape, dtype)
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


ALIGN = 4096  # O_DIRECT's unit for offsets, lengths and buffer addresses
WINDOW = 4 << 20  # bytes gathered in the aligned buffer before each write (memory the save adds)


class DirectFile:
    """A file written front to back straight to the disk (``O_DIRECT``), through one page-aligned
    buffer that is filled and written window by window, the last window padded and the file then
    cut to its size. Buffered writes first allocate page-cache pages for every byte and then flush
    them, where a direct write only writes, and the checkpoint being saved is rarely read back by the process saving it
    (DeepSpeed's FastPersist writes checkpoints the same way). Where the file system refuses
    ``O_DIRECT`` (tmpfs), or with ``HF_PARALLEL_DIRECT_IO=0``, the same windows go through the page
    cache."""

    def __init__(self, path: str, size_hint: int = WINDOW):
        self.path = path
        self.direct = hasattr(os, "O_DIRECT") and os.environ.get("HF_PARALLEL_DIRECT_IO", "1") != "0"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o666)
        except OSError:
            self.direct, self.fd = False, os.open(path, flags, 0o666)
        self.buffer = mmap.mmap(-1, max(ALIGN, min(WINDOW, -(-size_hint // ALIGN) * ALIGN)))
        self.view = memoryview(self.buffer)
        self.filled, self.offset = 0, 0  # bytes in the buffer; where the buffer goes in the file

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        while data:
            count = min(len(data), len(self.buffer) - self.filled)
            self.view[self.filled : self.filled + count] = data[:count]
            self.filled, data = self.filled + count, data[count:]
            if self.filled == len(self.buffer):
                self._write_out(self.filled)

    def _write_out(self, length: int) -> None:
        with timed("write"):
            try:
                pwrite_all(self.fd, self.view[:length], self.offset)
            except OSError as error:  # O_DIRECT opened but refused here: through the page cache instead
                if not self.direct or error.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                os.close(self.fd)
                self.direct, self.fd = False, os.open(self.path, os.O_WRONLY)
                pwrite_all(self.fd, self.view[:length], self.offset)
        self.offset, self.filled = self.offset + self.filled, 0

    def close(self) -> None:
        """Write what is left (padded to the unit), cut the file to its size, and sync it."""
        size = self.offset + self.filled
        if self.filled:
            padded = -(-self.filled // ALIGN) * ALIGN
            self.view[self.filled : padded] = bytes(padded - self.filled)
            self._write_out(padded)
        with timed("fsync"):
            os.ftruncate(self.fd, size)
            os.fsync(self.fd)
        os.close(self.fd)
        self.view.release()
        self.buffer.close()


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in the order the header was declared."""

    def __init__(self, path: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        lead = safetensors_header(specs)
        self.pending = list(specs.items())
        self.file = DirectFile(path, len(lead) + sum(nbytes(*spec) for spec in specs.values()))
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
            block = block.detach().cpu().contiguous()  # held while its bytes are written: host_bytes
            self.file.write(host_bytes(block))  # keeps no reference, and a temporary copy would be freed
        if written != math.prod(shape):
            raise RuntimeError(
                f"writer expected {key} {tuple(shape)}, got {written} of its {math.prod(shape)} elements"
            )

    def close(self) -> None:
        if self.pending:
            raise RuntimeError(f"safetensors file closed with {len(self.pending)} tensor(s) unwritten")
        self.file.close()


def host_bytes(tensor: torch.Tensor):
    """A contiguous host tensor's bytes, as a buffer over its memory (no copy). Not ``.numpy()``:
    that marks the storage unresizable for good, and FSDP frees its unsharded parameters by
    resizing their storage to nothing."""
    return (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()) if tensor.nbytes else b""
