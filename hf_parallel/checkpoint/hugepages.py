"""Owned weight copies on transparent huge pages, where the kernel offers them.

A rank copies its column splits into fresh anonymous memory. Faulting that in 4 KiB at a time is
most of the copy's cost, and several ranks faulting at once on one host slow each other down; a
huge page faults in 2 MiB at once. torch's allocator
does the same for every allocation with ``THP_MEM_ALLOC_ENABLE=1``, but reads that once at import;
this advises only the tensors the loader owns, before they are first touched.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" and _MADV_HUGEPAGE else None


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` whose whole 2 MiB pages are advised onto huge pages (CPU, Linux, where the
    kernel's ``transparent_hugepage`` is ``always`` or ``madvise``); elsewhere plain ``torch.empty``.
    The advice is a hint: refused or not, the tensor is the same."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _libc is None or out.device.type != "cpu":
        return out
    start = -out.data_ptr() % HUGE_PAGE + out.data_ptr()
    end = (out.data_ptr() + out.numel() * out.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return out
