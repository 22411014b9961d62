"""Kept FP8 weights multiplied in FP8 (``keep_quantized="fp8"`` on a GPU that has block-scaled FP8 products).

A weight kept as FP8 with 128x128 block scales (DeepSeek-V3, Qwen3-FP8) is otherwise dequantized module by
module in every forward: the whole matrix read as FP8, written and read again in the compute dtype, each
token. Here its module's kernel (``FP8ScaledMMKernel``, held by ``kept_linear.KeptLinear``) multiplies the
stored bytes directly: the activations
are quantized per token and per 128 of the contraction (``act_quant``: scale = the group's largest magnitude /
448, as DeepSeek-V3's recipe, transformers' FP8 linear and vLLM do) and ``torch._scaled_mm`` takes both with
their block scales (cuBLASLt's 1x128 by 128x128 scaling: CUDA 12.9+, Hopper). This is a W8A8 product, not the
weight-only one the dequantized path computes: outputs differ by the activations' FP8 rounding (relative
2**-4 per element before the sums), which is why it is asked for by name (``keep_quantized="fp8"``) and
only in bfloat16 (float32 asks for float32 products; float16's output is not what the card's check runs).
At decode shapes cuBLASLt's block-scaled GEMM and the activations' quantization cost more launches and host
time than the bytes saved (``benchmarks/fp8_products.py`` times both); hence opt-in.

Taken only where it is exact to the storage: the rank's shard of the weight is whole 128x128 blocks (no
offset into its first block, both sizes multiples of 128; a shard that cuts a block, TP at 64 of 128 rows,
stays dequantized), its module a plain ``nn.Linear``, and the card passes ``supports_block_fp8``: small
products checked against float32 once per device, so a torch or card that refuses the layout, or computes
it otherwise, keeps the dequantized path, never a wrong one.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from typing import NamedTuple

import torch

from ..scaled_fp8 import KeptFP8
from .base import DequantizedKernel
from .self_check import verdict

BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
PRODUCT_DTYPES = (torch.bfloat16,)  # the compute dtype that asks for FP8 products: the one the check runs in
logger = logging.getLogger(__name__)


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] as float8_e4m3fn [M, K] and its scales [M, K / 128] (one per token and 128 of K,
    laid out outer-dim-major as ``_scaled_mm`` reads 1x128 scales): ``x ~ q * scale`` per group."""
    rows = x.reshape(-1, x.shape[-1]).unflatten(-1, (-1, BLOCK))
    largest = torch.linalg.vector_norm(rows, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32)
    scale = largest.div_(FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    quantized = (rows / scale).to(torch.float8_e4m3fn).flatten(1)
    return quantized, scale.squeeze(-1).mT.contiguous().mT


def act_dequant(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``act_quant``'s output as the float32 activations the product sees (``q * scale`` per group)."""
    return (quantized.float().unflatten(-1, (-1, BLOCK)) * scale[..., None]).flatten(1)


def block_scales(scales: torch.Tensor, padded: bool) -> torch.Tensor:
    """A weight's [N / 128, K / 128] block scales as ``_scaled_mm`` takes them for its transpose: float32,
    passed transposed; ``padded``: each row's stride rounded up to 4 (16 bytes), as newer torch asks."""
    scales = scales.float()
    if not padded or scales.shape[1] % 4 == 0:
        return scales.contiguous().mT
    rows, columns = scales.shape
    storage = scales.new_zeros(rows, -(-columns // 4) * 4)
    storage[:, :columns] = scales
    return storage[:, :columns].mT


class Recipe(NamedTuple):
    """How this torch and card take a block-scaled FP8 product: the weight's scales with row strides padded to
    16 bytes (newer torch) or not, the activations' rows a multiple of ``rows`` (zero rows added), and
    whether a contraction of a number of blocks that is not a multiple of 4 computes right (``any_k``; torch
    2.11 accepts its unpadded scales, and cuBLASLt reads them otherwise)."""

    padded_scales: bool
    rows: int
    any_k: bool

    def takes(self, columns: int) -> bool:
        """Whether a weight of ``columns`` (the contraction, whole blocks) multiplies by this recipe."""
        return self.any_k or (columns // BLOCK) % 4 == 0


def fp8_product(x: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor, out_dtype, rows: int = 1) -> torch.Tensor:
    """``x @ dequantize(weight).T`` as a W8A8 product: ``weight`` [N, K] float8_e4m3fn, ``scale_b`` from
    ``block_scales``; ``rows``: the activations padded with zero rows to a multiple of it."""
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    if count == 0:  # no rows: no product to ask the card for
        return x.new_zeros(*x.shape[:-1], weight.shape[0], dtype=out_dtype)
    if count % rows:
        flat = torch.nn.functional.pad(flat, (0, 0, 0, rows - count % rows))
    quantized, scale_a = act_quant(flat)
    out = torch._scaled_mm(quantized, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[:count].reshape(*x.shape[:-1], weight.shape[0])


class FP8ScaledMMKernel(DequantizedKernel):
    """A kept FP8 weight of whole 128 x 128 blocks multiplied by ``fp8_product``: the stored bytes (``fp8``)
    and their scales as the card's product takes them (``scale_b``, by ``recipe``). An input that needs a
    gradient (an adapter trained over a kept base) takes the dequantized product: ``_scaled_mm`` has no
    backward."""

    way = "W8A8 FP8"

    @classmethod
    def can_serve(cls, weight) -> tuple[bool, str]:
        """Where ``weight`` (a ``KeptWeight``) is one FP8 box of whole 128 x 128 blocks in a compute dtype that
        asks for FP8 products (bfloat16) and the card's recipe takes its contraction."""
        recipe, why = _recipe(weight)
        return recipe is not None, why

    def __init__(self, weight):
        super().__init__(weight)
        kept, (self.recipe, _) = weight.whole, _recipe(weight)
        self.fp8, self.scale_b = kept.weight, block_scales(kept.scales, self.recipe.padded_scales)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return super().apply(x)
        return fp8_product(x, self.fp8, self.scale_b, x.dtype, self.recipe.rows)


def _recipe(weight) -> tuple[Recipe | None, str]:
    """The card's recipe for ``weight`` (``FP8ScaledMMKernel.can_serve``), else None and why not."""
    kept, (rows, columns) = weight.whole, weight.shape
    if weight.dtype not in PRODUCT_DTYPES:
        return None, f"FP8 products are asked for in bfloat16, not {weight.dtype}"
    if not isinstance(kept, KeptFP8):
        return None, "not one box of FP8 weights (its shard cut from several)"
    whole = kept.block == (BLOCK, BLOCK) and kept.offset == (0, 0) and rows % BLOCK == 0 == columns % BLOCK
    grid = tuple(kept.scales.shape) == (rows // BLOCK, columns // BLOCK)
    if not (whole and grid and kept.weight.dtype == torch.float8_e4m3fn):
        return None, "not whole 128 x 128 blocks of float8_e4m3fn"
    recipe = supports_block_fp8(kept.weight.device)
    if recipe is None:
        return None, f"no block-scaled FP8 product on {kept.weight.device}"
    if not recipe.takes(columns):
        return None, f"the card's product takes contractions of a multiple of 4 blocks, not {columns // BLOCK}"
    return recipe, ""


def _computes_right(device, blocks: int, padded: bool, rows: int) -> bool:
    """Products of ``blocks`` blocks' contraction against the same products in float32 (bfloat16 out): 8
    blocks of output, and 300 rows of activations, three and one (a prefill's, a decode step's); torch's or
    cuBLASLt's refusal raises (``self_check.verdict`` names it)."""
    generator = torch.Generator(device=device).manual_seed(blocks)
    x = torch.randn(300, blocks * BLOCK, device=device, generator=generator, dtype=torch.bfloat16)
    weight = (torch.randn(8 * BLOCK, blocks * BLOCK, device=device, generator=generator) * 64).to(torch.float8_e4m3fn)
    scales = torch.rand(8, blocks, device=device, generator=generator) / 64 + 1e-3
    want = act_dequant(*act_quant(x)) @ KeptFP8({}, weight, scales, (BLOCK, BLOCK), (0, 0)).dequantize().T
    tolerance = dict(rtol=0, atol=2**-7 * want.abs().max().item())  # bf16's rounding of the output (2**-9)
    got = [fp8_product(x[:m], weight, block_scales(scales, padded), torch.bfloat16, rows) for m in (300, 3, 1)]
    return all(torch.allclose(g.float(), want[: len(g)], **tolerance) for g in got)


@functools.cache
def supports_block_fp8(device: torch.device) -> Recipe | None:
    """Whether ``device`` multiplies 1x128-by-128x128 block-scaled FP8 and how (``Recipe``), or None.
    Decided once per device at load time by small products checked against float32 (``_computes_right``, run
    by ``self_check.verdict``):
    first a contraction of 4 blocks (both scale layouts alike), rows as they come or padded, then 5 blocks
    (the layouts differ) to learn which layout this torch reads right, if either."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(device)[0] != 9:
        return None  # cuBLASLt's 2-D block scales: Hopper only (Blackwell's cuBLAS takes 1-D block scales)
    seen = []
    for rows in (1, 16, 128):
        aligned = verdict(_computes_right, device, 4, False, rows)
        seen.append(f"4 blocks, rows padded to {rows}: {aligned}")
        if aligned is not True:
            continue
        for padded in (True, False):
            unaligned = verdict(_computes_right, device, 5, padded, rows)
            seen.append(f"5 blocks, {'padded' if padded else 'plain'} scales: {unaligned}")
            if unaligned is True:
                return Recipe(padded, rows, any_k=True)
        logger.info("hf_parallel: block-scaled FP8 products where the contraction is a multiple of 4 blocks; %s",
                    "; ".join(seen))  # fmt: skip
        return Recipe(False, rows, any_k=False)
    warnings.warn(f"hf_parallel: {torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA "
                  f"{torch.version.cuda}) takes no block-scaled FP8 product; kept FP8 weights are dequantized per "
                  f"module instead. {'; '.join(seen)}")  # fmt: skip
    return None
