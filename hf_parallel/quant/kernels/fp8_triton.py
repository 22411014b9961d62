"""The Triton source of ``fp8_weight_only``'s weight-only FP8 product, in its own module: importing Triton costs a
process about 80 MiB, so ``fp8_weight_only`` imports this only where the kernel may run (a GPU, or Triton's
interpreter), never on a plain CPU load."""

import triton
import triton.language as tl

from ...compat import DependencyChanged
from ...compat import triton as triton_seams
from .triton_launch import CachedLaunch

# whether ``triton.jit`` made the kernel for Triton's interpreter: it reads TRITON_INTERPRET when it decorates
INTERPRETED = bool(triton.knobs.runtime.interpret)


try:  # ``tl.sum``'s own combine: numpy's sum in the interpreter (compat/triton.py)
    _SUM_COMBINE = triton_seams.SUM_COMBINE.get()
except DependencyChanged:  # (the check of every seam says so in the tests)
    _SUM_COMBINE = None

if _SUM_COMBINE is not None:

    @triton.jit
    def _row_sums(products):
        """``tl.sum(products, 2)``, as ``tl.sum`` reduces."""
        return tl.reduce(products, 2, _SUM_COMBINE)

else:  # the same on a card; in the interpreter, only where Triton was imported asked for it

    @triton.jit
    def _row_sums(products):
        """``tl.sum(products, 2)``."""
        return tl.sum(products, 2)


@triton.jit
def _weight_tile(weight_rows, scale_row, n, k, inside, outputs, column, live, like):
    """The weight's tile at rows ``n`` and columns ``k`` (``weight_rows``: each row's start), each row scaled
    by its block's scale (column ``column`` of ``scale_row``) and rounded to ``like``'s dtype as the
    dequantized path rounds it. ``live``: per row, whether the tile starts before the inputs' end (an unrolled
    step past it reads no scale: one past the grid may be anything, and 0 x NaN is NaN)."""
    w = tl.load(weight_rows + k[None, :], mask=(n[:, None] < outputs) & inside[None, :], other=0.0)
    scale = tl.load(scale_row + column, mask=(n < outputs) & live, other=0.0)
    return (w.to(tl.float32) * scale.to(tl.float32)[:, None]).to(like.dtype)


@triton.jit
def _product(x, w, DOT_FP32: tl.constexpr):
    """``x @ w.T`` summed in float32 (``DOT_FP32``: multiplied in float32 too)."""
    if DOT_FP32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(x, tl.trans(w))


@triton.jit
def _start(TILE_M: tl.constexpr, TILE_N: tl.constexpr, SWAP: tl.constexpr):
    """A program's float32 sums: [TILE_M, TILE_N], or transposed where ``SWAP`` (``_add``)."""
    if SWAP:  # a branch on a constexpr: compiled as its one side, so the two shapes never meet
        total = tl.full((TILE_N, TILE_M), 0.0, dtype=tl.float32)  # a builtin: runs interpreted in any process
    else:
        total = tl.full((TILE_M, TILE_N), 0.0, dtype=tl.float32)
    return total


@triton.jit
def _add(total, x, w, DOT_FP32: tl.constexpr, SWAP: tl.constexpr, DOT: tl.constexpr):
    """``total`` plus ``x @ w.T``; where ``SWAP``, its transpose ``w @ x.T``: the weight's tile the product's
    left operand, which the tensor cores read from registers (the right one goes through shared memory), and
    a decode step's few rows the small side of the product. Without ``DOT``, each row's products with the
    tile broadcast and summed in float32 in registers (a GEMV: no tensor cores, for a step's row or few; for
    bfloat16 and float16 inputs the products of rounded weights are exact in float32, as ``tl.dot``'s)."""
    if not DOT:
        total += _row_sums(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :])
    elif SWAP:
        total += _product(w, x, DOT_FP32)
    else:
        total += _product(x, w, DOT_FP32)
    return total


@triton.jit
def _store(out_ptr, total, m, n, out_stride, m_inside, n_inside, SWAP: tl.constexpr):
    """``total`` (``_start``'s orientation) into the output's rows ``m`` and columns ``n`` where inside."""
    if SWAP:
        tl.store(out_ptr + m[None, :] * out_stride + n[:, None], total.to(out_ptr.dtype.element_ty),
                 mask=m_inside[None, :] & n_inside[:, None])  # fmt: skip
    else:
        tl.store(out_ptr + m[:, None] * out_stride + n[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=m_inside[:, None] & n_inside[None, :])  # fmt: skip


@triton.jit
def _chunk(inputs, column_offset, TILE_K: tl.constexpr):
    """This program's columns of the inputs, ``[start, end)``: the whole weight's tiles of ``TILE_K`` columns
    (the first may start before column 0) cut into ``tl.num_programs(2)`` runs of whole tiles, this one the
    ``tl.program_id(2)``-th (split-K: more programs in flight; a run past the last tile is empty)."""
    start = -(column_offset % TILE_K)  # (``tl.cdiv`` is itself jitted: the interpreter runs builtins only)
    tiles = (inputs - start + TILE_K - 1) // TILE_K
    per_split = (tiles + tl.num_programs(2) - 1) // tl.num_programs(2)
    start += tl.program_id(2) * per_split * TILE_K
    return start, tl.minimum(start + per_split * TILE_K, inputs)


@triton.jit
def weight_only_fp8(x_ptr, out_ptr, w_ptr, s_ptr, rows, outputs, inputs, x_stride, w_stride, s_stride,
                     out_stride, row_offset, column_offset, block_rows, block_columns,
                     TILE_M: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr, DOT_FP32: tl.constexpr,
                     SWAP: tl.constexpr, UNROLL: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """out[m, n] = sum_k x[m, k] * round(w[n, k] * s[(n + row_offset) // block_rows,
    (k + column_offset) // block_columns]): a TILE_M x TILE_N tile of the output per program, UNROLL tiles of
    columns a step (their loads issued together: more bytes in flight), by ``tl.dot`` or (not ``DOT``) as a
    GEMV (``_add``). The block's sizes are runtime
    arguments, so one compiled kernel serves every block size. Split along the columns (a grid of several
    along its third axis, ``_chunk``), each program writes its float32 sums to its run's own output (``rows``
    rows after the previous run's), summed after."""
    m = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    n = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    scale_row = s_ptr + ((n + row_offset) // block_rows) * s_stride
    total = _start(TILE_M, TILE_N, SWAP)
    begin, end = _chunk(inputs, column_offset, TILE_K)
    for first in range(begin, end, TILE_K * UNROLL):  # on the whole weight's tiles
        for step in tl.static_range(UNROLL):
            start = first + step * TILE_K
            k = start + tl.arange(0, TILE_K)
            inside = (k >= 0) & (k < end)
            x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=(m[:, None] < rows) & inside[None, :],
                        other=0.0)  # fmt: skip
            column = (start + column_offset) // block_columns
            w = _weight_tile(w_ptr + n[:, None] * w_stride, scale_row, n, k, inside, outputs, column,
                             n * 0 + start < end, x)  # fmt: skip
            total = _add(total, x, w, DOT_FP32, SWAP, DOT)
    out_ptr += tl.program_id(2) * rows * out_stride
    _store(out_ptr, total, m, n, out_stride, m < rows, n < outputs, SWAP)


@triton.jit
def gathered_weight_only_fp8(x_ptr, ids_ptr, out_ptr, w_ptr, s_ptr, outputs, inputs, x_stride, w_expert_stride,
                             w_stride, s_expert_stride, s_stride, out_stride, row_offset, column_offset, block_rows,
                             block_columns, TILE_M: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr,
                             DOT_FP32: tl.constexpr, SWAP: tl.constexpr, UNROLL: tl.constexpr,
                             DOT: tl.constexpr):  # fmt: skip
    """out[p, n] = sum_k x[p, k] * round(w[ids[p], n, k] * s[ids[p], ...]): each row of ``x`` (a (token,
    expert) pair) times its own expert's weight, a TILE_N slice of its outputs per program. The row is the
    first of a TILE_M-row tile (with ``DOT``, ``tl.dot``'s least: 16, the others masked to zero; else 1, a
    GEMV): a decode step's product is bound by reading the weight, not by the dot. Split along the columns as
    ``weight_only_fp8`` is."""
    pair = tl.program_id(0)
    n = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    row = tl.arange(0, TILE_M)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    weight_rows = w_ptr + expert * w_expert_stride + n[:, None] * w_stride
    scale_row = s_ptr + expert * s_expert_stride + ((n + row_offset) // block_rows) * s_stride
    total = _start(TILE_M, TILE_N, SWAP)
    begin, end = _chunk(inputs, column_offset, TILE_K)
    for first in range(begin, end, TILE_K * UNROLL):  # on the whole weight's tiles
        for step in tl.static_range(UNROLL):
            start = first + step * TILE_K
            k = start + tl.arange(0, TILE_K)
            inside = (k >= 0) & (k < end)
            x = tl.load(x_ptr + pair * x_stride + row[:, None] * 0 + k[None, :],
                        mask=(row[:, None] == 0) & inside[None, :], other=0.0)  # fmt: skip
            column = (start + column_offset) // block_columns
            w = _weight_tile(weight_rows, scale_row, n, k, inside, outputs, column, n * 0 + start < end, x)
            total = _add(total, x, w, DOT_FP32, SWAP, DOT)
    out_ptr += (tl.program_id(2) * tl.num_programs(0) + pair) * out_stride  # a run's outputs: one row a pair
    _store(out_ptr, total, row * 0, n, 0, row == 0, n < outputs, SWAP)


# the launches ``fp8_weight_only`` makes: each kernel kept after its first launch of a key (``triton_launch``); each
# kernel's leading parameters are the tensors that change from one launch of a product to the next
launch_weight_only_fp8 = CachedLaunch(weight_only_fp8)
launch_gathered_weight_only_fp8 = CachedLaunch(gathered_weight_only_fp8)
