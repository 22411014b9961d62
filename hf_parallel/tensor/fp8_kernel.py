"""Kept FP8 weights multiplied as stored by a Triton kernel shipped here (``keep_quantized=True`` on a GPU).

A kept FP8 weight is otherwise dequantized module by module for every product: the whole matrix read as
FP8, written and read again in the compute dtype, in four or five launches (measured on an H100: 53-67 us a
product where the bf16 weight takes 15-18). This kernel reads each FP8 element once, scales it in
registers by its block's scale, rounds it to the compute dtype as the dequantized path does, and
accumulates the product in float32: one launch, one byte read per weight. It is a weight-only (W8A16)
product, so it computes what the dequantized path computes, up to the order of the sums; the activations
are not quantized (``keep_quantized="fp8"``'s cuBLASLt W8A8 product is ``fp8_matmul``).

Any box of a block-scaled FP8 weight whose scales are float32, bfloat16 or float16: blocks whose columns are
a multiple of 16 (or one scale across the columns), and a shard that starts inside a block (TP at 64 of 128
rows) reads its scales from that offset. A tile of ``TILE_K`` columns (a divisor of the block's columns)
starts on a block boundary of the whole weight, so each tile takes one scale per row. Taken for batches of
up to ``KERNEL_ROWS`` rows (decode steps, small batches), where a product reads more weight than
activations; larger ones (prefill) take the dequantized product (cuBLAS).

Checked on each device before use (``runs_on``: small products against the dequantized product in float32,
once per device and variant: the weight's, scales' and compute dtypes, the tile of columns): a card or
Triton that cannot compile it (e4m3 conversions need Ada, Hopper or later) or computes otherwise keeps the
dequantized path, with a warning naming why. On CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1``), which the tests use; there the dot is taken in float32, since the interpreter
multiplies bfloat16 as its integer storage. Not measured on a GPU yet (``benchmarks/fp8_products.py``).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from ..checkpoint.quantized import KeptFP8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the dequantized product
    triton = None

KERNEL_ROWS = 64  # the largest batch this kernel takes; more rows take the dequantized product
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WHOLE = 1 << 30  # a "block" spanning any weight: one scale along that dim


# whether ``triton.jit`` made the kernel for Triton's interpreter: it reads TRITON_INTERPRET when it decorates
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)
if triton is not None:

    @triton.jit
    def _weight_only_fp8(x_ptr, w_ptr, s_ptr, out_ptr, rows, outputs, inputs, x_stride, w_stride, s_stride,
                         out_stride, row_offset, column_offset, block_rows, block_columns, TILE_M: tl.constexpr,
                         TILE_N: tl.constexpr, TILE_K: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
        """out[m, n] = sum_k x[m, k] * round(w[n, k] * s[(n + row_offset) // block_rows,
        (k + column_offset) // block_columns]): a TILE_M x TILE_N tile of the output per program. The block's
        sizes are runtime arguments, so one compiled kernel serves every block size."""
        m = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
        n = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
        scale_row = s_ptr + ((n + row_offset) // block_rows) * s_stride
        total = tl.full((TILE_M, TILE_N), 0.0, dtype=tl.float32)  # a builtin: runs interpreted in any process
        for start in range(-(column_offset % TILE_K), inputs, TILE_K):  # tiles on the whole weight's boundaries
            k = start + tl.arange(0, TILE_K)
            inside = (k >= 0) & (k < inputs)
            x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=(m[:, None] < rows) & inside[None, :],
                        other=0.0)  # fmt: skip
            w = tl.load(w_ptr + n[:, None] * w_stride + k[None, :], mask=(n[:, None] < outputs) & inside[None, :],
                        other=0.0)  # fmt: skip
            scale = tl.load(scale_row + (start + column_offset) // block_columns, mask=n < outputs, other=0.0)
            w = (w.to(tl.float32) * scale.to(tl.float32)[:, None]).to(x.dtype)  # the dequantized path's rounding
            if DOT_FP32:
                total += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                total += tl.dot(x, tl.trans(w))
        mask = (m[:, None] < rows) & (n[None, :] < outputs)
        tl.store(out_ptr + m[:, None] * out_stride + n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


def tile_k(kept: KeptFP8) -> int | None:
    """The columns of a tile for this weight: the largest power of two up to 128 dividing its blocks' columns
    (one scale per row in each tile), or None where that is under 16 (``tl.dot``'s least)."""
    if _scales(kept).shape[1] == 1:
        return 128
    size = math.gcd(kept.block[1], 128)
    return size if size >= 16 else None


def _scales(kept: KeptFP8) -> torch.Tensor:
    return kept.scales.reshape(1, 1) if kept.scales.dim() != 2 else kept.scales


def weight_only_fp8(x: torch.Tensor, kept: KeptFP8) -> torch.Tensor:
    """``F.linear(x, kept.dequantize(x.dtype))`` from the stored bytes, in one launch (``x``: at most
    ``KERNEL_ROWS`` rows once flattened)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, (outputs, inputs) = flat.shape[0], kept.weight.shape
    out = torch.empty(rows, outputs, dtype=x.dtype, device=x.device)
    scales = _scales(kept)
    block_rows = kept.block[0] if scales.shape[0] > 1 else WHOLE
    block_columns = kept.block[1] if scales.shape[1] > 1 else WHOLE
    tile_m, tile_n = 16 if rows <= 16 else 32 if rows <= 32 else 64, 16  # comparisons: a compiled step guards them
    grid = (triton.cdiv(rows, tile_m), triton.cdiv(outputs, tile_n))
    _weight_only_fp8[grid](flat, kept.weight, scales, out, rows, outputs, inputs, flat.stride(0),
                           kept.weight.stride(0), scales.stride(0), out.stride(0), kept.offset[0], kept.offset[1],
                           block_rows, block_columns, TILE_M=tile_m, TILE_N=tile_n, TILE_K=tile_k(kept),
                           DOT_FP32=x.dtype == torch.float32 or INTERPRETED)  # fmt: skip
    return out.reshape(*x.shape[:-1], outputs)


def takes(kept, shape: tuple, dtype: torch.dtype) -> bool:
    """Whether the kernel multiplies this kept box as a weight of ``shape`` in ``dtype`` on its device (checked
    there once)."""
    if not isinstance(kept, KeptFP8) or kept.weight.dtype not in FP8_DTYPES or dtype not in COMPUTE_DTYPES:
        return False
    if kept.scales.dtype not in COMPUTE_DTYPES:  # power-of-two scales stored as e8m0: dequantized
        return False
    if tuple(kept.weight.shape) != tuple(shape) or kept.weight.stride(-1) != 1 or _scales(kept).stride(-1) != 1:
        return False  # the kernel steps along rows of the weight and of the scales
    if kept.weight.shape[0] * kept.weight.stride(0) >= 2**31 or tile_k(kept) is None:  # its offsets are 32-bit
        return False
    return runs_on(kept.weight.device, kept.weight.dtype, dtype, kept.scales.dtype, tile_k(kept))


@functools.cache
def runs_on(device: torch.device, fp8=torch.float8_e4m3fn, dtype=torch.bfloat16, scales=torch.float32,
            tile: int = 128) -> bool:  # fmt: skip
    """Whether the kernel compiles on ``device`` for these dtypes (the weight's, the compute's, the scales')
    and tile of columns, and computes there what the dequantized path does: products of 1, 20 and 40 rows
    (each tile of rows) with blocks of ``tile`` columns, whole blocks, a box starting inside its blocks, and
    one scale for all, against the same rounded weights multiplied in float32. CPU: only under Triton's
    interpreter; no warning where there is nothing to run it."""
    if triton is None or (device.type != "cuda" and not (device.type == "cpu" and INTERPRETED)):
        return False
    cases = [(1, (0, 0), (128, tile)), (20, (64, tile // 2), (128, tile)), (40, (5, 7), (WHOLE, WHOLE))]
    try:
        wrong = [case for case in cases if not _computes_right(device, fp8, dtype, scales, *case)]
    except Exception as error:  # noqa: BLE001 - Triton's compile errors have no common class; any refusal counts
        if isinstance(error, getattr(torch, "AcceleratorError", ())):  # the card's own fault: not a refusal
            raise
        wrong = [f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"]
    if wrong:
        warnings.warn(f"hf_parallel: the weight-only FP8 kernel does not compute right on {device} for {fp8} weights, "
                      f"{scales} scales and {dtype} products in tiles of {tile} columns (torch {torch.__version__}, "
                      f"Triton {triton.__version__}): {wrong}; those kept FP8 weights are dequantized per module "
                      f"instead")  # fmt: skip
    return not wrong


def _computes_right(device, fp8, dtype, scales, rows: int, offset: tuple, block: tuple) -> bool:
    generator = torch.Generator(device=device).manual_seed(rows)
    outputs, inputs = 200, 300
    grid = [-(-(size + start) // length) for size, start, length in zip((outputs, inputs), offset, block)]
    weight = (torch.randn(outputs, inputs, device=device, generator=generator) * 16).to(fp8)
    scale = (torch.rand(*grid, device=device, generator=generator) / 64 + 1e-3).to(scales)
    kept = KeptFP8({}, weight, scale, block, offset)
    x = torch.randn(rows, inputs, device=device, generator=generator, dtype=dtype)
    want = x.float() @ kept.dequantize(dtype).float().T
    got = weight_only_fp8(x, kept).float()
    # bf16's rounding of the weights and the output, with room for the interpreter's truncation; a wrong scale,
    # offset or tile is off by far more (scales differ up to 16-fold between blocks)
    return torch.allclose(got, want, rtol=0, atol=2**-6 * want.abs().max().item())
