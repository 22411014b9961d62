"""Autograd collectives as Megatron's conjugate pairs, on plain local tensors.

Each function names its forward op and its backward op. With ``group is None`` or one rank every
op is the identity, so the same model code runs as TP=1 in a plain process.

    copy_to         fwd: identity          bwd: all-reduce      (Megatron f)
    reduce_from     fwd: all-reduce        bwd: identity        (Megatron g)
    gather_from     fwd: all-gather(dim)   bwd: split(dim)
    scatter_to      fwd: split(dim)        bwd: all-gather(dim)
    all_reduce_sum  fwd: all-reduce        bwd: all-reduce      (a sum every rank consumes)

Splits and gathers take per-rank ``sizes`` so uneven shards (vocab 49152 over 5 ranks, 9 heads
over 2) need no padding in the caller. Collectives are counted in ``COUNTS`` so tests and
benchmarks can check "two all-reduces per decoder layer" instead of assuming it. Between CPU ranks
of one host the payload travels through shared memory (``shm.py``), otherwise through the group.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from .faults import collective
from .shm import channel_for

COUNTS: Counter = Counter()  # op name -> calls;  op name + ":bytes" -> payload bytes


def _count(op: str, tensor: torch.Tensor) -> None:
    COUNTS[op] += 1
    COUNTS[op + ":bytes"] += tensor.numel() * tensor.element_size()


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _shm(group, x: torch.Tensor):
    """The shared-memory channel to carry ``x`` over ``group``, or None for the group's backend."""
    channel = channel_for(group)
    return channel if channel is not None and channel.fits(x.numel() * x.element_size()) else None


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    _count("all_reduce", x)
    channel = _shm(group, x)
    if channel is not None:
        return channel.all_reduce(x)
    x = x.contiguous().clone()
    with collective(f"all-reduce of {tuple(x.shape)}"):
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int, sizes, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; ``sizes[r]`` is rank r's extent there."""
    if _world(group) == 1:
        return x
    dim = dim % x.dim()
    biggest = max(sizes)
    padded = x
    if x.shape[dim] < biggest:
        pad_shape = list(x.shape)
        pad_shape[dim] = biggest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad_shape)], dim)
    padded = padded.contiguous()
    _count("all_gather", padded)
    channel = _shm(group, padded)
    if channel is not None:
        parts = channel.all_gather(padded)  # views into shared memory, consumed by the cat below
    else:
        parts = [torch.empty_like(padded) for _ in sizes]
        with collective(f"all-gather of {tuple(padded.shape)}"):
            dist.all_gather(parts, padded, group=group)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim)


def split(x: torch.Tensor, dim: int, sizes, group) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (no communication)."""
    if _world(group) == 1:
        return x
    rank = dist.get_rank(group)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.args = (dim, sizes, group)
        return all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, *ctx.args), None, None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.args = (dim, sizes, group)
        return split(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, *ctx.args), None, None, None


def copy_to(x, group):
    """Y = X on every rank; dX = sum_r dY_r. Input of a column-parallel layer."""
    return x if _world(group) == 1 else _CopyTo.apply(x, group)


def reduce_from(x, group):
    """Y = sum_r X_r; dX_r = dY. Output of a row-parallel layer."""
    return x if _world(group) == 1 else _ReduceFrom.apply(x, group)


def all_reduce_sum(x, group):
    """Y = sum_r X_r consumed by every rank's own branch; dX_r = sum_r dY_r."""
    return x if _world(group) == 1 else _AllReduceSum.apply(x, group)


def gather_from(x, dim, sizes, group):
    """Y = [X_1 .. X_p] along dim; dX_r = dY_r."""
    return x if _world(group) == 1 else _GatherFrom.apply(x, dim, tuple(sizes), group)


def scatter_to(x, dim, sizes, group):
    """Y_r = X_r (this rank's piece); dX = [dY_1 .. dY_p]."""
    return x if _world(group) == 1 else _ScatterTo.apply(x, dim, tuple(sizes), group)
