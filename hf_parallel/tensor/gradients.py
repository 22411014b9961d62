"""Gradient reductions a split computation needs, registered as backward hooks on plain parameters.

A parameter every rank of a group holds whole, but that saw only part of the data on each rank
(its heads, its tokens, its experts' share), must have its gradient summed over that group. A
model keeps one ``GradientSums``: it is the one record of which parameter is summed over which
group, so a parameter summed over TP and over SP gets one hook for each, and never two for one.

The TP styles and the sequence split only record; ``register`` puts the hooks on, once, after the
data-parallel step: on the parameters themselves, or, under FSDP2, on the unsharded parameters
FSDP computes with (it creates each at the first all-gather and keeps it), leaving out the sums
FSDP's own reduce-scatter does (the sequence group, folded into the FSDP group). Sums recorded after
that (adapters placed at first use) are registered at once.

Without FSDP, a parameter summed over one group is summed in a bucket (DDP's reducer): its hook notes
the gradient, and when the backward is done the gradients of each group are concatenated into buffers of
up to ``BUCKET_BYTES`` (a shared-memory slot on CPUs), one all-reduce each, in the parameters' order
(the same on every rank), and the sums written back. TP's replicated norms and biases, a few hundred
tensors of a few KB, are then one or two collectives instead of one each. ``.grad`` holds exactly what a
sum per parameter gave: when it already held a gradient (accumulation over micro-batches) the hook hands
autograd a zero for this backward's share and the sum is added after. ``torch.autograd.grad`` returns
the gradient instead of accumulating it, so there the hook sums at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..compat.torch import (
    FSDP_UNSHARDED_PARAM,
    at_end_of_backward,
    check_fsdp_reuses_unsharded_parameters,
    will_accumulate,
)
from ..distributed import comm
from ..distributed.shm import channel_for
from .layout import Layout

BUCKET_BYTES = 25 << 20  # DDP's default bucket: large enough to amortise a collective's latency


def _bucket_bytes(group, device: torch.device) -> int:
    """A bucket's size: ``BUCKET_BYTES``, or at most a shared-memory slot where the group's CPU ranks have
    one (a larger payload would go through gloo, far slower on one host than per-parameter sums in slots)."""
    channel = channel_for(group) if device.type == "cpu" else None
    return BUCKET_BYTES if channel is None else min(BUCKET_BYTES, channel.slot_bytes)


class GradientSums:
    """Which groups each parameter's gradient is summed over, with one backward hook per pair."""

    def __init__(self):
        self._sums: dict[int, list[tuple[object, Callable]]] = {}  # id(parameter) -> (group, hook), in order
        self._plain: set[tuple[int, object]] = set()  # (id(parameter), group) of the plain sums (bucketable)
        self._registered = False
        self._noted: list[tuple[int, nn.Parameter, object, torch.Tensor | None]] = []  # this backward's, to sum

    def sum_over(self, param: nn.Parameter, group) -> None:
        """Sum ``param``'s gradient over ``group`` in backward (each rank saw part of the data)."""
        if self._new(param, group):
            self._plain.add((id(param), group))
            self._add(param, group, lambda grad: comm.all_reduce(grad, group))

    def average_over(self, param: nn.Parameter, group) -> None:
        """Average ``param``'s gradient over ``group``: a parameter FSDP does not manage (an adapter
        added after loading), replicated on the data-parallel replicas, as FSDP averages its own."""
        if self._new(param, group):
            size = torch.distributed.get_world_size(group)
            self._add(param, group, lambda grad: comm.all_reduce(grad, group) / size)

    def sum_pieces(self, param: nn.Parameter, layout: Layout, rank: int, group) -> None:
        """Sum, over the ranks sharing them, the gradient rows of pieces held by several ranks
        (a replicated KV head: each replica saw only its share of the query heads)."""
        counts = layout.replica_counts(rank)
        if group is None or layout.dim is None or max(counts, default=1) == 1:
            return
        offsets = [sum(stop - start for start, stop in layout.ranges[rank][:i]) for i in range(len(counts))]
        shared = [
            (offset, stop - start)
            for offset, (start, stop), count in zip(offsets, layout.ranges[rank], counts)
            if count > 1
        ]

        def hook(grad):
            grad = grad.clone()
            summed = comm.all_reduce(torch.cat([grad.narrow(layout.dim, o, n) for o, n in shared], layout.dim), group)
            done = 0
            for offset, length in shared:
                grad.narrow(layout.dim, offset, length).copy_(summed.narrow(layout.dim, done, length))
                done += length
            return grad

        self._add(param, None, hook)

    def _new(self, param: nn.Parameter, group) -> bool:
        """Whether ``group`` is a group and ``param`` has no sum over it yet."""
        return group is not None and all(g is not group for g, _ in self._sums.get(id(param), ()))

    def _add(self, param: nn.Parameter, group, hook: Callable) -> None:
        self._sums.setdefault(id(param), []).append((group, hook))
        if self._registered:
            param.register_hook(hook)

    def register(self, model: nn.Module) -> None:
        """Every recorded sum on ``model``'s parameters (no FSDP); a parameter with one plain sum is
        summed in a bucket."""
        self._registered = True
        for order, param in enumerate(model.parameters()):
            if param.device.type == "meta":  # a kept quantized weight's placeholder (inference only: no gradient)
                continue
            sums = self._sums.get(id(param), ())
            if len(sums) == 1 and (id(param), sums[0][0]) in self._plain and param.requires_grad:
                param.register_hook(self._noting(order, param, sums[0][0]))
                continue
            for _, hook in sums:
                param.register_hook(hook)

    def _noting(self, order: int, param: nn.Parameter, group) -> Callable:
        """The hook that notes ``param``'s gradient for its group's bucket (see the module's docstring)."""
        with torch.enable_grad():
            accumulator = param.view_as(param).grad_fn.next_functions[0][0]  # kept alive, as DDP keeps it

        def hook(grad):
            if not will_accumulate(accumulator):  # torch.autograd.grad: what it returns must be the sum
                return comm.all_reduce(grad, group)
            if not self._noted:
                at_end_of_backward(self._sum_noted)
            own = grad if param.grad is not None else None  # else autograd makes this gradient .grad itself
            self._noted.append((order, param, group, own))
            return None if own is None else grad.new_zeros(()).expand_as(grad)

        return hook

    def _sum_noted(self) -> None:
        """The backward is done: every noted gradient summed over its group, a bucket at a time."""
        noted, self._noted = sorted(self._noted, key=lambda entry: entry[0]), []
        buckets: dict[tuple, list[list]] = {}  # (group, dtype, device) -> buckets of (param, gradient, adds)
        filled: dict[tuple, int] = {}  # the same key -> bytes in its last bucket
        for _, param, group, own in noted:
            grad = param.grad if own is None else own
            key = (group, grad.dtype, grad.device)
            runs = buckets.setdefault(key, [[]])
            if runs[-1] and filled[key] + grad.nbytes > _bucket_bytes(group, grad.device):
                runs.append([])
                filled[key] = 0
            runs[-1].append((param, grad, own is not None))
            filled[key] = filled.get(key, 0) + grad.nbytes
        for (group, _, _), runs in buckets.items():
            for run in runs:
                summed = comm.all_reduce(torch.cat([grad.reshape(-1) for _, grad, _ in run]), group, consume=True)
                for (param, grad, adds), part in zip(run, summed.split([grad.numel() for _, grad, _ in run])):
                    part = part.view(grad.shape)
                    param.grad.add_(part) if adds else param.grad.copy_(part)

    def register_under_fsdp(self, model: nn.Module, names: dict[int, str], done_by_fsdp) -> None:
        """Every recorded sum on the parameters FSDP2 computes with. ``names``: id of each
        parameter before ``fully_shard`` -> its name; sums over ``done_by_fsdp`` (a group) are left
        to FSDP. FSDP creates a module's unsharded parameter at its first all-gather and keeps it, so
        a forward pre-hook (after FSDP's own, which all-gathers) hooks each one once."""
        check_fsdp_reuses_unsharded_parameters()
        self._registered = True
        by_owner: dict[nn.Module, list[tuple[str, list[Callable]]]] = {}
        for key, sums in self._sums.items():
            hooks = [hook for group, hook in sums if done_by_fsdp is None or group is not done_by_fsdp]
            if hooks and key in names:
                owner, _, attr = names[key].rpartition(".")
                by_owner.setdefault(model.get_submodule(owner), []).append((attr, hooks))
        self._sums = {}
        hooked: dict[tuple[int, str], nn.Parameter] = {}  # (module, attribute) -> the parameter hooked

        def pre_forward(module, args):
            for attr, hooks in by_owner[module]:
                param, before = getattr(module, attr), hooked.get((id(module), attr))
                if before is None and param.requires_grad:
                    hooked[id(module), attr] = param
                    for hook in hooks:
                        param.register_hook(hook)
                elif before is not None and param is not before:  # its gradient would miss the sums
                    raise FSDP_UNSHARDED_PARAM.fail(f"made a second unsharded parameter for {attr} of {module}")

        for owner in by_owner:
            owner.register_forward_pre_hook(pre_forward)
