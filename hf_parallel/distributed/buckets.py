"""Gradient sums issued while backward goes on, a bucket at a time, and waited once (DDP's shape).

A gradient that must be summed over a group (a TP-replicated norm, every parameter of a sequence
rank) is copied into the open bucket of its groups as soon as autograd has accumulated it; a bucket
that reaches ``bucket_bytes`` is all-reduced at once without waiting (``async_op``), so the sums of
the last layers travel while autograd computes the first layers' gradients. ``finish`` (the end of
the backward) launches what is left, waits for every bucket in the order launched, and writes each
sum back into its gradient. Every rank of a group launches the same buckets in the same order: the
gradients arrive in the backward's order, the same on ranks running the same graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .faults import collective

BUCKET_MB_ENV = "HF_PARALLEL_GRADIENT_BUCKET_MB"  # 0: every sum blocking, in its parameter's hook
DEFAULT_BUCKET_MB = 25.0  # DDP's default


def bucket_bytes() -> int:
    """The bucket size ``HF_PARALLEL_GRADIENT_BUCKET_MB`` asks for (25 MiB by default; 0 turns bucketing off)."""
    return int(float(os.environ.get(BUCKET_MB_ENV, DEFAULT_BUCKET_MB)) * 2**20)


@dataclass(frozen=True)
class Reduction:
    """A gradient summed over ``group``, then divided by ``divide`` (an average over replicas)."""

    group: object
    divide: int = 1


@dataclass
class Bucket:
    """Gradients with the same reductions, dtype and device, flattened into one all-reduce."""

    reductions: tuple[Reduction, ...]
    params: list[nn.Parameter] = field(default_factory=list)
    pieces: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    flat: torch.Tensor | None = None
    work: object = None

    def launch(self) -> None:
        """The first reduction started without waiting (the others, rare, run in ``finish``)."""
        self.flat = torch.cat([piece.reshape(-1) for piece in self.pieces])
        self.pieces = []
        with collective(lambda: f"a bucket of {len(self.params)} gradient sums ({self.nbytes} bytes)"):
            self.work = dist.all_reduce(self.flat, group=self.reductions[0].group, async_op=True)

    def finish(self) -> None:
        """Wait for the sums and write them into the gradients they came from."""
        with collective(lambda: f"a bucket of {len(self.params)} gradient sums ({self.nbytes} bytes)"):
            self.work.wait()
            for reduction in self.reductions[1:]:
                dist.all_reduce(self.flat, group=reduction.group)
        divide = 1
        for reduction in self.reductions:
            divide *= reduction.divide
        if divide != 1:
            self.flat /= divide
        offset = 0
        for param in self.params:
            grad = param.grad
            grad.copy_(self.flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


class GradientBuckets:
    """The buckets of one backward: ``add`` as gradients are ready, ``finish`` at its end."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.open: dict[tuple, Bucket] = {}
        self.launched: list[Bucket] = []

    def add(self, param: nn.Parameter, reductions: tuple[Reduction, ...]) -> None:
        """``param.grad`` (accumulated, this rank's alone) to be reduced as ``reductions`` say."""
        grad = param.grad
        key = (reductions, grad.dtype, grad.device)
        bucket = self.open.setdefault(key, Bucket(reductions))
        bucket.params.append(param)
        bucket.pieces.append(grad.detach())  # (autograd writes it no more in this backward: copied at launch)
        bucket.nbytes += grad.numel() * grad.element_size()
        if bucket.nbytes >= self.capacity:
            self._launch(key)

    def _launch(self, key) -> None:
        bucket = self.open.pop(key)
        bucket.launch()
        self.launched.append(bucket)

    def finish(self) -> None:
        """Launch the open buckets (in the order opened), then wait for every bucket in launch order."""
        for key in list(self.open):
            self._launch(key)
        launched, self.launched = self.launched, []
        for bucket in launched:
            bucket.finish()
