"""A plain ``nn.Linear`` whose weight is kept quantized computes its own product (its class swapped, as FSDP2's
``fully_shard`` swaps a module's class): ``KeptLinear`` dequantizes the weight for the product,
``KeptFP8KernelLinear`` multiplies an FP8 weight as stored by the package's weight-only kernel (``fp8_weight_only``,
on GPUs), ``KeptFP8Linear`` by cuBLASLt's W8A8 product (``fp8_scaled_mm``, asked for by ``keep_quantized="fp8"``),
``KeptInt4Linear`` a GPTQ / AWQ / compressed-tensors int4 weight by torch's int4 kernel (``int4_torch``, CPU and CUDA).
The ``weight`` slot keeps its placeholder throughout, so any other use of the weight still fails loudly; and
no parameter is built inside the forward, which ``torch.compile(fullgraph=True)`` cannot trace (the forward
hooks of other kept modules do). ``product`` is the product without the bias: a row-parallel shard sums it
over TP before the bias is added once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .scaled_fp8 import KeptFP8
from .kernels import fp8_weight_only, int4_torch
from .kernels.fp8_scaled_mm import BLOCK, PRODUCT_DTYPES, block_scales, fp8_product, supports_block_fp8


class KeptLinear(nn.Linear):
    """``kept_weight``: the ``KeptWeight`` dequantized for each product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)
        return out if self.bias is None else out + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.kept_weight.dequantize())


class KeptFP8Linear(KeptLinear):
    """``fp8_weight`` / ``fp8_scale_b``: the stored bytes in whole 128 x 128 blocks and their scales as the
    card's product takes them (``fp8_recipe``). An input that needs a gradient (an adapter trained over a kept
    base) takes the dequantized product: ``_scaled_mm`` has no backward."""

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return super().product(x)
        return fp8_product(x, self.fp8_weight, self.fp8_scale_b, x.dtype, self.fp8_recipe.rows)


class KeptKernelLinear(KeptLinear):
    """A kept weight multiplied by a kernel (``kernel_product``) for batches of up to ``KERNEL_ROWS`` rows in
    the dtype it was checked for; a larger batch (a prefill), an input that needs a gradient (the kernels have
    no backward) or of another dtype (refused there as ``nn.Linear`` refuses it) takes the dequantized product."""

    KERNEL_ROWS: int  # each kernel's own (its module's ``KERNEL_ROWS``)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        rows, grad = x.numel() // max(x.shape[-1], 1), torch.is_grad_enabled() and x.requires_grad
        if rows > self.KERNEL_ROWS or x.dtype != self.kept_weight.dtype or grad:
            return super().product(x)
        return self.kernel_product(x)


class KeptFP8KernelLinear(KeptKernelLinear):
    """A kept FP8 weight in boxes of whole rows (``kernel_boxes``: one, or a packed weight's parts), each
    multiplied as stored by ``fp8_weight_only``, its launches for each input shape worked out once
    (``kernel_plans``: a box's each)."""

    KERNEL_ROWS = fp8_weight_only.KERNEL_ROWS

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        # none while compiling: dynamo guards a dict it reads on its length, so each eager plan would recompile
        plans = [None] * len(self.kernel_boxes) if torch.compiler.is_compiling() else self.kernel_plans
        return _joined([fp8_weight_only.weight_only_fp8(x, box, plans=p) for box, p in zip(self.kernel_boxes, plans)])


class KeptInt4Linear(KeptKernelLinear):
    """A kept GPTQ / AWQ / compressed-tensors int4 weight in boxes of whole rows, each multiplied by torch's
    int4 kernel from its ``int4_packs``."""

    KERNEL_ROWS = int4_torch.KERNEL_ROWS

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        return _joined([int4_torch.int4_product(x, pack) for pack in self.int4_packs])


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


def _joined(products: list[torch.Tensor]) -> torch.Tensor:
    """The products of a weight's boxes of rows, in their order: the weight's."""
    return products[0] if len(products) == 1 else torch.cat(products, -1)


def hold_linear(module: nn.Module, weights: dict, fp8_products: bool, int4_kernels: bool = False) -> bool:
    """Make a plain ``nn.Linear`` whose only kept parameter is its weight compute with it: W8A8 products where
    ``fp8_products`` and ``fp8_scaled_mm``'s conditions hold, else the weight-only FP8 kernel where ``fp8_weight_only``
    takes the weight, else, with ``int4_kernels``, torch's int4 kernel where ``int4_torch`` packs it, else
    dequantized; False for any other module."""
    if type(module) is not nn.Linear or set(weights) != {"weight"}:
        return False
    weight = weights["weight"]
    recipe = _fp8_recipe(weight) if fp8_products else None
    boxes = (weight.row_boxes or []) if recipe is None else []  # a kernel's product a box, joined
    kernel = bool(boxes) and all(fp8_weight_only.takes(box, shape, weight.dtype) for box, shape in boxes)
    packs = None if kernel or not int4_kernels else [int4_torch.int4_pack(b, s, weight.dtype) for b, s in boxes]
    packs = packs if packs and None not in packs else None  # every box through the kernel, or none
    module.__class__ = (KeptFP8Linear if recipe is not None else KeptFP8KernelLinear if kernel else
                        KeptInt4Linear if packs else KeptLinear)  # fmt: skip
    module.kept_weight, module.int4_packs = weight, packs
    module.kernel_boxes = [box for box, _ in boxes] if kernel else None
    module.kernel_plans = [fp8_weight_only.Plans() for _ in boxes] if kernel else None
    if recipe is not None:
        kept = weight.whole
        module.fp8_weight, module.fp8_recipe = kept.weight, recipe
        module.fp8_scale_b = block_scales(kept.scales, recipe.padded_scales)
    return True


def _fp8_recipe(weight):
    """The card's recipe where ``weight`` (a ``KeptWeight``) is one FP8 box of whole 128 x 128 blocks in a
    compute dtype that asks for FP8 products (bfloat16); else None."""
    kept, (rows, columns) = weight.whole, weight.shape
    if weight.dtype not in PRODUCT_DTYPES or not isinstance(kept, KeptFP8):
        return None
    whole = kept.block == (BLOCK, BLOCK) and kept.offset == (0, 0) and rows % BLOCK == 0 == columns % BLOCK
    grid = tuple(kept.scales.shape) == (rows // BLOCK, columns // BLOCK)
    if not (whole and grid and kept.weight.dtype == torch.float8_e4m3fn):
        return None
    recipe = supports_block_fp8(kept.weight.device)
    return recipe if recipe is not None and recipe.takes(columns) else None
