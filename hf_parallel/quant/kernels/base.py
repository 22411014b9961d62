"""What a kept linear's kernel is (``LinearKernel``): an object made for one kept weight (a ``KeptWeight``: its
boxes as stored, its local shape and compute dtype) that answers whether it can serve that weight on its device
and dtype (``can_serve``: yes, or the reason why not), prepares what it multiplies from (packs, boxes, launch
plans, scales) and computes the product without the bias (``apply``). ``kept_linear.choose_kernel`` tries them in
one order; the dequantizing fallback (``DequantizedKernel``) serves any weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KERNEL_ROWS = 64  # the largest batch a kernel takes; more rows take the dequantized product


class Refused(Exception):
    """Raised by a kernel's preparation where the weight turns out not to fit after ``can_serve`` said yes (a
    box whose groups the format's scales do not hold): the chooser tries the next kernel, naming the reason."""


class LinearKernel:
    """A way to multiply by one kept weight. ``way``: how it multiplies, as ``kept.kept_products`` counts it
    (the CLI's closing line); ``packs``: what it holds repacked beside the stored bytes (``int4_copy_nbytes``)."""

    way = ""
    packs: tuple | list = ()

    def __init__(self, weight):
        self.weight = weight

    @classmethod
    def can_serve(cls, weight) -> tuple[bool, str]:
        """Whether this kernel multiplies by ``weight`` on its device in its dtype, and where not, why."""
        raise NotImplementedError

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times the weight, transposed, without the bias (a row-parallel shard sums it over TP first)."""
        raise NotImplementedError


class DequantizedKernel(LinearKernel):
    """The weight dequantized for each product: any weight, any input (a gradient flows through it)."""

    way = "dequantized"

    @classmethod
    def can_serve(cls, weight) -> tuple[bool, str]:
        return True, ""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize())


class SmallBatchKernel(DequantizedKernel):
    """A kernel for batches of up to ``KERNEL_ROWS`` rows in the dtype it was checked for (``kernel_product``);
    a larger batch (a prefill), an input that needs a gradient (the kernels have no backward) or of another
    dtype (refused there as ``nn.Linear`` refuses it) takes the dequantized product."""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        rows, grad = x.numel() // max(x.shape[-1], 1), torch.is_grad_enabled() and x.requires_grad
        if rows > KERNEL_ROWS or x.dtype != self.weight.dtype or grad:
            return super().apply(x)
        return self.kernel_product(x)

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def row_boxes_or_reason(weight) -> tuple[list, str]:
    """``weight.row_boxes`` (a kernel's product a box, joined), or [] and why there are none."""
    boxes = weight.row_boxes or []
    return boxes, "" if boxes else "its stored boxes do not each hold whole rows of the shard"


def joined(products: list[torch.Tensor]) -> torch.Tensor:
    """The products of a weight's boxes of rows, in their order: the weight's."""
    return products[0] if len(products) == 1 else torch.cat(products, -1)
