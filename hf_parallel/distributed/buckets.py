"""Gradient sums issued while backward goes on, a bucket at a time, and waited once (DDP's shape).

A gradient that must be summed over a group (a TP-replicated norm, every parameter of a sequence
rank) is added to the open bucket of its groups as soon as autograd has accumulated it; a bucket
that reaches ``bucket_bytes`` is all-reduced at once without waiting (``async_op``), so the sums of
the last layers travel while autograd computes the first layers' gradients. ``finish`` (the end of
the backward) launches what is left, waits for every bucket in the order launched, and writes each
sum back into its gradient. At most ``IN_FLIGHT`` buckets' copies are held at once: past that the
oldest is waited and written back early, so bucketing costs a few buckets of memory, not a second
copy of every summed gradient.

Every rank of a group must launch the same buckets in the same order: the gradients arrive in the
backward's order, the same on ranks running the same graph. Each bucket carries a fingerprint (how
many parameters, the sum of their indices) summed beside it, so ranks that bucketed different
gradients (a hook registered on some ranks only) are refused by name rather than summed crosswise.
A gradient changed since it was bucketed (``zero_grad`` after a backward that raised, whose end never
came) is not written over: its bucket is waited and dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .faults import collective

BUCKET_MB_ENV = "HF_PARALLEL_GRADIENT_BUCKET_MB"  # 0: every sum blocking, in its parameter's hook
# what a device-side assert says (CUDA takes under 255 characters: the ranks' bucket indices are not in it)
ON_DEVICE_MISMATCH = (
    f"hf_parallel: the ranks bucketed different gradients for one sum (a hook on some ranks only, or {BUCKET_MB_ENV} "
    f"differing); register hooks on every rank or set {BUCKET_MB_ENV}=0"
)
DEFAULT_BUCKET_MB = 25.0  # DDP's default
IN_FLIGHT = 4  # buckets launched and not yet written back, at most


def bucket_bytes() -> int:
    """The bucket size ``HF_PARALLEL_GRADIENT_BUCKET_MB`` asks for (25 MiB by default; 0 turns bucketing off)."""
    return int(float(os.environ.get(BUCKET_MB_ENV, DEFAULT_BUCKET_MB)) * 2**20)


@dataclass(frozen=True)
class Reduction:
    """A gradient summed over ``group``, then divided by ``divide`` (an average over replicas)."""

    group: object
    divide: int = 1


@dataclass
class Bucketed:
    """One gradient in a bucket: the tensor it was and its version then (to know it still is)."""

    param: nn.Parameter
    grad: torch.Tensor
    version: int
    index: int

    def current(self) -> bool:
        return self.param.grad is self.grad and self.grad._version == self.version


@dataclass
class Bucket:
    """Gradients with the same reductions, dtype and device, flattened into one all-reduce."""

    reductions: tuple[Reduction, ...]
    items: list[Bucketed] = field(default_factory=list)
    nbytes: int = 0
    flat: torch.Tensor | None = None
    mine: torch.Tensor | None = None  # this rank's fingerprint: how many parameters, the sum of their indices + 1
    fingerprint: torch.Tensor | None = None  # every rank's, summed
    works: list = field(default_factory=list)

    def what(self) -> str:
        return f"a bucket of {len(self.items)} gradient sums ({self.nbytes} bytes)"

    def launch(self) -> None:
        """The first reduction started without waiting (the others, rare, run in ``finish``)."""
        self.flat = torch.cat([item.grad.detach().reshape(-1) for item in self.items])
        mine = [len(self.items), sum(item.index + 1 for item in self.items)]
        self.mine = torch.tensor(mine, dtype=torch.int64, device=self.flat.device)
        self.fingerprint = self.mine.clone()  # (summed in place)
        group = self.reductions[0].group
        with collective(self.what):
            self.works = [dist.all_reduce(t, group=group, async_op=True) for t in (self.flat, self.fingerprint)]

    def finish(self) -> None:
        """Wait for the sums, check every rank summed the same gradients, and write them back."""
        with collective(self.what):
            for work in self.works:
                work.wait()
            for reduction in self.reductions[1:]:
                dist.all_reduce(self.flat, group=reduction.group)
                dist.all_reduce(self.fingerprint, group=reduction.group)
        ranks, divide = 1, 1
        for reduction in self.reductions:
            ranks *= dist.get_world_size(reduction.group)
            divide *= reduction.divide
        same = (self.fingerprint == self.mine * ranks).all()
        why = (
            f"hf_parallel: the ranks bucketed different gradients for one sum ({self.what()}; this rank's "
            f"parameters {[item.index for item in self.items]} of the model's summed ones): a gradient hook "
            f"registered on some ranks only, or {BUCKET_MB_ENV} set differently. Register hooks on every rank, "
            f"or set {BUCKET_MB_ENV}=0 (each sum in its own hook)"
        )
        if same.device.type != "cpu":  # on the device: no host sync in the step, loud where it fails
            torch._assert_async(same, ON_DEVICE_MISMATCH)
        elif not same:
            raise RuntimeError(why)
        if divide != 1:
            self.flat /= divide
        offset = 0
        for item in self.items:
            numel = item.grad.numel()
            if item.current():
                item.grad.copy_(self.flat[offset : offset + numel].view_as(item.grad))
            offset += numel


class GradientBuckets:
    """The buckets of the running backward: ``add`` as gradients are ready, ``finish`` at its end."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.open: dict[tuple, Bucket] = {}
        self.launched: list[Bucket] = []
        self.held: dict[int, Bucketed] = {}  # id(parameter) -> its gradient in a bucket not yet written back

    def add(self, param: nn.Parameter, reductions: tuple[Reduction, ...], index: int) -> None:
        """``param.grad`` (accumulated, this rank's alone) to be reduced as ``reductions`` say; ``index``: the
        parameter's place among the summed ones, the same on every rank."""
        grad = param.grad
        item = Bucketed(param, grad, grad._version, index)
        key = (reductions, grad.dtype, grad.device)
        bucket = self.open.setdefault(key, Bucket(reductions))
        bucket.items.append(item)
        bucket.nbytes += grad.numel() * grad.element_size()
        self.held[id(param)] = item
        if bucket.nbytes >= self.capacity:
            self._launch(key)

    def _launch(self, key) -> None:
        bucket = self.open.pop(key)
        bucket.launch()
        self.launched.append(bucket)
        while len(self.launched) > IN_FLIGHT:  # the oldest's copy freed before another is made
            self._write_back(self.launched.pop(0))

    def _write_back(self, bucket: Bucket) -> None:
        for item in bucket.items:
            if self.held.get(id(item.param)) is item:
                del self.held[id(item.param)]
        bucket.finish()

    def finish(self) -> None:
        """Launch the open buckets (in the order opened), then wait for every bucket in launch order."""
        for key in list(self.open):
            self._launch(key)
        launched, self.launched = self.launched, []
        for bucket in launched:
            self._write_back(bucket)
