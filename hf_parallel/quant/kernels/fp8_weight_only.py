"""Kept FP8 weights multiplied as stored by a Triton kernel shipped here (``keep_quantized=True`` on a GPU).

A kept FP8 weight is otherwise dequantized module by module for every product: the whole matrix read as
FP8, written and read again in the compute dtype, in four or five launches (measured on an H100: 53-67 us a
product where the bf16 weight takes 15-18). This kernel reads each FP8 element once, scales it in
registers by its block's scale, rounds it to the compute dtype as the dequantized path does, and
accumulates the product in float32: one launch, one byte read per weight. It is a weight-only (W8A16)
product, so it computes what the dequantized path computes, up to the order of the sums; the activations
are not quantized (``keep_quantized="fp8"``'s cuBLASLt W8A8 product is ``fp8_scaled_mm``).

Any box of a block-scaled FP8 weight whose scales are float32, bfloat16 or float16: blocks whose columns are
a multiple of 16 (or one scale across the columns), and a shard that starts inside a block (TP at 64 of 128
rows) reads its scales from that offset. A tile of ``TILE_K`` columns (a divisor of the block's columns)
starts on a block boundary of the whole weight, so each tile takes one scale per row. Taken for batches of
up to ``KERNEL_ROWS`` rows (decode steps, small batches), where a product reads more weight than
activations; larger ones (prefill) take the dequantized product (cuBLAS).

Its gathered form (``gathered_weight_only_fp8``) multiplies each row of a decode step's (token, expert)
pairs by its own expert's weight from a stack of experts' FP8 boxes (``kept_experts``), one launch for all.

Launched through ``triton_launch``: the kernel Triton returns for a key's first launch is called again for
the next ones, without ``JITFunction.run``'s work each call (the host's time, which an eager decode step
waits on); and a kept module's launch for an input shape is worked out once (``Plans``), so a decode step's
launch again computes no more than its input's and output's part of the key.

Checked on each device before use (``runs_on``: small products against the dequantized product in float32,
each launched twice, the second through the kept kernel and bit for bit the first, once per device and
variant: the weight's, scales' and compute dtypes, the tile of columns): a card or
Triton that cannot compile it (e4m3 conversions need Ada, Hopper or later) or computes otherwise keeps the
dequantized path, with a warning naming why. On CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1``), which the tests use; there the dot is taken in float32, since the interpreter
multiplies bfloat16 as its integer storage. On an H200 a one-row product takes 2.9-3.9x the bf16 weight's GPU
time (it reads half the bytes, at 0.2-0.6 TB/s: latency-bound) and its launch about twice ``F.linear``'s
host time (``benchmarks/fp8_products.py --sweep``; docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import operator
import os
import warnings
from typing import NamedTuple

import torch

from ..scaled_fp8 import KeptFP8
from . import triton_launch
from .self_check import wrong_cases

KERNEL_ROWS = 64  # the largest batch this kernel takes; more rows take the dequantized product


class Launch(NamedTuple):
    """How a product is cut and run: the outputs a program computes (``tile_n``), Triton's warps a program and
    pipeline stages, whether the weight's tile is the left operand of the tile products (``swap``: the tensor
    cores read it from registers), the tiles of columns a program loads at once (``unroll``: more bytes in
    flight, where stages were seen to change nothing), and the runs of columns the product is split into
    (``split``, split-K: as many times the programs, each summing its run in float32 into its own output,
    summed and rounded after by torch: in eager two launches more, which a compiled step fuses into one; 0: as
    ``_split`` chooses), whether the tile products go through ``tl.dot`` (``dot``; else a GEMV: each of
    a program's few rows, ``GEMV_ROWS`` at most, multiplied and summed in registers, as Triton GEMV kernels
    for one-row decode do, e.g. GemLite's), and the columns a program takes a step (``tile_k``: 0, the
    weight's tile, up to 128; else a power of two of at least 16 under it, one scale a row still: a GEMV holds
    rows x ``tile_n`` x ``tile_k`` float32 products a step, which at 128 columns spill registers on sm_90).
    A decode step's product on a large card has fewer programs than the card runs at once (1536 outputs at 16
    a program: 96 programs on an H200's 132 multiprocessors), each walking every column in turn:
    latency-bound. ``swap``, ``unroll``, ``split``, ``dot=False`` and ``tile_k`` are not yet timed on a card."""

    tile_n: int
    warps: int
    stages: int
    swap: bool = False
    unroll: int = 1
    split: int = 1
    dot: bool = True
    tile_k: int = 0


# the fastest of 24 launches (tile_n 16-128, 4 or 8 warps, 2-4 stages) on an NVIDIA H200 at decode shapes, timed
# from CUDA graphs (benchmarks/fp8_products.py --sweep, 2026-11-26): each product's time grows with tile_n.
# ``split=0``: split-K chosen per product inside a compiled step (``_split``), none in eager.
PLAIN = Launch(tile_n=16, warps=4, stages=3, split=0)
GATHERED = Launch(tile_n=16, warps=4, stages=2, split=0)  # 8.7 us where tile_n=32 took 15.8 (32 experts 1024 x 1024)
# the programs a split product aims for: about two a multiprocessor on an H100 / H200 (132). An estimate, not a
# measurement: the H200's 14336 x 4096 product (896 programs of 32 tiles each) took about as long as waves of
# two programs a multiprocessor at its smaller products' time a tile. A constant, as a compiled step cannot ask
# the card (L40S 142, B200 148 multiprocessors); the sweep times splits on the card
PROGRAMS = 256
GEMV_ROWS = 4  # the rows of a program whose products do not go through ``tl.dot`` (its sums: a tile per row)
# the GEMV launches' outputs a program and columns a step that ``fp8_products.py --sweep`` times: those that compile
# for sm_90 without spilling registers at up to ``GEMV_ROWS`` bfloat16 rows, 4 warps, two tiles loaded at once
# (Triton 3.9's ptxas; ``tests/test_triton_launch.py``); at 128 columns a step every GEMV tile spilled
GEMV_TILES = ((32, 64), (64, 16), (64, 32), (128, 16), (128, 32), (256, 16))
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WHOLE = 1 << 30  # a "block" spanning any weight: one scale along that dim
_source = None  # ``fp8_triton``, once ``runs_on`` has imported it


def tile_k(kept: KeptFP8) -> int | None:
    """The columns of a tile for this weight: the largest power of two up to 128 dividing its blocks' columns
    (one scale per row in each tile), or None where that is under 16 (``tl.dot``'s least)."""
    return _launch_blocks(kept.block, _scales(kept).shape[-2:])[2]


def _launch_blocks(block: tuple, grid) -> tuple[int, int, int | None]:
    """A launch's block rows and columns (``WHOLE`` where one scale spans that dim: ``grid``, the scales' rows
    and columns, is 1 there) and its tile of columns (``tile_k``)."""
    rows, columns = (size if count > 1 else WHOLE for size, count in zip(block, grid))
    tile = 128 if grid[1] == 1 else math.gcd(block[1], 128)
    return rows, columns, tile if tile >= 16 else None


def _scales(kept: KeptFP8) -> torch.Tensor:
    return kept.scales.reshape(1, 1) if kept.scales.dim() != 2 else kept.scales


def weight_only_fp8(x: torch.Tensor, kept: KeptFP8, launch: Launch = PLAIN, plans: Plans | None = None) -> torch.Tensor:
    """``F.linear(x, kept.dequantize(x.dtype))`` from the stored bytes, in one launch (and split-K's sum where
    it splits: ``_split``; ``x``: at most ``KERNEL_ROWS`` rows once flattened; ``runs_on`` has said the kernel
    runs on its device). ``plans``: where the caller keeps this weight's launches (``Plans``)."""
    source = _loaded(x.device)
    x = x if x.is_contiguous() else x.contiguous()  # its rows a stride of ``inputs`` apart: no reshape (host time)
    plan = _planned(plans, (x.shape, x.dtype, launch), (kept, source), lambda: _plain_plan(x, kept, launch, source))
    return _launched(source.launch_weight_only_fp8, plan, x)


def _plain_plan(x: torch.Tensor, kept: KeptFP8, launch: Launch, source) -> Plan:
    (outputs, inputs), rows = kept.weight.shape, math.prod(x.shape[:-1])
    scales = _scales(kept)
    block_rows, block_columns, tile = _launch_blocks(kept.block, scales.shape)
    tile = _columns_a_step(launch, tile)
    tile_m = _tile_rows(rows, launch)
    grid = (-(-rows // tile_m), -(-outputs // launch.tile_n))
    fixed = (kept.weight, scales, rows, outputs, inputs, inputs, kept.weight.stride(0), scales.stride(0), outputs,
             kept.offset[0], kept.offset[1], block_rows, block_columns)  # fmt: skip
    columns = inputs + kept.offset[1] % tile
    return _plan(launch, grid, columns, tile, tile_m, fixed, (*x.shape[:-1], outputs), x, source)


def _constexprs(launch: Launch, tile_m: int, tile: int, x: torch.Tensor, source) -> dict:
    """Both kernels' constexprs, in their order: the dot taken in float32 for float32 inputs and under the
    interpreter (which multiplies bfloat16 as its integer storage)."""
    return dict(TILE_M=tile_m, TILE_N=launch.tile_n, TILE_K=tile, DOT_FP32=x.dtype == torch.float32 or
                source.INTERPRETED, SWAP=launch.swap, UNROLL=launch.unroll, DOT=launch.dot)  # fmt: skip


def _columns_a_step(launch: Launch, tile: int) -> int:
    """The columns a program takes a step: the weight's ``tile`` or the launch's ``tile_k`` under it."""
    if not launch.tile_k:
        return tile
    if launch.tile_k < 16 or launch.tile_k & (launch.tile_k - 1):
        raise ValueError(f"{launch}: tile_k is 0 (the weight's tile) or a power of two of at least 16")
    return min(launch.tile_k, tile)  # both powers of two: it divides the tile, so a step has one scale a row


def _tile_rows(rows: int, launch: Launch) -> int:
    """A program's rows for a product of ``rows``: through ``tl.dot``, 16, 32 or 64 (its least is 16); as a
    GEMV, the power of two up to ``GEMV_ROWS`` that holds them (comparisons: a compiled step guards them)."""
    if launch.dot:
        return 16 if rows <= 16 else 32 if rows <= 32 else 64
    if launch.swap:
        raise ValueError(f"{launch}: swap orders tl.dot's operands, and this launch takes no tl.dot")
    return min(1 << (rows - 1).bit_length(), GEMV_ROWS)


class Plan(NamedTuple):
    """A kept weight's product for inputs of one shape and dtype, all but its input and output worked out:
    its output's shape and dtype (split-K's runs: float32) and its launch, bound (``triton_launch.bind``)."""

    out_shape: tuple
    out_dtype: torch.dtype
    bound: triton_launch.Bound


class Plans(dict):
    """A kept weight's ``Plan`` per input shape, dtype and launch, worked out at its first product in eager
    and reused after (the host's time: a decode step's product repeats one shape); a module keeps one for each
    kept weight it multiplies by a kernel. ``owner``: the weight they are for and the kernels' module (``fp8_triton``,
    made for a card or for Triton's interpreter): another's product drops them all. A weight's box is replaced
    whole, never a field of it. A copy starts empty: a plan holds the tensors and addresses it was worked out
    for."""

    owner: tuple | None = None

    def __deepcopy__(self, memo) -> Plans:
        return Plans()

    def __reduce__(self):
        return Plans, ()


def _planned(plans: Plans | None, key: tuple, owner: tuple, plan) -> Plan:
    """``plans[key]``, else ``plan()`` kept there (in eager; plans of another owner dropped first: a module's
    weight replaced, or the kernels' module made again); in a compiled step always ``plan()``, which the graph
    traces once (the caller passes no plans there: dynamo would guard on their count, and recompile after
    each eager plan)."""
    if plans is None or torch.compiler.is_compiling():
        return plan()
    if plans.owner is None or any(map(operator.is_not, plans.owner, owner)):
        plans.clear()
        plans.owner = owner
    found = plans.get(key)
    if found is None:
        found = plans[key] = plan()
    return found


def _launched(cached, plan: Plan, *tensors: torch.Tensor) -> torch.Tensor:
    """``plan``'s product of ``tensors`` (the input first) launched by ``cached`` (a ``CachedLaunch``), into an
    output of the plan's, then split-K's runs summed and rounded to the input's dtype where it splits (in eager
    a sum and a cast, which a compiled step fuses into one kernel)."""
    x = tensors[0]
    out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=x.device)
    cached(plan.bound, *tensors, out)
    return out if plan.bound.grid[2] == 1 else out.sum(0).to(x.dtype)


def _plan(launch: Launch, grid: tuple, columns: int, tile: int, tile_m: int, fixed: tuple, shape: tuple,
          x: torch.Tensor, source) -> Plan:  # fmt: skip
    """Either kernel's ``Plan``: ``grid`` (two sizes) given its third, the runs ``_split`` cuts the columns
    into (``columns``: from the first tile's start), and the output: ``shape`` in the input's dtype, or
    split-K's float32 runs of it, ``[split, *shape]``; ``fixed`` and the constexprs bound."""
    split = _split(launch, grid[0] * grid[1], columns, tile)
    grid = (*grid, split)
    bound = triton_launch.bind(grid, fixed, _constexprs(launch, tile_m, tile, x, source), launch.warps, launch.stages)
    return Plan(shape, x.dtype, bound) if split == 1 else Plan((split, *shape), torch.float32, bound)


def _split(launch: Launch, programs: int, columns: int, tile: int) -> int:
    """The runs of columns for ``launch``: its own, or where it leaves them to the product (``split=0``) one
    in eager, where the sum and cast would cost the host more than the card gains (a decode step there waits
    on the host), and ``split_for`` inside a compiled step (whose graph fuses them, and CUDA graphs launch it
    for nothing)."""
    if launch.split:
        return launch.split
    return split_for(programs, columns, tile) if torch.compiler.is_compiling() else 1


def split_for(programs: int, columns: int, tile: int) -> int:
    """The runs that give about ``PROGRAMS`` programs: the least power of two reaching it with runs of at least
    two tiles of ``tile`` (``columns``: from the first tile's start), then as many runs as that cut leaves
    tiles to (9 tiles in 4 runs are runs of 3: three, none empty). Not yet timed on a card."""
    split = 1
    while programs * split < PROGRAMS and columns >= 4 * split * tile:
        split *= 2
    tiles = -(-columns // tile)
    return -(-tiles // -(-tiles // split))


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
    if 0 in kept.weight.shape:  # nothing to read: the dequantized product (an empty or zero result)
        return False
    return runs_on(kept.weight.device, kept.weight.dtype, dtype, kept.scales.dtype, tile_k(kept))


def _loaded(device: torch.device):
    """``fp8_triton`` for a launch on ``device``, where a load-time check has said the kernels run there."""
    source = _source or _import_source(device)
    if source is None:
        raise RuntimeError(f"the weight-only FP8 kernels do not run on {device} (runs_on decides where they do)")
    return source


def _import_source(device: torch.device):
    """``fp8_triton`` where the kernel may run on ``device`` (CUDA with Triton installed; CPU under Triton's
    interpreter), else None, without importing Triton."""
    global _source
    interpreter = os.environ.get("TRITON_INTERPRET", "").lower() not in ("", "0", "false", "off", "no")
    if device.type not in ("cuda", "cpu") or (device.type == "cpu" and not interpreter):
        return None
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        from . import fp8_triton
    except ImportError:  # a Triton that does not import: the dequantized product
        return None

    if device.type == "cpu" and not fp8_triton.INTERPRETED:  # made for the card before the variable was set
        return None
    _source = fp8_triton
    return fp8_triton


@functools.cache
def runs_on(device: torch.device, fp8=torch.float8_e4m3fn, dtype=torch.bfloat16, scales=torch.float32,
            tile: int = 128) -> bool:  # fmt: skip
    """Whether the kernel compiles on ``device`` for these dtypes (the weight's, the compute's, the scales')
    and tile of columns, and computes there what the dequantized path does: products of 1, 20 and 40 rows
    (each tile of rows) with blocks of ``tile`` columns, whole blocks of aligned sizes, a box starting inside
    its blocks (split-K: ``Launch.split``), and one scale for all, against the same rounded weights multiplied
    in float32. CPU: only under Triton's interpreter; no warning where there is nothing to run it."""
    cases = [  # four and about two and a half tiles of columns, whichever the tile (the interpreter's cost)
        (1, (0, 0), (128, tile), (256, 4 * tile), 1),  # sizes and strides aligned to 16 (Triton specializes on it)
        (20, (64, tile // 2), (128, tile), (200, 300 * tile // 128), 2),  # split-K's runs: two tiles and one
        (40, (5, 7), (WHOLE, WHOLE), (200, 300), 1),
    ]
    return _checked("weight-only FP8 kernel", _computes_right, cases, device, fp8, dtype, scales, tile)


def _checked(kernel: str, computes_right, cases: list, device, fp8, dtype, scales, tile: int) -> bool:
    """Whether ``computes_right(device, fp8, dtype, scales, *case)`` holds for every case; a warning naming
    what failed where it does not (a refusal: the weights are dequantized)."""
    source = _import_source(device)
    if source is None:
        return False
    wrong = wrong_cases(cases, functools.partial(computes_right, device, fp8, dtype, scales))
    if wrong:
        warnings.warn(f"hf_parallel: the {kernel} does not compute right on {device} for {fp8} weights, {scales} "
                      f"scales and {dtype} products in tiles of {tile} columns (torch {torch.__version__}, Triton "
                      f"{source.triton.__version__}): {wrong}; those kept FP8 weights are dequantized "
                      f"instead")  # fmt: skip
    return not wrong


def _random_box(generator, experts: tuple, shape: tuple, offset: tuple, block: tuple, fp8, scales) -> KeptFP8:
    """A random FP8 box of ``shape`` at ``offset`` inside its blocks (``experts``: () or (E,), stacked)."""
    grid = [-(-(size + start) // length) for size, start, length in zip(shape, offset, block)]
    device = generator.device
    weight = (torch.randn(*experts, *shape, device=device, generator=generator) * 16).to(fp8)
    scale = (torch.rand(*experts, *grid, device=device, generator=generator) / 64 + 1e-3).to(scales)
    return KeptFP8({}, weight, scale, block, offset)


def _computes_right(device, fp8, dtype, scales, rows: int, offset: tuple, block: tuple, shape: tuple,
                    split: int) -> bool:  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(rows)
    kept = _random_box(generator, (), shape, offset, block, fp8, scales)
    x = torch.randn(rows, shape[1], device=device, generator=generator, dtype=dtype)
    want = x.float() @ kept.dequantize(dtype).float().T
    launch, plans = PLAIN._replace(split=split), Plans()  # launched again as a kept module does: planned
    got = weight_only_fp8(x, kept, launch, plans).float()
    # bf16's rounding of the weights and the output, with room for the interpreter's truncation; a wrong scale,
    # offset or tile is off by far more (scales differ up to 16-fold between blocks)
    return torch.allclose(got, want, rtol=0, atol=2**-6 * want.abs().max().item()) and _again(
        got, lambda: weight_only_fp8(x, kept, launch, plans).float())


def _again(got: torch.Tensor, product) -> bool:
    """Whether ``product()`` launched again (its plan, and the kernel its first launch returned:
    ``triton_launch``) gives ``got`` bit for bit; under the interpreter, which keeps no kernel, not launched."""
    return _source.INTERPRETED or torch.equal(product(), got)


def _expert_scales(stacked: KeptFP8) -> torch.Tensor:
    """A stack's scales as [experts, block rows, block columns] (one scale an expert: [E, 1, 1])."""
    scales = stacked.scales
    return scales if scales.dim() == 3 else scales.reshape(scales.shape[0], 1, 1)


def gathered_takes(stacked, dtype: torch.dtype) -> bool:
    """Whether ``gathered_weight_only_fp8`` multiplies by this stack of experts' FP8 boxes (``kept_experts``:
    [E, outputs, inputs], their scales stacked alike) in ``dtype`` on its device (checked there once)."""
    if not isinstance(stacked, KeptFP8) or stacked.weight.dim() != 3 or stacked.weight.dtype not in FP8_DTYPES:
        return False
    if dtype not in COMPUTE_DTYPES or stacked.scales.dtype not in COMPUTE_DTYPES:
        return False
    weight, scales = stacked.weight, _expert_scales(stacked)
    if weight.stride(-1) != 1 or scales.stride(-1) != 1 or weight.shape[1] * weight.stride(1) >= 2**31:
        return False
    if 0 in weight.shape:
        return False
    tile = _launch_blocks(stacked.block, scales.shape[1:])[2]
    return tile is not None and gathered_runs_on(weight.device, weight.dtype, dtype, stacked.scales.dtype, tile)


def gathered_weight_only_fp8(x: torch.Tensor, ids: torch.Tensor, stacked: KeptFP8, launch: Launch = GATHERED,
                             plans: Plans | None = None) -> torch.Tensor:  # fmt: skip
    """Each row ``p`` of ``x`` ([pairs, inputs]) times expert ``ids[p]``'s weight of the stack, as
    ``F.linear(x[p], stacked[ids[p]].dequantize(x.dtype))`` computes it, in one launch (``gathered_takes``
    has said the kernel runs here). ``plans``: where the caller keeps the stack's launches (``Plans``)."""
    source = _loaded(x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    key = (x.shape, x.stride(0), x.dtype, launch)
    plan = _planned(plans, key, (stacked, source), lambda: _gathered_plan(x, stacked, launch, source))
    return _launched(source.launch_gathered_weight_only_fp8, plan, x, ids)


def _gathered_plan(x: torch.Tensor, stacked: KeptFP8, launch: Launch, source) -> Plan:
    weight, scales = stacked.weight, _expert_scales(stacked)
    (pairs, _), (_, outputs, inputs) = x.shape, weight.shape
    block_rows, block_columns, tile = _launch_blocks(stacked.block, scales.shape[1:])
    tile = _columns_a_step(launch, tile)
    grid = (pairs, -(-outputs // launch.tile_n))
    fixed = (weight, scales, outputs, inputs, x.stride(0), weight.stride(0), weight.stride(1), scales.stride(0),
             scales.stride(1), outputs, stacked.offset[0], stacked.offset[1], block_rows, block_columns)  # fmt: skip
    columns = inputs + stacked.offset[1] % tile
    return _plan(launch, grid, columns, tile, _tile_rows(1, launch), fixed, (pairs, outputs), x, source)


@functools.cache
def gathered_runs_on(device: torch.device, fp8=torch.float8_e4m3fn, dtype=torch.bfloat16, scales=torch.float32,
                     tile: int = 128) -> bool:  # fmt: skip
    """``runs_on`` for the gathered product: 1 and 5 pairs over 3 experts (one expert twice), a box inside
    its blocks (split-K) and one scale an expert, against each pair's product with its expert's dequantized
    weight."""
    cases = [(1, (0, 0), (128, tile), (96, 2 * tile), 1), (5, (64, tile // 2), (128, tile), (70, 300 * tile // 128), 2),
             (5, (5, 7), (WHOLE, WHOLE), (40, 100), 1)]  # fmt: skip
    return _checked("gathered weight-only FP8 kernel", _gathers_right, cases, device, fp8, dtype, scales, tile)


def _gathers_right(device, fp8, dtype, scales, pairs: int, offset: tuple, block: tuple, shape: tuple,
                   split: int) -> bool:  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(pairs)
    stacked = _random_box(generator, (3,), shape, offset, block, fp8, scales)
    ids = torch.tensor([2, 0, 2, 1, 0][:pairs], device=device)
    x = torch.randn(pairs, shape[1], device=device, generator=generator, dtype=dtype)
    expert = [dataclasses.replace(stacked, weight=stacked.weight[e], scales=stacked.scales[e]) for e in range(3)]
    want = torch.stack([x[p].float() @ expert[e].dequantize(dtype).float().T for p, e in enumerate(ids.tolist())])
    launch, plans = GATHERED._replace(split=split), Plans()
    got = gathered_weight_only_fp8(x, ids, stacked, launch, plans).float()
    return torch.allclose(got, want, rtol=0, atol=2**-6 * want.abs().max().item()) and _again(
        got, lambda: gathered_weight_only_fp8(x, ids, stacked, launch, plans).float())
