"""Autograd collectives as Megatron's conjugate pairs, on plain local tensors.

Each function names its forward op and its backward op. With ``group is None`` or one rank every
op is the identity, so the same model code runs as TP=1 in a plain process.

    copy_to         fwd: identity          bwd: all-reduce      (Megatron f)
    reduce_from     fwd: all-reduce        bwd: identity        (Megatron g)
    gather_from     fwd: all-gather(dim)   bwd: split(dim)
    scatter_to      fwd: split(dim)        bwd: all-gather(dim)
    all_reduce_sum  fwd: all-reduce        bwd: all-reduce      (a sum every rank consumes)
    all_to_all      fwd: split(a) -> exchange -> cat(b)    bwd: the same with a and b swapped
                    (Ulysses: a = heads, b = sequence turns [seq/sp, heads] into [seq, heads/sp])
    gather_to_use   fwd: all-gather(dim)   bwd: refused         (inference: full logits of a split sequence)

``scatter_to`` takes a gradient scale: a split of an input every rank computed alike, whose
parameters' gradients are then summed over the group, passes back ``1/p`` of the gathered gradient.
A nested batch goes from a group's first rank to the others in ``batch.py``.

Splits and gathers take per-rank ``sizes`` so uneven shards (vocab 49152 over 5 ranks, 9 heads
over 2) need no padding in the caller. Collectives are counted in ``COUNTS`` so tests and
benchmarks can check "two all-reduces per decoder layer" instead of assuming it. Between CPU ranks
of one host the payload travels through shared memory (``shm.py``), otherwise through the group.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import torch
import torch.distributed as dist

from .devices import metadata_device
from .faults import collective
from .headers import DTYPES, header_of
from .ops import exchanged_shape, group_named  # (importing ops defines the collectives as torch ops)
from .shm import channel_for

COUNTS: Counter = Counter()  # op name -> calls;  op name + ":bytes" -> payload bytes


def _count(op: str, tensor: torch.Tensor) -> None:
    COUNTS[op] += 1
    COUNTS[op + ":bytes"] += tensor.numel() * tensor.element_size()


class Membership(NamedTuple):
    size: int
    rank: int  # this rank's index in the group
    backend: str


_MEMBERSHIP: dict = {}  # process group -> its Membership


def _membership(group) -> Membership:
    """A group's size, this rank's index and its backend, asked of torch once per group: a decoded
    token runs a few thousand collectives' worth of such questions, and each goes through torch's
    Python layers."""
    known = _MEMBERSHIP.get(group)
    if known is None:
        known = Membership(dist.get_world_size(group), dist.get_rank(group), str(dist.get_backend(group)))
        _MEMBERSHIP[group] = known
    return known


def _world(group) -> int:
    return 1 if group is None else _membership(group).size


def _rank(group) -> int:
    return 0 if group is None else _membership(group).rank


def _shm(group, x: torch.Tensor):
    """The shared-memory channel to carry ``x`` over ``group``, or None for the group's backend."""
    channel = channel_for(group)
    return channel if channel is not None and channel.fits(x.numel() * x.element_size()) else None


def _compiling() -> bool:
    """Traced by ``torch.compile``: collectives go in the graph as ``ops.py``'s ops."""
    return torch.compiler.is_compiling()


def all_reduce(x: torch.Tensor, group, *, consume: bool = False) -> torch.Tensor:
    """The sum of every rank's ``x``. ``consume``: the caller never reads ``x`` again (a layer's
    fresh output, outside autograd), so the sum is written into it instead of a copy."""
    if _world(group) == 1:
        return x
    if _compiling():  # a functional op: the compiler owns the buffers
        return torch.ops.hf_parallel.all_reduce(x, group.group_name)
    return all_reduce_now(x, group, consume)


def all_reduce_now(x: torch.Tensor, group, consume: bool = False) -> torch.Tensor:
    """The sum over ``group``, run now (``all_reduce``'s eager transport; the op's implementation)."""
    _count("all_reduce", x)
    channel = _shm(group, x)
    if channel is not None:
        return channel.all_reduce(x, into=x if consume and x.is_contiguous() else None)
    x = x.contiguous() if consume else x.clone(memory_format=torch.contiguous_format)
    with collective(lambda: f"all-reduce of {tuple(x.shape)}"):
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int, sizes, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; ``sizes[r]`` is rank r's extent there."""
    if _world(group) == 1:
        return x
    if _compiling():
        return torch.ops.hf_parallel.all_gather(x, dim % x.dim(), list(sizes), group.group_name)
    return all_gather_now(x, dim, sizes, group)


def all_gather_now(x: torch.Tensor, dim: int, sizes, group) -> torch.Tensor:
    """``all_gather``'s eager transport (the op's implementation)."""
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
    else:  # one buffer, every rank's piece after the other along dim 0
        gathered = padded.new_empty((len(sizes) * padded.shape[0], *padded.shape[1:]))
        with collective(lambda: f"all-gather of {tuple(padded.shape)}"):
            dist.all_gather_into_tensor(gathered, padded, group=group)
        if dim == 0 and min(sizes) == biggest:
            return gathered  # the result itself: no copy
        parts = gathered.chunk(len(sizes))
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim)


def split(x: torch.Tensor, dim: int, sizes, group) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (no communication)."""
    if _world(group) == 1:
        return x
    rank = _rank(group)
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
    def forward(ctx, x, dim, sizes, group, grad_scale):
        ctx.args, ctx.grad_scale = (dim, sizes, group), grad_scale
        return split(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        full = all_gather(grad.contiguous(), *ctx.args)
        return (full if ctx.grad_scale == 1 else full * ctx.grad_scale), None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, split_sizes, cat_sizes, group, peak):
        ctx.args = (cat_dim, split_dim, cat_sizes, split_sizes, group, peak)
        return all_to_all_raw(x, split_dim, cat_dim, split_sizes, cat_sizes, group, peak)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_raw(grad.contiguous(), *ctx.args), None, None, None, None, None, None


def all_to_all_raw(x, split_dim: int, cat_dim: int, split_sizes, cat_sizes, group, peak=None) -> torch.Tensor:
    if _compiling():
        if split_dim == cat_dim:
            raise RuntimeError("hf_parallel: a compiled all-to-all exchanges along two dims (Ulysses), not rows")
        return torch.ops.hf_parallel.all_to_all(
            x, split_dim, cat_dim, list(split_sizes), list(cat_sizes), _rank(group), group.group_name
        )
    return all_to_all_now(x, split_dim, cat_dim, split_sizes, cat_sizes, group, peak)


def all_to_all_now(x, split_dim: int, cat_dim: int, split_sizes, cat_sizes, group, peak=None) -> torch.Tensor:
    """``all_to_all``'s eager transport (the op's implementation). ``peak``: an exchange of rows
    (``split_dim == cat_dim``) whose sizes differ per pair of ranks gives the most rows any rank sends
    any other, the same on every rank (each rank alone knows only its own sends and receives)."""
    rank = _rank(group)
    channel = channel_for(group) if x.device.type == "cpu" else None
    if channel is not None:  # straight from x's pieces into the output's, through shared memory
        out = x.new_empty(exchanged_shape(x.shape, split_dim, cat_dim, split_sizes[rank], sum(cat_sizes)))
        sends = list(x.split(list(split_sizes), split_dim))
        _count("all_to_all", x)
        if split_dim % x.dim() == cat_dim % x.dim():  # rows: the largest piece is ``peak`` rows
            largest = x.element_size() * math.prod(x.shape[1:]) * peak
        else:
            row = x.element_size() * math.prod(x.shape) // (x.shape[split_dim] * x.shape[cat_dim] or 1)
            largest = row * max(split_sizes) * max(cat_sizes)  # the largest piece between any two ranks
        channel.all_to_all(sends, list(out.split(list(cat_sizes), cat_dim)), largest)
        return out
    # The split dim first: each rank's piece is then one run of the buffer, sent as it lies (a copy
    # only when the split dim does not lead already: Ulysses' heads of a one-sequence batch do).
    split_dim, cat_dim = split_dim % x.dim(), cat_dim % x.dim()
    send = x.movedim(split_dim, 0).contiguous()
    row = math.prod(send.shape[1:])
    at = cat_dim + 1 if cat_dim < split_dim else cat_dim  # the cat dim's place with the split dim first
    arriving = [exchanged_shape(send.shape, 0, at, split_sizes[rank], size) for size in cat_sizes]
    counts = [math.prod(shape) for shape in arriving]
    recv = send.new_empty(sum(counts))
    _count("all_to_all", send)
    with collective(lambda: f"all-to-all of {tuple(x.shape)} split along {split_dim}"):
        dist.all_to_all_single(recv, send.view(-1), counts, [size * row for size in split_sizes], group=group)
    pieces = [part.view(shape).movedim(0, split_dim) for part, shape in zip(recv.split(counts), arriving)]
    return torch.cat(pieces, cat_dim)  # the exchange's one transposing copy, into the output's layout


class _GatherToUse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        return all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "hf_parallel: backward through the gathered outputs of a sequence-parallel forward is not supported; "
            "pass labels= to the model for its sequence-parallel loss"
        )


def _direct(x: torch.Tensor) -> bool:
    """No gradient can reach ``x``: the forward op alone, without autograd's bookkeeping, which
    each of a decoded token's ~100 calls would otherwise pay."""
    return not (x.requires_grad and torch.is_grad_enabled())


def copy_to(x, group):
    """Y = X on every rank; dX = sum_r dY_r. Input of a column-parallel layer."""
    return x if _world(group) == 1 or _direct(x) else _CopyTo.apply(x, group)


def reduce_from(x, group):
    """Y = sum_r X_r; dX_r = dY. Output of a row-parallel layer: ``x`` is the caller's to give up
    (outside autograd the sum is written into it)."""
    if _world(group) == 1:
        return x
    return all_reduce(x, group, consume=True) if _direct(x) else _ReduceFrom.apply(x, group)


def all_reduce_sum(x, group):
    """Y = sum_r X_r consumed by every rank's own branch; dX_r = sum_r dY_r. As ``reduce_from``,
    ``x`` is given up."""
    if _world(group) == 1:
        return x
    return all_reduce(x, group, consume=True) if _direct(x) else _AllReduceSum.apply(x, group)


def gather_from(x, dim, sizes, group):
    """Y = [X_1 .. X_p] along dim; dX_r = dY_r."""
    if _world(group) == 1:
        return x
    return all_gather(x, dim, sizes, group) if _direct(x) else _GatherFrom.apply(x, dim, tuple(sizes), group)


def scatter_to(x, dim, sizes, group, grad_scale: float = 1.0):
    """Y_r = X_r (this rank's piece); dX = grad_scale * [dY_1 .. dY_p]."""
    if _world(group) == 1:
        return x
    return split(x, dim, sizes, group) if _direct(x) else _ScatterTo.apply(x, dim, tuple(sizes), group, grad_scale)


def all_to_all(x, split_dim: int, cat_dim: int, split_sizes, cat_sizes, group, peak: int | None = None):
    """Y = cat_i(piece of X_i for this rank) along cat_dim, where X_i is split along split_dim by
    ``split_sizes`` (one piece per rank) and ``cat_sizes[i]`` is X_i's extent along cat_dim.
    dX = the same exchange of dY with the dims and sizes swapped (the exact inverse). An exchange of
    rows (``split_dim == cat_dim``, sizes per pair of ranks) gives ``peak`` (``all_to_all_now``)."""
    if _world(group) == 1:
        return x
    if (split_dim == cat_dim) != (peak is not None):
        raise ValueError("all_to_all: an exchange of rows (split_dim == cat_dim), and only one, gives its peak")
    if _direct(x):
        return all_to_all_raw(x, split_dim, cat_dim, split_sizes, cat_sizes, group, peak)
    return _AllToAll.apply(x, split_dim, cat_dim, tuple(split_sizes), tuple(cat_sizes), group, peak)


def gather_to_use(x, dim, sizes, group):
    """Y = [X_1 .. X_p] along dim, for use without gradients (backward is refused with a reason)."""
    if _world(group) == 1:
        return x
    return all_gather(x, dim, sizes, group) if _direct(x) else _GatherToUse.apply(x, dim, tuple(sizes), group)


def broadcast_now(x: torch.Tensor, group) -> torch.Tensor:
    """The group's first rank's ``x`` on every rank, as a new contiguous tensor, each rank passing the
    tensor it expects (a compiled forward's batch: each rank traced its graph with its own shapes).
    Every rank's description is gathered first, so a rank whose shape or dtype differs from the first
    rank's makes every rank raise, naming both, before any byte is read into the wrong shape."""
    header = header_of(x, metadata_device(_membership(group).backend, x.device))  # on the host where the group can
    headers = all_gather_now(header.unsqueeze(0), 0, [1] * _world(group), group)
    for rank, other in enumerate(headers):
        if not torch.equal(other, headers[0]):
            raise ValueError(
                f"hf_parallel: the ranks of a sequence-parallel group called the compiled forward with different "
                f"batches: the first rank's tensor is {_described(headers[0])}, rank {rank}'s {_described(other)}"
            )
    mine = _rank(group) == 0
    out = x.clone(memory_format=torch.contiguous_format) if mine else None
    channel = channel_for(group) if x.device.type == "cpu" else None
    received = None if channel is None else channel.broadcast(out, 0, "broadcasting a batch tensor")
    if received is not None:  # the first rank's own copy, a new tensor elsewhere
        return received
    out = out if mine else torch.empty_like(x, memory_format=torch.contiguous_format)
    with collective(lambda: f"broadcasting a batch tensor of {tuple(x.shape)}"):
        dist.broadcast(out, src=dist.get_global_rank(group, 0), group=group)
    return out


def _described(header: torch.Tensor) -> str:
    dtype, ndim, *shape = header.tolist()
    return f"{DTYPES[dtype]} of shape {tuple(shape[:ndim])}"


class Shifting:
    """A ring shift under way (``shift_async``): ``wait()`` gives what arrived."""

    def __init__(self, work, sent: torch.Tensor, arrived: torch.Tensor, what: str):
        self._work, self._sent, self._arrived, self._what = work, sent, arrived, what

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with collective(lambda: self._what):
                self._work.wait()
            self._work = self._sent = None
        return self._arrived


def shift_async(x: torch.Tensor, group, step: int) -> Shifting:
    """Rank r's ``x`` on its way to rank r + step of the group (around the ring), while the caller
    computes. One all-to-all in which each rank sends to one rank and receives from one: a collective,
    so every rank of the ring runs the same exchanges in the same order (no point-to-point pairing to
    get right under NCCL's rules)."""
    world = _world(group)
    if world == 1:
        return Shifting(None, x, x, "")
    rank = _rank(group)
    to, source = (rank + step) % world, (rank - step) % world
    sent = x.contiguous().reshape(-1)
    ins = [sent.numel() if r == source else 0 for r in range(world)]
    outs = [sent.numel() if r == to else 0 for r in range(world)]
    what = f"ring shift of {tuple(x.shape)} to rank {to} of the ring"
    if _compiling():  # one op in the graph, done when it returns
        return Shifting(None, sent, torch.ops.hf_parallel.ring_shift(x, step, group.group_name), what)
    _count("ring_shift", sent)
    arrived = torch.empty_like(sent)
    with collective(lambda: what):
        work = dist.all_to_all_single(arrived, sent, ins, outs, group=group, async_op=True)
    return Shifting(work, sent, arrived.view(x.shape), what)


def shift(x: torch.Tensor, group, step: int) -> torch.Tensor:
    """``shift_async``, waited for."""
    return shift_async(x, group, step).wait()


# the ops' eager implementations: the transports above (a compiled graph calls them through the dispatcher)
@torch.library.impl("hf_parallel::all_reduce", "CompositeExplicitAutograd")
def _all_reduce(x, group):
    return all_reduce_now(x, group_named(group))


@torch.library.impl("hf_parallel::all_gather", "CompositeExplicitAutograd")
def _all_gather(x, dim, sizes, group):
    return all_gather_now(x, dim, sizes, group_named(group))


@torch.library.impl("hf_parallel::all_to_all", "CompositeExplicitAutograd")
def _all_to_all(x, split_dim, cat_dim, split_sizes, cat_sizes, rank, group):
    process_group = group_named(group)
    if torch.distributed.get_rank(process_group) != rank:  # the rank the graph was traced (and shaped) for
        raise RuntimeError(f"hf_parallel: an all-to-all traced for rank {rank} of group {group!r} ran elsewhere")
    return all_to_all_now(x, split_dim, cat_dim, split_sizes, cat_sizes, process_group)


@torch.library.impl("hf_parallel::ring_shift", "CompositeExplicitAutograd")
def _ring_shift(x, step, group):
    out = shift(x, group_named(group), step)
    return out.clone() if out is x else out  # (an op's output never aliases its input: a ring of one)


@torch.library.impl("hf_parallel::broadcast", "CompositeExplicitAutograd")
def _broadcast(x, group):
    return broadcast_now(x, group_named(group))  # a new tensor: an op's output never aliases its input
