"""Gradient reductions a split computation needs, registered as backward hooks on plain parameters.

A parameter every rank of a group holds whole, but that saw only part of the data on each rank
(its heads, its tokens, its experts' share), must have its gradient summed over that group. A
model keeps one ``GradientSums``: it is the one record of which parameter is summed over which
group, so a parameter summed over TP and over SP gets one hook for each, and never two for one.

The TP styles and the sequence split only record; ``register`` puts the hooks on, once, after the
data-parallel step. Without FSDP, a whole-tensor sum waits until autograd has accumulated the
gradient and goes into a bucket that is all-reduced while backward goes on (``distributed/buckets.py``),
all of them waited once at the end of the backward; ``deferring`` (``train_step``'s micro-batches but
the last) leaves the sums to the last backward, which then sums the accumulated gradient once. A
gradient that already held a sum before this backward (accumulation outside ``train_step``) is summed
in its hook, blocking, as is one ``autograd.grad`` hands back, one someone hooked after the sums (an
optimizer stepping in backward), and a sum of some rows only (a replicated KV head's). Under FSDP2 the hooks go
on the unsharded parameters FSDP computes with (it creates each at the first all-gather and keeps it),
blocking, leaving out the sums FSDP's own reduce-scatter does (the sequence group, folded into the FSDP
group). Sums recorded after that (adapters placed at first use) are registered at once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

from ..compat.torch import (
    FSDP_UNSHARDED_PARAM,
    at_backward_end,
    check_fsdp_reuses_unsharded_parameters,
    current_backward,
    grad_accumulator,
    hook_counts,
    will_accumulate,
)
from ..distributed import comm
from ..distributed.buckets import BUCKET_MB_ENV, GradientBuckets, Reduction, bucket_bytes
from ..core.layout import Layout


class GradientSums:
    """Which groups each parameter's gradient is summed over, with one backward hook per pair."""

    def __init__(self):
        # id(parameter) -> (group, blocking hook, its bucketed reduction or None: some rows only), in order
        self._sums: dict[int, list[tuple[object, Callable, Reduction | None]]] = {}
        self._registered = False
        # mixed precision: FSDP computes with bf16 copies of float32 masters and reduces in float32; the
        # sums here then add in float32 too, rounded to the copy's dtype once
        self.reduce_dtype: torch.dtype | None = None
        self._buckets = GradientBuckets(bucket_bytes()) if bucket_bytes() > 0 else None
        self._deferring = False
        self._window: dict[int, nn.Parameter] = {}  # accumulated since a fresh start, unsummed (deferred)
        self._pending: set[int] = set()  # to be bucketed once accumulated, in this backward
        self._finishing = None  # the backward whose end waits for the buckets
        self._hooks: dict[int, tuple[int, int]] = {}  # id(parameter) -> its hook counts once ours were on
        self._accumulators: dict[int, object] = {}  # id(parameter) -> the autograd node accumulating its .grad
        self._index: dict[int, int] = {}  # id(parameter) -> its place among the bucketed ones (every rank's same)

    def _summed(self, grad: torch.Tensor, group) -> torch.Tensor:
        if self.reduce_dtype is None or grad.dtype == self.reduce_dtype:
            return comm.all_reduce(grad, group)
        return comm.all_reduce(grad.to(self.reduce_dtype), group).to(grad.dtype)

    def sum_over(self, param: nn.Parameter, group) -> None:
        """Sum ``param``'s gradient over ``group`` in backward (each rank saw part of the data)."""
        if self._new(param, group):
            self._add(param, group, lambda grad: self._summed(grad, group), Reduction(group))

    def average_over(self, param: nn.Parameter, group) -> None:
        """Average ``param``'s gradient over ``group``: a parameter FSDP does not manage (an adapter
        added after loading), replicated on the data-parallel replicas, as FSDP averages its own."""
        if self._new(param, group):
            size = torch.distributed.get_world_size(group)
            self._add(param, group, lambda grad: self._summed(grad, group) / size, Reduction(group, size))

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

        self._add(param, None, hook, None)

    def _new(self, param: nn.Parameter, group) -> bool:
        """Whether ``group`` is a group and ``param`` has no sum over it yet."""
        return group is not None and all(g is not group for g, _, _ in self._sums.get(id(param), ()))

    def _add(self, param: nn.Parameter, group, hook: Callable, reduction: Reduction | None) -> None:
        self._sums.setdefault(id(param), []).append((group, hook, reduction))
        if self._registered:  # (an adapter placed after the load: its own hooks, each blocking)
            param.register_hook(hook)

    def register(self, model: nn.Module) -> None:
        """Every recorded sum on ``model``'s parameters (no FSDP): rows blocking in the hook, whole
        tensors bucketed (blocking too with ``HF_PARALLEL_GRADIENT_BUCKET_MB=0``)."""
        self._registered = True
        for param in model.parameters():
            if param.device.type == "meta":  # a kept quantized weight's placeholder (inference only: no gradient)
                continue
            sums = self._sums.get(id(param), ())
            whole = tuple(reduction for _, _, reduction in sums if reduction is not None)
            for _, hook, reduction in sums:
                if reduction is None or self._buckets is None:
                    param.register_hook(hook)
            if whole and self._buckets is not None:
                blocking = [hook for _, hook, reduction in sums if reduction is not None]
                param.register_hook(functools.partial(self._before_accumulation, param, blocking))
                param.register_post_accumulate_grad_hook(functools.partial(self._after_accumulation, whole))
                self._hooks[id(param)] = hook_counts(param)
                self._accumulators[id(param)] = grad_accumulator(param)
                self._index[id(param)] = len(self._index)

    def _before_accumulation(self, param: nn.Parameter, blocking: list[Callable], grad: torch.Tensor):
        """A gradient about to accumulate: left for the bucket where ``.grad`` holds no sum yet (none, or
        only this rank's since a deferred start) and no hook registered since ours would read it before
        the sum (an optimizer stepping in backward), else summed now."""
        key = id(param)
        held = self._buckets.held.get(key)
        if held is not None and held.current():  # a second gradient in one backward (used in and out of a
            raise RuntimeError(  # reentrant checkpoint): the first is still being summed in place
                f"hf_parallel: a parameter of shape {tuple(param.shape)} got a second gradient in one backward while "
                f"its first was being summed in a bucket (or a backward that raised left it, and the gradients were "
                f"not zeroed since); set {BUCKET_MB_ENV}=0 (each sum in its own hook)"
            )
        hooked_since = hook_counts(param) != self._hooks[key]
        accumulated = will_accumulate(self._accumulators[key])  # (autograd.grad hands the gradient back: sum now)
        later = accumulated and not hooked_since and not torch.is_grad_enabled()  # (create_graph: keep the graph)
        if (param.grad is None or key in self._window) and later:
            if self._deferring:
                self._window[key] = param
            else:
                self._pending.add(key)
            return grad
        self._pending.discard(key)  # (left by a backward that raised before its end)
        for hook in blocking:
            grad = hook(grad)
        return grad

    def _after_accumulation(self, reductions: tuple[Reduction, ...], param: nn.Parameter) -> None:
        key = id(param)
        if key not in self._pending:
            return
        self._pending.discard(key)
        self._window.pop(key, None)
        backward = current_backward()
        if self._finishing != backward:  # at the end of this backward (a nested one its own): wait for them all
            self._finishing = backward
            at_backward_end(self._finish)
        self._buckets.add(param, reductions, self._index[key])

    def _finish(self) -> None:
        """Every bucket waited and written back (those a backward that raised left: waited, and written
        back only into a gradient nothing has changed since)."""
        self._finishing = None
        self._buckets.finish()

    @contextlib.contextmanager
    def deferring(self):
        """Backward passes whose whole-tensor sums wait for the next backward outside the block (the
        micro-batches of one step but the last): their gradients accumulate unsummed, and that backward
        sums each once."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def flush(self) -> None:
        """Sum what a deferred backward left unsummed and the last backward did not reach (a parameter
        the last micro-batch did not use), in the order they were first reached: the same on every rank."""
        if self._window:
            left, self._window = list(self._window.values()), {}
            for param in left:
                reductions = tuple(r for _, _, r in self._sums.get(id(param), ()) if r is not None)
                self._buckets.add(param, reductions, self._index[id(param)])
            self._buckets.finish()

    def register_under_fsdp(self, model: nn.Module, names: dict[int, str], done_by_fsdp) -> None:
        """Every recorded sum on the parameters FSDP2 computes with. ``names``: id of each
        parameter before ``fully_shard`` -> its name; sums over ``done_by_fsdp`` (a group) are left
        to FSDP. FSDP creates a module's unsharded parameter at its first all-gather and keeps it, so
        a forward pre-hook (after FSDP's own, which all-gathers) hooks each one once."""
        check_fsdp_reuses_unsharded_parameters()
        self._registered = True
        by_owner: dict[nn.Module, list[tuple[str, list[Callable]]]] = {}
        for key, sums in self._sums.items():
            hooks = [hook for group, hook, _ in sums if done_by_fsdp is None or group is not done_by_fsdp]
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
