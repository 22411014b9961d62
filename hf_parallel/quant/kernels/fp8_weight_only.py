"""Kept FP8 weights multiplied as stored by a Triton kernel shipped here (``keep_quantized=True`` on a GPU).

A kept FP8 weight is otherwise dequantized module by module for every product: the whole matrix read as
FP8, written and read again in the compute dtype, in four or five launches. This kernel reads each FP8
element once, scales it in registers by its block's scale, rounds it to the compute dtype as the dequantized
path does, and accumulates the product in float32: one launch, one byte read per weight. It is a weight-only
(W8A16) product, so it computes what the dequantized path computes, up to the order of the sums; the
activations are not quantized (``keep_quantized="fp8"``'s cuBLASLt W8A8 product is ``fp8_scaled_mm``).

Any box of a block-scaled FP8 weight whose scales are float32, bfloat16 or float16: blocks whose columns are
a multiple of 16 (or one scale across the columns), and a shard that starts inside a block (TP at 64 of 128
rows) reads its scales from that offset. A tile of ``TILE_K`` columns (a divisor of the block's columns)
starts on a block boundary of the whole weight, so each tile takes one scale per row. Taken for batches of
up to ``KERNEL_ROWS`` rows (decode steps, small batches), where a product reads more weight than
activations; larger ones (prefill) take the dequantized product (cuBLAS).

With expert ids (``ids``) the same product multiplies each row of a decode step's (token, expert) pairs by
its own expert's weight from a stack of experts' FP8 boxes (``kept_experts``), one launch for all: one host
path for both, ``fp8_triton`` holding a Triton program for each.

Launched through ``triton_launch``: the kernel Triton returns for a key's first launch is called again for
the next ones, without ``JITFunction.run``'s work each call (the host's time, which an eager decode step
waits on); and a kept module's launch for an input shape is worked out once (``LaunchPlans``), so a decode
step's launch again computes no more than its input's and output's part of the key.

Checked on each device before use (``runs_on``: small products against the dequantized product in float32,
each launched twice, the second through the kept kernel and bit for bit the first, once per device and
variant: the weight's, scales' and compute dtypes, the tile of columns, plain or gathered): a card or Triton
that cannot compile it (e4m3 conversions need Ada, Hopper or later) or computes otherwise keeps the
dequantized path, with a warning naming why. On CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1``), which the tests use; there the dot is taken in float32, since the interpreter
multiplies bfloat16 as its integer storage. A one-row product is latency-bound on a large card (it reads half
the bf16 weight's bytes; ``benchmarks/fp8_products.py --sweep`` times the launches, docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import operator
import os
from typing import NamedTuple

import torch

from ..scaled_fp8 import KeptFP8
from . import triton_launch
from .base import SmallBatchKernel, joined, row_boxes_or_reason
from .self_check import checked


class Launch(NamedTuple):
    """How a product is cut and run: the outputs a program computes (``tile_n``), Triton's warps a program and
    pipeline stages, whether the weight's tile is the left operand of the tile products (``swap``: the tensor
    cores read it from registers), the tiles of columns a program loads at once (``unroll``: more bytes in
    flight), and the runs of columns the product is split into (``split``, split-K: as many times the
    programs, each summing its run in float32 into its own output, summed and rounded after by torch: in eager
    two launches more, which a compiled step fuses into one; 0: as ``_split`` chooses), whether the tile
    products go through ``tl.dot`` (``dot``; else a GEMV: each of a program's few rows, ``GEMV_ROWS`` at most,
    multiplied and summed in registers, as Triton GEMV kernels for one-row decode do, e.g. GemLite's), and the
    columns a program takes a step (``tile_k``: 0, the weight's tile, up to 128; else a power of two of at
    least 16 under it, one scale a row still: a GEMV holds rows x ``tile_n`` x ``tile_k`` float32 products a
    step, which at 128 columns spill registers on sm_90). A decode step's product on a large card has fewer
    programs than the card runs at once, each walking every column in turn: latency-bound; split-K and the
    other fields are what ``benchmarks/fp8_products.py --sweep`` varies."""

    tile_n: int
    warps: int
    stages: int
    swap: bool = False
    unroll: int = 1
    split: int = 1
    dot: bool = True
    tile_k: int = 0


# the default launches, plain and gathered: the fastest of the sweep's at decode shapes, where each product's time
# grows with tile_n. ``split=0``: split-K chosen per product inside a compiled step (``_split``), none in eager.
PLAIN = Launch(tile_n=16, warps=4, stages=3, split=0)
GATHERED = Launch(tile_n=16, warps=4, stages=2, split=0)
# the programs a split product aims for: about two a multiprocessor on a large card (130 to 150 of them). A
# constant, as a compiled step cannot ask the card; the sweep times splits on the card
PROGRAMS = 256
GEMV_ROWS = 4  # the rows of a program whose products do not go through ``tl.dot`` (its sums: a tile per row)
# the GEMV launches' outputs a program and columns a step that ``fp8_products.py --sweep`` times: those that compile
# for sm_90 without spilling registers at up to ``GEMV_ROWS`` bfloat16 rows, 4 warps, two tiles loaded at once
# (``tests/test_triton_launch.py`` compiles them); at 128 columns a step every GEMV tile spilled
GEMV_TILES = ((32, 64), (64, 16), (64, 32), (128, 16), (128, 32), (256, 16))
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WHOLE = 1 << 30  # a "block" spanning any weight: one scale along that dim
_source = None  # ``fp8_triton``, once ``runs_on`` has imported it


class FP8WeightOnlyKernel(SmallBatchKernel):
    """A kept FP8 weight in boxes of whole rows (``boxes``: one, or a packed weight's parts), each multiplied
    as stored by ``weight_only_product``, its launches for each input shape worked out once (``plans``: a
    box's each)."""

    way = "FP8 kernel"

    @classmethod
    def can_serve(cls, weight) -> tuple[bool, str]:
        boxes, why = row_boxes_or_reason(weight)
        for box, shape in boxes:  # every box through the kernel, or none
            why = refusal(box, shape, weight.dtype)
            if why:
                break
        return not why, why

    def __init__(self, weight):
        super().__init__(weight)
        self.boxes = [box for box, _ in weight.row_boxes]
        self.plans = [LaunchPlans() for _ in self.boxes]

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        # none while compiling: dynamo guards a dict it reads on its length, so each eager plan would recompile
        plans = [None] * len(self.boxes) if torch.compiler.is_compiling() else self.plans
        return joined([weight_only_product(x, box, plans=p) for box, p in zip(self.boxes, plans)])


def tile_k(kept: KeptFP8, experts: bool = False) -> int | None:
    """The columns of a tile for this weight (``experts``: a stack of experts' boxes): the largest power of two
    up to 128 dividing its blocks' columns (one scale per row in each tile), or None where that is under 16
    (``tl.dot``'s least)."""
    return _launch_blocks(kept.block, _scales(kept, experts).shape[-2:])[2]


def _launch_blocks(block: tuple, grid) -> tuple[int, int, int | None]:
    """A launch's block rows and columns (``WHOLE`` where one scale spans that dim: ``grid``, the scales' rows
    and columns, is 1 there) and its tile of columns (``tile_k``)."""
    rows, columns = (size if count > 1 else WHOLE for size, count in zip(block, grid))
    tile = 128 if grid[1] == 1 else math.gcd(block[1], 128)
    return rows, columns, tile if tile >= 16 else None


def _scales(kept: KeptFP8, experts: bool) -> torch.Tensor:
    """A box's scales as [block rows, block columns], a stack's as [experts, block rows, block columns] (one
    scale for all: [1, 1], or [E, 1, 1])."""
    lead = kept.weight.shape[:1] if experts else ()
    return kept.scales if kept.scales.dim() == 2 + experts else kept.scales.reshape(*lead, 1, 1)


def weight_only_product(x: torch.Tensor, kept: KeptFP8, launch: Launch | None = None,
                        plans: LaunchPlans | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, kept.dequantize(x.dtype))`` from the stored bytes, in one launch (and split-K's sum where
    it splits: ``_split``; ``x``: at most ``KERNEL_ROWS`` rows once flattened; ``runs_on`` has said the kernel
    runs on its device). With expert ids, each row ``p`` of ``x`` ([pairs, inputs]) times expert ``ids[p]``'s
    weight of the stack ``kept`` ([E, outputs, inputs]), as ``F.linear(x[p], kept[ids[p]].dequantize(x.dtype))``.
    ``launch``: ``PLAIN`` or ``GATHERED`` unless given; ``plans``: where the caller keeps this weight's launches."""
    source, experts = _loaded(x.device), ids is not None
    launch = launch if launch is not None else GATHERED if experts else PLAIN
    if experts:  # its rows a stride of any size apart
        x = x if x.stride(-1) == 1 else x.contiguous()
        key = (x.shape, x.stride(0), x.dtype, launch)
    else:  # its rows a stride of ``inputs`` apart: no reshape (host time)
        x = x if x.is_contiguous() else x.contiguous()
        key = (x.shape, x.dtype, launch)
    plan = _planned(plans, key, (kept, source), lambda: _launch_plan(x, kept, launch, source, experts))
    if experts:
        return _launched(source.launch_gathered_weight_only_fp8, plan, x, ids)
    return _launched(source.launch_weight_only_fp8, plan, x)


def _launch_plan(x: torch.Tensor, kept: KeptFP8, launch: Launch, source, experts: bool) -> LaunchPlan:
    """The ``LaunchPlan`` of ``x``'s product: a program a tile of rows (a pair, gathered) and of ``tile_n``
    outputs, the arguments of ``fp8_triton``'s plain or gathered program."""
    weight, scales = kept.weight, _scales(kept, experts)
    (outputs, inputs), rows = weight.shape[-2:], math.prod(x.shape[:-1])
    block_rows, block_columns, tile = _launch_blocks(kept.block, scales.shape[-2:])
    tile = _columns_a_step(launch, tile)
    tile_m = _tile_rows(1 if experts else rows, launch)
    grid = (rows if experts else -(-rows // tile_m), -(-outputs // launch.tile_n))
    blocks = (kept.offset[0], kept.offset[1], block_rows, block_columns)
    if experts:  # each pair's expert's weight and scales: a stride along the experts' dim, then the rows'
        strides = (x.stride(0), weight.stride(0), weight.stride(1), scales.stride(0), scales.stride(1))
        fixed = (weight, scales, outputs, inputs, *strides, outputs, *blocks)
    else:
        fixed = (weight, scales, rows, outputs, inputs, inputs, weight.stride(0), scales.stride(0), outputs, *blocks)
    columns = inputs + kept.offset[1] % tile
    shape = (rows, outputs) if experts else (*x.shape[:-1], outputs)
    split = _split(launch, grid[0] * grid[1], columns, tile)
    constexprs = _constexprs(launch, tile_m, tile, x, source)
    bound = triton_launch.bind((*grid, split), fixed, constexprs, launch.warps, launch.stages)
    return LaunchPlan(shape, x.dtype, bound) if split == 1 else LaunchPlan((split, *shape), torch.float32, bound)


def _constexprs(launch: Launch, tile_m: int, tile: int, x: torch.Tensor, source) -> dict:
    """Both programs' constexprs, in their order: the dot taken in float32 for float32 inputs and under the
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


class LaunchPlan(NamedTuple):
    """A kept weight's product for inputs of one shape and dtype, all but its input and output worked out:
    its output's shape and dtype (split-K's runs: float32) and its launch, bound (``triton_launch.bind``)."""

    out_shape: tuple
    out_dtype: torch.dtype
    bound: triton_launch.Bound


class LaunchPlans(dict):
    """A kept weight's ``LaunchPlan`` per input shape, dtype and launch, worked out at its first product in eager
    and reused after (the host's time: a decode step's product repeats one shape); a kernel keeps one for each
    box it multiplies. ``owner``: the weight they are for and the programs' module (``fp8_triton``, made for a
    card or for Triton's interpreter): another's product drops them all. A weight's box is replaced whole,
    never a field of it. A copy starts empty: a plan holds the tensors and addresses it was worked out for."""

    owner: tuple | None = None

    def __deepcopy__(self, memo) -> LaunchPlans:
        return LaunchPlans()

    def __reduce__(self):
        return LaunchPlans, ()


def _planned(plans: LaunchPlans | None, key: tuple, owner: tuple, plan) -> LaunchPlan:
    """``plans[key]``, else ``plan()`` kept there (in eager; plans of another owner dropped first: a module's
    weight replaced, or the programs' module made again); in a compiled step always ``plan()``, which the graph
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


def _launched(cached, plan: LaunchPlan, *tensors: torch.Tensor) -> torch.Tensor:
    """``plan``'s product of ``tensors`` (the input first) launched by ``cached`` (a ``CachedLaunch``), into an
    output of the plan's, then split-K's runs summed and rounded to the input's dtype where it splits (in eager
    a sum and a cast, which a compiled step fuses into one kernel)."""
    x = tensors[0]
    out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=x.device)
    cached(plan.bound, *tensors, out)
    return out if plan.bound.grid[2] == 1 else out.sum(0).to(x.dtype)


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
    tiles to (9 tiles in 4 runs are runs of 3: three, none empty)."""
    split = 1
    while programs * split < PROGRAMS and columns >= 4 * split * tile:
        split *= 2
    tiles = -(-columns // tile)
    return -(-tiles // -(-tiles // split))


def takes(kept, shape: tuple | None, dtype: torch.dtype, experts: bool = False) -> bool:
    """Whether the kernel multiplies this kept box as a weight of ``shape`` in ``dtype`` on its device (checked
    there once); ``experts``: a stack of experts' boxes [E, outputs, inputs] (``shape``: None, or the stack's)."""
    return not refusal(kept, shape, dtype, experts)


def refusal(kept, shape: tuple | None, dtype: torch.dtype, experts: bool = False) -> str:
    """Why the kernel does not multiply this kept box (``takes``), or "" where it does."""
    if not isinstance(kept, KeptFP8) or kept.weight.dtype not in FP8_DTYPES or kept.weight.dim() != 2 + experts:
        return "not a box of FP8 weights" + (" stacked by expert" if experts else "")
    if dtype not in COMPUTE_DTYPES:
        return f"no product in {dtype}"
    if kept.scales.dtype not in COMPUTE_DTYPES:  # power-of-two scales stored as e8m0: dequantized
        return f"its scales are {kept.scales.dtype}"
    weight, scales, lead = kept.weight, _scales(kept, experts), int(experts)
    if shape is not None and tuple(weight.shape) != tuple(shape):
        return f"its box {tuple(weight.shape)} is not the weight's {tuple(shape)}"
    if weight.stride(-1) != 1 or scales.stride(-1) != 1:  # the kernel steps along rows of the weight and scales
        return "its rows are not contiguous"
    if weight.shape[lead] * weight.stride(lead) >= 2**31:  # its offsets are 32-bit
        return "its box spans 2**31 elements or more"
    if tile_k(kept, experts) is None:
        return f"its blocks' columns ({kept.block[1]}) are not a multiple of 16"
    if 0 in weight.shape:  # nothing to read: the dequantized product (an empty or zero result)
        return "its box is empty"
    if not runs_on(weight.device, weight.dtype, dtype, kept.scales.dtype, tile_k(kept, experts), experts):
        return f"the kernel does not run on {weight.device} for these dtypes (runs_on)"
    return ""


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
            tile: int = 128, experts: bool = False) -> bool:  # fmt: skip
    """Whether the kernel compiles on ``device`` for these dtypes (the weight's, the compute's, the scales')
    and tile of columns, and computes there what the dequantized path does: products of 1, 20 and 40 rows
    (each tile of rows; ``experts``: 1 and 5 pairs over 3 experts, one expert twice) with blocks of ``tile``
    columns, whole blocks of aligned sizes, a box starting inside its blocks (split-K: ``Launch.split``), and
    one scale for all (an expert), against the same rounded weights multiplied in float32. CPU: only under
    Triton's interpreter; no warning where there is nothing to run it."""
    source = _import_source(device)
    if source is None:
        return False
    if experts:
        cases = [(1, (0, 0), (128, tile), (96, 2 * tile), 1), (5, (64, tile // 2), (128, tile),
                 (70, 300 * tile // 128), 2), (5, (5, 7), (WHOLE, WHOLE), (40, 100), 1)]  # fmt: skip
    else:  # four and about two and a half tiles of columns, whichever the tile (the interpreter's cost)
        cases = [
            (1, (0, 0), (128, tile), (256, 4 * tile), 1),  # sizes and strides aligned to 16 (Triton specializes on it)
            (20, (64, tile // 2), (128, tile), (200, 300 * tile // 128), 2),  # split-K's runs: two tiles and one
            (40, (5, 7), (WHOLE, WHOLE), (200, 300), 1),
        ]
    kernel = "the gathered weight-only FP8 kernel" if experts else "the weight-only FP8 kernel"
    where = (f"on {device} for {fp8} weights, {scales} scales and {dtype} products in tiles of {tile} columns "
             f"(torch {torch.__version__}, Triton {source.triton.__version__})")  # fmt: skip
    computes_right = functools.partial(_computes_right, device, fp8, dtype, scales, experts)
    return checked(kernel, where, cases, computes_right, "those kept FP8 weights are dequantized instead")


def _random_box(generator, experts: tuple, shape: tuple, offset: tuple, block: tuple, fp8, scales) -> KeptFP8:
    """A random FP8 box of ``shape`` at ``offset`` inside its blocks (``experts``: () or (E,), stacked)."""
    grid = [-(-(size + start) // length) for size, start, length in zip(shape, offset, block)]
    device = generator.device
    weight = (torch.randn(*experts, *shape, device=device, generator=generator) * 16).to(fp8)
    scale = (torch.rand(*experts, *grid, device=device, generator=generator) / 64 + 1e-3).to(scales)
    return KeptFP8({}, weight, scale, block, offset)


def _computes_right(device, fp8, dtype, scales, experts: bool, rows: int, offset: tuple, block: tuple,
                    shape: tuple, split: int) -> bool:  # fmt: skip
    """One of ``runs_on``'s cases: ``rows`` rows (``experts``: pairs over a stack of three experts' boxes) times
    a random box, against the dequantized weights' product in float32, then launched again."""
    generator = torch.Generator(device=device).manual_seed(rows)
    kept = _random_box(generator, (3,) if experts else (), shape, offset, block, fp8, scales)
    ids = torch.tensor([2, 0, 2, 1, 0][:rows], device=device) if experts else None
    x = torch.randn(rows, shape[1], device=device, generator=generator, dtype=dtype)
    if experts:
        one = [dataclasses.replace(kept, weight=kept.weight[e], scales=kept.scales[e]) for e in range(3)]
        want = torch.stack([x[p].float() @ one[e].dequantize(dtype).float().T for p, e in enumerate(ids.tolist())])
    else:
        want = x.float() @ kept.dequantize(dtype).float().T
    launch, plans = (GATHERED if experts else PLAIN)._replace(split=split), LaunchPlans()  # as a kept module does
    got = weight_only_product(x, kept, launch, plans, ids=ids).float()
    # bf16's rounding of the weights and the output, with room for the interpreter's truncation; a wrong scale,
    # offset or tile is off by far more (scales differ up to 16-fold between blocks)
    return torch.allclose(got, want, rtol=0, atol=2**-6 * want.abs().max().item()) and _again(
        got, lambda: weight_only_product(x, kept, launch, plans, ids=ids).float())


def _again(got: torch.Tensor, product) -> bool:
    """Whether ``product()`` launched again (its plan, and the kernel its first launch returned:
    ``triton_launch``) gives ``got`` bit for bit; under the interpreter, which keeps no kernel, not launched."""
    return _source.INTERPRETED or torch.equal(product(), got)
