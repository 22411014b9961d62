"""A plain ``nn.Linear`` whose weight is kept quantized computes its own product: ``KeptLinear`` holds one kernel
object (``kernels/base.py``'s ``LinearKernel``) chosen for its weight at load and calls it. The kernels, in the
order ``choose_kernel`` tries them: cuBLASLt's W8A8 FP8 product (``fp8_scaled_mm.FP8ScaledMMKernel``, asked for
by ``keep_quantized="fp8"``), the package's weight-only FP8 kernel (``fp8_weight_only.FP8WeightOnlyKernel``,
on GPUs), torch's int4 kernel for a GPTQ / AWQ / compressed-tensors int4 weight
(``int4_torch.Int4TorchKernel``, asked for by ``keep_quantized="int4"``; CPU and CUDA), and the weight
dequantized for each product (``kernels.base.DequantizedKernel``), which serves any weight.

The ``weight`` slot keeps its placeholder throughout, so any other use of the weight still fails loudly; and
no parameter is built inside the forward, which ``torch.compile(fullgraph=True)`` cannot trace (the forward
hooks of other kept modules do). ``product`` is the product without the bias: a row-parallel shard sums it
over TP before the bias is added once.
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels import fp8_scaled_mm, fp8_weight_only, int4_torch
from .kernels.base import DequantizedKernel, LinearKernel, Refused


class KeptLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is kept quantized: its product is its ``kernel``'s (``choose_kernel``);
    ``refusals``: why the kernels tried before it did not serve its weight ("" where the first did)."""

    kernel: LinearKernel
    refusals: str

    @classmethod
    def hold(cls, module: nn.Linear, weight, fp8_products: bool = False, int4_kernels: bool = False) -> KeptLinear:
        """Make ``module`` (a plain ``nn.Linear``) compute with its kept ``weight`` (a ``KeptWeight``). The
        module stays the same object (the model, its hooks and any optimizer hold it), so its class becomes
        this one, as FSDP2's ``fully_shard`` swaps a module's class: the one class change a kept linear takes."""
        module.__class__ = cls
        module._choose(weight, fp8_products, int4_kernels)
        return module

    def _choose(self, weight, fp8_products: bool, int4_kernels: bool) -> None:
        self.kernel, self.refusals = choose_kernel(weight, fp8_products, int4_kernels)

    @property
    def kept_weight(self):
        """The ``KeptWeight`` its kernel multiplies by."""
        return self.kernel.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)
        return out if self.bias is None else out + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The product without the bias (``tensor/styles.py``: a row-parallel shard sums it over TP first)."""
        return self.kernel.apply(x)


def kernel_candidates(fp8_products: bool = False, int4_kernels: bool = False) -> list[type[LinearKernel]]:
    """The kernels a kept linear may take, in the order they are tried: W8A8 FP8 products where asked for
    (``fp8_products``), the weight-only FP8 kernel, torch's int4 kernel where asked for (``int4_kernels``)."""
    return [*([fp8_scaled_mm.FP8ScaledMMKernel] if fp8_products else []), fp8_weight_only.FP8WeightOnlyKernel,
            *([int4_torch.Int4TorchKernel] if int4_kernels else [])]  # fmt: skip


def choose_kernel(weight, fp8_products: bool = False, int4_kernels: bool = False) -> tuple[LinearKernel, str]:
    """The first of ``kernel_candidates`` that can serve ``weight`` (a ``KeptWeight``), prepared for it, else
    ``DequantizedKernel``; and the reasons of those tried before it, joined ("" where the first served)."""
    reasons = []
    for kind in kernel_candidates(fp8_products, int4_kernels):
        serves, why = kind.can_serve(weight)
        if serves:
            try:
                return kind(weight), "; ".join(reasons)
            except Refused as refusal:
                why = str(refusal)
        reasons.append(f"{kind.way}: {why}")
    return DequantizedKernel(weight), "; ".join(reasons)


def rows_in_order(places: list[tuple], shape) -> list[int] | None:
    """The boxes at ``places`` in a 2-d shard of ``shape`` in order of their rows, where each holds all the
    shard's columns and together they tile its rows; else None."""
    if len(shape) != 2 or any((at[1].start, at[1].stop) != (0, shape[1]) for at in places):
        return None
    order = sorted(range(len(places)), key=lambda i: places[i][0].start)
    ends = [0] + [places[i][0].stop for i in order]
    return order if [places[i][0].start for i in order] == ends[:-1] and ends[-1] == shape[0] else None


def row_boxes(placed: list[tuple], shape) -> list[tuple] | None:
    """Boxes and where each goes in a 2-d shard of ``shape`` (``placed``), in order of their rows and each with
    its shape, where each holds all the shard's columns and together they tile its rows; else None: what a
    kernel's products a box, joined, multiply (``hold_linear``; ``hf-parallel plan``'s int4 figure)."""
    order = rows_in_order([at for _, at in placed], shape)
    return None if order is None else [(placed[i][0], tuple(s.stop - s.start for s in placed[i][1])) for i in order]


def hold_linear(module: nn.Module, weights: dict, fp8_products: bool, int4_kernels: bool = False) -> bool:
    """Make a plain ``nn.Linear`` whose only kept parameter is its weight compute with it (``KeptLinear.hold``:
    the first kernel of ``kernel_candidates`` that serves it, else dequantized); False for any other module."""
    if type(module) is not nn.Linear or set(weights) != {"weight"}:
        return False
    KeptLinear.hold(module, weights["weight"], fp8_products, int4_kernels)
    return True
