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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..compat.torch import FSDP_UNSHARDED_PARAM, check_fsdp_reuses_unsharded_parameters
from ..distributed import comm
from ..core.layout import Layout


class GradientSums:
    """Which groups each parameter's gradient is summed over, with one backward hook per pair."""

    def __init__(self):
        self._sums: dict[int, list[tuple[object, Callable]]] = {}  # id(parameter) -> (group, hook), in order
        self._registered = False
        # mixed precision: FSDP computes with bf16 copies of float32 masters and reduces in float32; the
        # sums here then add in float32 too, rounded to the copy's dtype once
        self.reduce_dtype: torch.dtype | None = None

    def _summed(self, grad: torch.Tensor, group) -> torch.Tensor:
        if self.reduce_dtype is None or grad.dtype == self.reduce_dtype:
            return comm.all_reduce(grad, group)
        return comm.all_reduce(grad.to(self.reduce_dtype), group).to(grad.dtype)

    def sum_over(self, param: nn.Parameter, group) -> None:
        """Sum ``param``'s gradient over ``group`` in backward (each rank saw part of the data)."""
        if self._new(param, group):
            self._add(param, group, lambda grad: self._summed(grad, group))

    def average_over(self, param: nn.Parameter, group) -> None:
        """Average ``param``'s gradient over ``group``: a parameter FSDP does not manage (an adapter
        added after loading), replicated on the data-parallel replicas, as FSDP averages its own."""
        if self._new(param, group):
            size = torch.distributed.get_world_size(group)
            self._add(param, group, lambda grad: self._summed(grad, group) / size)

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
            summed = self._summed(torch.cat([grad.narrow(layout.dim, o, n) for o, n in shared], layout.dim), group)
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
        """Every recorded sum on ``model``'s parameters (no FSDP)."""
        self._registered = True
        for param in model.parameters():
            if param.device.type == "meta":  # a kept quantized weight's placeholder (inference only: no gradient)
                continue
            for _, hook in self._sums.get(id(param), ()):
                param.register_hook(hook)

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
