"""Gradient reductions a split computation needs, registered as backward hooks on plain parameters.

A parameter every rank of a group holds whole, but that saw only part of the data on each rank
(its heads, its tokens, its experts' share), must have its gradient summed over that group. A
model keeps one ``GradientSums``: it is the one record of which parameter is summed over which
group, so a parameter summed over TP and over SP gets one hook for each, and never two for one.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import comm
from .layout import Layout


class GradientSums:
    """Which groups each parameter's gradient is summed over, with one backward hook per pair."""

    def __init__(self):
        self._groups: dict[int, set] = {}  # id(parameter) -> the groups its gradient is summed over

    def sum_over(self, param: nn.Parameter, group) -> None:
        """Sum ``param``'s gradient over ``group`` in backward (each rank saw part of the data)."""
        summed = self._groups.setdefault(id(param), set())
        if group is not None and group not in summed:
            param.register_hook(lambda grad: comm.all_reduce(grad, group))
            summed.add(group)


def sum_replicated_pieces(param: nn.Parameter, layout: Layout, rank: int, group) -> None:
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

    param.register_hook(hook)
