"""Kept int4 weights (GPTQ, AWQ, compressed-tensors' pack-quantized W4A16) multiplied by torch's own int4
kernels (``keep_quantized="int4"``).

A kept int4 weight is otherwise unpacked and scaled module by module for every product, which costs a
decode step far more than the product itself. torch ships weight-only int4 kernels, the ones torchao's int4
layout runs on (tinygemm): ``_weight_int4pack_mm`` on CUDA and ``_weight_int4pack_mm_for_cpu`` (vectorised). They
take unsigned 4-bit values in groups of 32 to 256 inputs with ``W = (q - 8) * scale + zero`` per group and
output: GPTQ's, AWQ's and compressed-tensors' ``(q - z) * s`` (a kept box's ``grouped_values``: the values
unsigned as stored) is that with ``scale = s``, ``zero = (8 - z) * s``. A format's group of any size
from 32 inputs (a scale per output row included) is cut into the kernel's groups, each with its scale.

At load each kept box is repacked once into the kernel's layout (``int4_pack``), beside the stored words that
a save writes back: about one more byte per two weights, plus the scales and zeros in the compute dtype; so
it is asked for by name, where ``keep_quantized=True`` holds the stored bytes alone. The
inputs go into the kernel's contraction group by group: in place where they are in group order and a kernel's
group size divides every group's count in the box (whole groups, a shard starting inside a group at a multiple
of 32); otherwise (act-order, odd cuts) each group's inputs fill chunks of 32 slots, each chunk with its
group's scale and zero, and the activations are spread into those slots for each product (unused slots: zero
activations); an act-order shard touches most groups, so whole groups would make every
row-parallel rank hold and multiply about the full contraction. Outputs are padded to 16 for the kernels'
tiles.

The values are the dequantized path's, computed otherwise: the kernels take each group's scale and zero in the
compute dtype (CUDA: bfloat16 only), so in bfloat16 every weight of a group moves together, by up to the
rounding of the group's largest weight (as with torchao's int4 layout); in float32, within float32's. Taken for
batches of up to ``KERNEL_ROWS`` rows (decode steps, small batches); a prefill, an input that needs a
gradient (no backward) or of another dtype take the dequantized product. Checked on each device and dtype
at load (``runs_on``: small products against the same weights in float32); a refusal warns and dequantizes.

Experts (``kept_experts``, on CPU): each expert's box of a part is packed so, and the experts' packs stacked
(``stacked``: one form for all, else the experts are dequantized); a step's (token, expert) pairs, at most as
many as the experts, each take a call with their expert's pack (``int4_product`` with expert ids).

A kept linear holds ``Int4TorchKernel``: its boxes' packs, each multiplied by the kernel, the products joined.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..compressed_tensors import KeptIntegers
from ..gptq_awq import KeptGrouped
from .base import Refused, SmallBatchKernel, joined, row_boxes_or_reason
from .self_check import checked

GROUPS = (32, 64, 128, 256)  # the group sizes the kernels take
CHUNK = 32  # the kernel's group where the format's groups are not all whole in the shard
PAD = 16  # the kernels' outputs come in tiles of 16 (CPU) or 8 (CUDA)
COMPUTE_DTYPES = {"cpu": (torch.bfloat16, torch.float16, torch.float32), "cuda": (torch.bfloat16,)}


class Int4Pack(NamedTuple):
    packed: torch.Tensor  # the kernel's layout of the values [outputs padded, width]
    scales_and_zeros: torch.Tensor  # [width / group, outputs padded, 2], the compute dtype
    group: int
    width: int  # the kernel's contraction: whole groups
    slots: torch.Tensor | None  # each input's place in it (None: in place)
    outputs: int


class Int4TorchKernel(SmallBatchKernel):
    """A kept GPTQ / AWQ / compressed-tensors int4 weight in boxes of whole rows, each multiplied by torch's
    int4 kernel from its pack (``packs``: a box's each, repacked at load)."""

    way = "int4 kernel"

    @classmethod
    def can_serve(cls, weight) -> tuple[bool, str]:
        boxes, why = row_boxes_or_reason(weight)
        for box, shape in boxes:  # every box through the kernel, or none
            if not _takes(box, shape, weight.dtype):
                why = (f"not a 4-bit GPTQ / AWQ / compressed-tensors box in groups of {CHUNK} inputs or more, or no "
                       f"kernel on {weight.device} in {weight.dtype}")  # fmt: skip
            elif not runs_on(box.words.device, weight.dtype):
                why = f"the kernel does not compute right on {box.words.device} in {weight.dtype} (its check, warned)"
            if why:
                break
        return not why, why

    def __init__(self, weight):
        super().__init__(weight)
        self.packs = [int4_pack(box, shape, weight.dtype) for box, shape in weight.row_boxes]
        if None in self.packs:
            raise Refused("a box's groups are not its format's (no pack)")

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        return joined([int4_product(x, pack) for pack in self.packs])


def int4_pack(kept, shape: tuple, dtype: torch.dtype) -> Int4Pack | None:
    """The kernel's form of a kept box that is a weight of ``shape`` in ``dtype``, or None where the kernels do
    not take it (8 bits, groups of fewer than 32 inputs, a dtype or device without the kernel, the device's
    check failed)."""
    if not _takes(kept, shape, dtype) or not runs_on(kept.words.device, dtype):
        return None
    values, zero, scales, groups, group, _ = kept.grouped_values()
    return _packed(values, zero, scales, groups, group, dtype)


def _takes(kept, shape: tuple, dtype: torch.dtype, device_type: str | None = None) -> bool:
    """Whether the kernels on ``device_type`` (else the box's device) take ``kept`` as a weight of ``shape`` in
    ``dtype`` (before the device's check)."""
    if not isinstance(kept, (KeptGrouped, KeptIntegers)) or kept.bits != 4 or kept.group < CHUNK:
        return False
    computes = COMPUTE_DTYPES.get(device_type or kept.words.device.type, ())
    return tuple(kept.shape) == tuple(shape) and dtype in computes and 0 not in shape


class PackForm(NamedTuple):
    """What ``int4_pack`` makes of a box, its tensors aside: experts' packs stack where their forms are one."""

    group: int
    width: int
    outputs: int
    in_place: bool
    nbytes: int  # its tensors' bytes: the layout, the scales and zeros, the slots


def pack_form(kept, shape: tuple, dtype: torch.dtype) -> PackForm | None:
    """``int4_pack``'s form of ``kept`` as a weight of ``shape`` in ``dtype``, from the box's groups alone: a
    box kept with ``meta`` (no weight read) gives a plan's figure. None where the CPU's kernel does not take
    it (CUDA's takes bfloat16 only; the same bytes)."""
    if not _takes(kept, shape, dtype, "cpu"):
        return None
    groups = kept.groups("cpu")
    contraction = _contraction(groups, kept.group)
    if contraction is None:
        return None
    step, _, slots, width, in_place = contraction
    rows = -(-shape[0] // PAD) * PAD
    nbytes = rows * width // 2 + width // step * rows * 2 * dtype.itemsize + (0 if in_place else slots.nbytes)
    return PackForm(step, width, shape[0], in_place, nbytes)


def _contraction(groups: torch.Tensor, group: int):
    """The kernel's contraction of a box whose inputs are in ``groups`` (each input's group, from 0): the
    kernel's group, each of the box's groups' chunks of it, each input's slot and the width; None where a group
    has more inputs than the format's ``group`` (not this format); and whether every slot is its input's own
    (in place: no activations spread). The kernel's group is the largest of
    ``GROUPS`` that divides the box's count of inputs in every group (a format's whole groups of 128 stay 128;
    a scale per output row, or a shard starting inside a group, take the largest that fits); where none does
    (act-order shards touch most groups with a few inputs each) each group's inputs fill chunks of ``CHUNK``
    slots, each chunk with its group's scale and zero, so the contraction stays about the shard's own width."""
    inputs, device = len(groups), groups.device
    order = torch.argsort(groups, stable=True)
    ranked = groups[order]
    within = torch.arange(inputs, device=device) - torch.searchsorted(ranked, ranked)  # rank inside its group
    counts = torch.bincount(groups)
    if inputs and int(counts.max()) > group:
        return None
    step = next((size for size in reversed(GROUPS) if not bool((counts % size).any())), CHUNK)
    chunks = -(-counts // step)
    starts = (torch.cumsum(chunks, 0) - chunks) * step  # each group's first slot
    slots = torch.empty_like(order)
    slots[order] = starts[ranked] + within
    width = int(chunks.sum()) * step
    return step, chunks, slots, width, width == inputs and torch.equal(slots, torch.arange(inputs, device=device))


def _packed(values, zero, scales, groups, group: int, dtype) -> Int4Pack | None:
    """``values`` [outputs, inputs] (unsigned), ``zero`` / ``scales`` [groups, outputs], ``groups``: each
    input's row in them; in the kernel's contraction (``_contraction``)."""
    outputs, device = values.shape[0], values.device
    contraction = _contraction(groups, group)
    if contraction is None:
        return None
    step, chunks, slots, width, in_place = contraction
    if len(chunks) > scales.shape[0]:  # an input in a group the scales do not have: not this format
        return None
    chunks = torch.nn.functional.pad(chunks, (0, scales.shape[0] - len(chunks)))  # groups past the last input's
    rows = -(-outputs // PAD) * PAD
    codes = torch.full((rows, width), 8, dtype=torch.int32, device=device)  # unused slots: zero activations
    codes[:outputs].index_copy_(1, slots, values.to(torch.int32))
    scale_zero = torch.zeros(width // step, rows, 2, device=device)
    scale_zero[:, :outputs, 0] = scales.repeat_interleave(chunks, 0)
    scale_zero[:, :outputs, 1] = ((8 - zero) * scales).repeat_interleave(chunks, 0)
    packed = _kernel_layout(codes)
    return Int4Pack(packed, scale_zero.to(dtype), step, width, None if in_place else slots, outputs)


def stacked(packs: list) -> Int4Pack | None:
    """Experts' packs (one weight's part, an expert each) as one, each tensor stacked along a new leading dim:
    where every expert's pack is there and in one form (the kernel's group, the contraction, the outputs, the
    inputs in place or spread); else None (act-order experts each spread their own way: widths differ)."""
    if not packs or None in packs:
        return None
    form = {(p.group, p.width, p.outputs, p.slots is None) for p in packs}
    if len(form) != 1:
        return None
    slots = None if packs[0].slots is None else torch.stack([p.slots for p in packs])
    return packs[0]._replace(packed=torch.stack([p.packed for p in packs]), slots=slots,
                             scales_and_zeros=torch.stack([p.scales_and_zeros for p in packs]))  # fmt: skip


def _kernel_layout(codes: torch.Tensor) -> torch.Tensor:
    """[rows, width] int32 values 0-15 as the device's kernel reads them."""
    if codes.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    width = codes.shape[1]
    tiles = 8 if width % 128 == 0 else 4 if width % 64 == 0 else 2  # inner k tiles: width is a multiple of 32
    return torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), tiles)


def int4_product(x: torch.Tensor, pack: Int4Pack, ids: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for the weight ``pack`` holds, ``x`` in the compute dtype it was packed for. With expert ids,
    ``pack`` is experts' packs ``stacked`` and each row ``p`` of ``x`` ([pairs, inputs]) is multiplied by expert
    ``ids[p]``'s weight: a product a row, its expert's pack selected by ``index_select`` (no id read on the
    host: it traces whole, a graph for each count of rows, as any compiled step is one for its shapes). torch
    has no grouped int4 kernel, so this is a kernel call a row; on CPU that is still far less than dequantizing
    the rows' experts (``benchmarks/decode.py``, docs/benchmarks.md)."""
    if ids is None:
        return _product(x, pack)
    rows = []
    for p in range(x.shape[0]):
        expert = ids[p : p + 1]
        pick = lambda t: None if t is None else t.index_select(0, expert)[0]  # noqa: E731
        one = pack._replace(packed=pick(pack.packed), scales_and_zeros=pick(pack.scales_and_zeros),
                            slots=pick(pack.slots))  # fmt: skip
        rows.append(_product(x[p : p + 1], one))
    return torch.cat(rows) if rows else x.new_empty(0, pack.outputs)


def _product(x: torch.Tensor, pack: Int4Pack) -> torch.Tensor:
    """One pack's product by the device's kernel."""
    flat = x.reshape(-1, x.shape[-1])
    if pack.slots is not None:
        flat = flat.new_zeros(flat.shape[0], pack.width).index_copy_(1, pack.slots, flat)
    elif not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.device.type == "cpu":
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, pack.packed, pack.group, pack.scales_and_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm(flat, pack.packed, pack.group, pack.scales_and_zeros)
    return out[:, : pack.outputs].reshape(*x.shape[:-1], pack.outputs)


@functools.cache
def runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's int4 kernel on ``device`` computes in ``dtype`` what the format says: products of 1 to
    40 rows, each of the kernel's groups (32 to 256), outputs padded, inputs in place and spread to chunks,
    contractions of 96, 480, 128, 256 and 256 (CUDA's tiles of 2, 4 and 8 x 16 columns), against the same
    weights in float32 (within the compute dtype's rounding of the scales and zeros)."""
    cases = [(1, 32, 48, 3, False), (5, 128, 64, 4, True), (40, 64, 16, 2, False), (3, 128, 32, 2, False),
             (2, 256, 32, 1, False)]  # rows, the format's group, outputs, groups, spread  # fmt: skip
    return checked("torch's int4 kernel", f"on {device} in {dtype} (torch {torch.__version__})", cases,
                   functools.partial(_computes_right, device, dtype), "kept int4 weights are dequantized per module")


def _computes_right(device, dtype, rows: int, group: int, outputs: int, count: int, spread: bool) -> bool:
    generator = torch.Generator(device=device).manual_seed(rows)
    inputs = count * group - (group // 4 if spread else 0)  # spread: the last group 3/4 full (chunks of 32)
    values = torch.randint(0, 16, (outputs, inputs), generator=generator, device=device, dtype=torch.uint8)
    zero = torch.randint(0, 16, (count, outputs), generator=generator, device=device).float()
    scales = torch.rand(count, outputs, generator=generator, device=device) / 16 + 1e-3
    groups = torch.arange(inputs, device=device) // group
    if spread:
        groups = groups[torch.randperm(inputs, generator=generator, device=device)]
    pack = _packed(values, zero, scales, groups, group, dtype)
    weight = (values.float() - zero.T[:, groups]) * scales.T[:, groups]
    x = torch.randn(rows, inputs, generator=generator, device=device).to(dtype)
    want = x.float() @ weight.T
    got = int4_product(x, pack).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-6  # the scales' and zeros' rounding, and the output's
    within = torch.allclose(got, want, rtol=0, atol=tolerance * want.abs().max().item())
    return within and (pack.slots is not None) == spread and pack.group == (CHUNK if spread else group)
