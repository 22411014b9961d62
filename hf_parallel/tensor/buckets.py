"""Gradient sums in buckets, once the backward is done (DDP's reducer, for the sums TP and SP need).

A parameter every rank of a group holds whole but that saw only part of the data is summed over the
group (``gradients.py``). One all-reduce per parameter is a few hundred collectives of a few KB a step
for TP's replicated norms and biases; here each parameter's hook notes its gradient, and when the
backward is done each group's parameters are concatenated into buckets of up to ``BUCKET_BYTES`` (a
shared-memory slot on CPUs), one all-reduce each, and the sums written back.

- **The same buckets on every rank.** A group's buckets are its parameters in model order (those that
  require a gradient), split by dtype, device and size, whichever of them got a gradient in this
  backward: one that got none here contributes zeros, and a flag per parameter rides in the same
  all-reduce, so a rank that had none learns whether any rank had (only that rank reads the flags back).
- **Exactly what a sum per parameter gave.** Where ``.grad`` held nothing, autograd makes this backward's
  gradient ``.grad`` and the sum replaces it; where it held a gradient (accumulation over micro-batches)
  the hook hands autograd a zero for this backward's share and the sum is added after.
- **Others see sums.** ``torch.autograd.grad`` returns the gradient instead of accumulating it, and a
  parameter with another hook (a tensor hook, or a post-accumulate-grad hook: an optimizer in backward)
  must not see its gradient before the sum: for those the hook sums at once, as a hook per parameter would.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compat.torch import at_end_of_backward, gradient_hooks, will_accumulate
from ..distributed import comm
from ..distributed.shm import channel_for

BUCKET_BYTES = 25 << 20  # DDP's default bucket: large enough to amortise a collective's latency
SUMMED = "summed at once"  # a noted parameter whose hook took its sum itself


def bucket_bytes(group, device: torch.device) -> int:
    """A bucket's size: ``BUCKET_BYTES``, or at most a shared-memory slot where the group's CPU ranks have
    one (a larger payload would go through gloo, far slower on one host than sums in slots)."""
    channel = channel_for(group) if device.type == "cpu" else None
    return BUCKET_BYTES if channel is None else min(BUCKET_BYTES, channel.slot_bytes)


class GradientBuckets:
    """The parameters summed in buckets, by group, and what this backward noted of them."""

    def __init__(self):
        self._members: dict[object, list[nn.Parameter]] = {}  # group -> its parameters, in model order
        self._handles: dict[int, object] = {}  # id(parameter) -> its hook's handle
        self._noted: dict[int, torch.Tensor | str | None] = {}  # id -> its own share, None (.grad is it) or SUMMED

    def add(self, param: nn.Parameter, group) -> bool:
        """Sum ``param``'s gradient over ``group`` in a bucket; False where it cannot be (an inference
        tensor has no gradient accumulator): the caller sums it per parameter."""
        with torch.inference_mode(False), torch.enable_grad():
            grad_fn = param.view_as(param).grad_fn
        if grad_fn is None:
            return False
        accumulator = grad_fn.next_functions[0][0]  # kept alive by the hook, as DDP keeps it

        def hook(grad):
            if not will_accumulate(accumulator) or gradient_hooks(param) > 1:  # they must see the sum
                if not self._noted:
                    at_end_of_backward(self._sum_noted)  # (this rank's buckets still run: every rank's do)
                self._noted[id(param)] = SUMMED
                return comm.all_reduce(grad, group)
            if not self._noted:
                at_end_of_backward(self._sum_noted)
            own = grad if param.grad is not None else None  # else autograd makes this gradient .grad itself
            self._noted[id(param)] = own
            return None if own is None else grad.new_zeros(()).expand_as(grad)

        self._handles[id(param)] = param.register_hook(hook)
        self._members.setdefault(group, []).append(param)
        return True

    def release(self, param: nn.Parameter) -> bool:
        """Take ``param`` out of its bucket (it gets another sum: its sums then run per parameter, in
        order); whether it was in one."""
        handle = self._handles.pop(id(param), None)
        if handle is None:
            return False
        handle.remove()
        for members in self._members.values():
            members[:] = [member for member in members if member is not param]
        return True

    def _sum_noted(self) -> None:
        """The backward is done: every group's buckets summed, in the same order on every rank."""
        noted, self._noted = self._noted, {}
        for group, members in self._members.items():
            for run in _runs([param for param in members if param.requires_grad], group):
                _sum_run(run, group, noted)


def _runs(params: list[nn.Parameter], group):
    """``params`` in buckets: by dtype and device, in order, each within ``bucket_bytes`` (flags included)."""
    by_kind: dict[tuple, list[nn.Parameter]] = {}
    for param in params:
        by_kind.setdefault((param.dtype, param.device), []).append(param)
    for (_, device), same in by_kind.items():
        cap, run, size = bucket_bytes(group, device), [], 0
        for param in same:
            if run and size + param.nbytes + (len(run) + 1) * param.element_size() > cap:
                yield run
                run, size = [], 0
            run.append(param)
            size += param.nbytes
        if run:
            yield run


def _sum_run(run: list[nn.Parameter], group, noted: dict) -> None:
    """One bucket's all-reduce: each parameter's share (zeros where it got none here or was summed at
    once), then one flag per parameter saying whether this rank had a share; the sums written back."""
    own = [noted.get(id(param), SUMMED) for param in run]  # (absent: SUMMED's zeros, flag 0)
    shares = [(param.grad if share is None else share).reshape(-1) if share is not SUMMED else
              param.new_zeros(param.numel()) for param, share in zip(run, own)]  # fmt: skip
    flags = [param.new_full((1,), float(id(param) in noted and share is not SUMMED)) for param, share in zip(run, own)]
    summed = comm.all_reduce(torch.cat(shares + flags), group, consume=True)
    absent = [id(param) not in noted for param in run]
    anywhere = summed[-len(run) :].tolist() if any(absent) else None  # a host read, on a rank that had none
    for i, (param, part) in enumerate(zip(run, summed[: -len(run)].split([param.numel() for param in run]))):
        part = part.view(param.shape)
        if not absent[i] and own[i] is SUMMED:
            continue
        if absent[i] and not anywhere[i]:  # no rank had a gradient for it: it stays as it was
            continue
        if param.grad is None:
            param.grad = part.clone()
        elif own[i] is None:
            param.grad.copy_(part)
        else:  # a share over what .grad held (or none here, where .grad held one already)
            param.grad.add_(part)
