"""Quantized checkpoints: which formats hf_parallel reads, each read like a safetensors slice (any box
of the weight, dequantized), so every rank reads only its slice of the weight and of its scales through
the same layouts as any other tensor, never dequantized whole on one rank. By default the model holds plain
floats in the dtype asked for (as transformers does on a CPU) and saves them so, without
``quantization_config``; with ``keep_quantized=True`` each rank holds its boxes as stored (``Kept``,
``tensor/kept.py``) and saves them back as the checkpoint had them.

- FP8 with block scales (``quant_method: "fp8"``, ``weight_block_size: [bm, bn]``; DeepSeek-V3/R1,
  Qwen3-*-FP8, GLM-4.5-FP8): ``W[i, j] = q[i, j] * s[i // bm, j // bn]``, ``q`` float8 and ``s`` the
  ``<name>_scale_inv`` tensor beside it. A box of rows ``[a, b)`` reads the scale rows of the blocks it
  touches, ``[a // bm, ceil(b / bm))``, so a shard boundary inside a block (64 of 128 rows) is exact: each
  row takes the scale of the block it came from. compressed-tensors' float-quantized 8-bit weights (the
  ``*-FP8-dynamic`` repacks) are the same with ``<name>_scale`` per tensor, per output row or per block.
- compressed-tensors' pack-quantized integers (the ``*-W4A16`` / ``*-W8A16`` repacks): ``<name>_packed``
  int32 words of 32 / bits values each along the input dim (offset to unsigned), ``<name>_scale`` per
  group of columns or per row, ``<name>_zero_point`` packed along the rows where asymmetric,
  ``<name>_shape``; ``W = (q - z) * s``. The format is the checkpoint's (unpacked here in a few lines;
  the tests write it with compressed-tensors' own packer and read it back with transformers).
- MXFP4 (gpt-oss's experts): ``<name>_blocks`` uint8 [E, out, in / 32, 16], two e2m1 codes a byte (low
  nibble first), ``<name>_scales`` e8m0 [E, out, in / 32]; the parameter is the transpose [E, in, out].
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import NamedTuple

import torch

from .errors import CheckpointError
from .writer import torch_dtype

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
GROUPED_DTYPES = {"qweight": (torch.int32,), "qzeros": (torch.int32,), "scales": FLOATS,
                  "g_idx": (torch.int32, torch.int64)}  # GPTQ's and AWQ's parts, as stored  # fmt: skip
EXPONENTS = (torch.uint8, torch.float8_e8m0fnu)  # MXFP4's scales: biased exponents (127 = 2**0)
SUPPORTED = (
    "fp8 (block-wise weight_scale_inv), compressed-tensors float-quantized 8-bit (per-tensor, per-channel or block "
    "weight_scale) and pack-quantized 4/8-bit integers (per group or channel, with or without zero points), "
    "mxfp4 (gpt-oss's experts), gptq (4 or 8 bits, formats gptq and gptq_v2, act-order) and awq (4 bits, version gemm, "
    "zero points)"
)
ACTIVATION_SCALE = "input_scale"  # static activation scales: unused once the weights are dequantized
PARTS = ("_scale_inv", "_scale", "_blocks", "_scales", "_packed", "_zero_point", "_shape",  # every format's parts
         ".qweight", ".qzeros", ".scales", ".g_idx")


class _Suffixed:
    """A format whose parts are keyed by a suffix on the weight's key (``<name>_scale``)."""

    stored_as: str | None  # the part whose key marks the weight as stored in parts (None: its own key)

    def part_key(self, key: str, part: str) -> str:
        return key + part

    def weight_key(self, stored: str) -> str:
        return stored[: -len(self.stored_as)]


@dataclass(frozen=True)
class ScaledFP8(_Suffixed):
    """How a checkpoint's FP8 weights are scaled, as its config states it."""

    strategy: str  # "block": a scale per block of the weight; "channel": per output row; "tensor": one
    block: tuple[int, int] | None  # (rows, columns) each scale covers, for "block"
    suffix: str  # the scale's key: "<module>.weight" + suffix ("_scale_inv" for fp8, "_scale" for compressed-tensors)
    stored_as = None  # the weight keeps its own key (float8)

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.suffix,)

    def block_for(self, shape) -> tuple[int, int]:
        rows, columns = shape
        return {"block": self.block, "channel": (1, columns), "tensor": (rows, columns)}[self.strategy]


@dataclass(frozen=True)
class PackedIntegers(_Suffixed):
    """compressed-tensors' pack-quantized weights, as its config states them."""

    bits: int
    strategy: str  # "group": a scale per row and group of columns; "channel": per row
    group: int | None
    symmetric: bool  # else a zero point per scale, packed along the rows
    stored_as = "_packed"  # the weight's key is "<name>_packed" (and its other parts beside it)
    parts = ("_packed", "_scale", "_zero_point", "_shape")

    def block_for(self, shape) -> tuple[int, int]:
        return (1, self.group if self.strategy == "group" else shape[1])


@dataclass(frozen=True)
class MXFP4(_Suffixed):
    """gpt-oss's MXFP4 experts (the config says no more)."""

    stored_as = "_blocks"
    parts = ("_blocks", "_scales")


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: output order[i] of each 8 is the word's value i


@dataclass(frozen=True)
class GroupedIntegers:
    """GPTQ's and AWQ's integer weights, as their configs state them. Each linear module's matrix is stored
    transposed (inputs along the rows) under the module's own name, not the weight's: ``<module>.qweight``
    int32, ``32 // bits`` values a word (GPTQ: along the inputs; AWQ: along the outputs, in ``AWQ_ORDER``),
    ``<module>.scales`` [groups, out] per group of inputs, ``<module>.qzeros`` [groups, out] packed along the
    outputs as qweight's outputs are, and GPTQ's ``<module>.g_idx`` [in]: each input's group (any group under
    act-order). ``W[o, i] = (q[i, o] - z[g, o]) * s[g, o]`` with ``g = g_idx[i]`` (AWQ: ``i // group``), values
    unsigned, ``z`` the stored zero point plus ``zero_offset``."""

    method: str  # "gptq" or "awq"
    bits: int
    group: int  # inputs per group; -1: one group of all the inputs
    zero_offset: int  # GPTQ's "gptq" (v1) format stores zero - 1; "gptq_v2" and AWQ store the zero
    stored_as = "qweight"

    @property
    def parts(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales") + (("g_idx",) if self.method == "gptq" else ())

    @property
    def order(self) -> tuple[int, ...] | None:
        return AWQ_ORDER if self.method == "awq" else None

    def part_key(self, key: str, part: str) -> str:
        return f"{key.rpartition('.')[0]}.{part}"

    def weight_key(self, stored: str) -> str:
        return f"{stored.rpartition('.')[0]}.weight"


Quantization = ScaledFP8 | PackedIntegers | MXFP4 | GroupedIntegers


def _refused(config, what: str) -> ValueError:
    return ValueError(
        f"{type(config).__name__} has a quantization_config ({what}): hf_parallel reads {SUPPORTED}; not "
        "GPTQ's 2 or 3 bits or its other formats, AWQ's other versions, bitsandbytes, HQQ, torchao, fp8 without "
        "weight_block_size, compressed-tensors' other formats or its KV-cache "
        "scales yet (their weights would load without their scales); load a dequantized (bf16 / fp32) copy"
    )


def _compressed_tensors(config, get) -> ScaledFP8 | PackedIntegers:
    """compressed-tensors: every group's weights float8 (float-quantized) or 4/8-bit integers (pack-quantized),
    one scheme throughout."""
    found = {
        (w.get("num_bits"), w.get("type"), w.get("symmetric", True), w.get("strategy"),
         tuple(w.get("block_structure") or ()), w.get("group_size"), w.get("actorder"))
        for w in (group.get("weights") or {} for group in (get("config_groups") or {}).values())
    }  # fmt: skip
    form = get("format")
    if form not in ("float-quantized", "pack-quantized") or len(found) != 1:
        raise _refused(config, f"quant_method='compressed-tensors', format={form!r}, weights {sorted(found)}")
    ((bits, kind, symmetric, strategy, block, group, actorder),) = found
    what = f"quant_method='compressed-tensors', format={form!r}, {bits}-bit {kind} weights, strategy {strategy!r}"
    if get("kv_cache_scheme"):  # k_scale / v_scale for an FP8 KV cache: not read
        raise _refused(config, f"quant_method='compressed-tensors', kv_cache_scheme {get('kv_cache_scheme')}")
    if form == "float-quantized" and (bits, kind, symmetric) == (8, "float", True):
        if strategy in ("tensor", "channel") or (strategy == "block" and len(block) == 2):
            return ScaledFP8(strategy, block or None, "_scale")
    elif form == "pack-quantized" and bits in (4, 8) and kind == "int" and actorder in (None, "weight", "static"):
        if strategy == "channel" or (strategy == "group" and group):  # actorder "group" stores a g_idx: not read
            return PackedIntegers(bits, strategy, group, symmetric)
    raise _refused(config, what + (f", actorder {actorder!r}" if actorder else ""))


def _text(value) -> str:
    """A config's string, or transformers' enum of it (``QuantizationMethod.GPTQ``, ``AwqFormat.GEMM``)."""
    return str(getattr(value, "value", value)).lower()


def _grouped(config, get, method: str) -> GroupedIntegers:
    """GPTQ (4 or 8 bits, ``checkpoint_format`` gptq or gptq_v2, int32 words) or AWQ (4 bits, GEMM, zero points);
    any other of their variants (2 / 3 bits, marlin- or exllama-packed, GEMV) refused by name."""
    bits, group = get("bits"), get("group_size", 128)
    if method == "gptq":
        form = _text(get("checkpoint_format") or get("format") or "gptq")
        packed = _text(get("pack_dtype") or "int32")
        what = f"quant_method='gptq', {bits} bits, checkpoint_format {form!r}, pack_dtype {packed!r}"
        readable = bits in (4, 8) and form in ("gptq", "gptq_v2") and packed.endswith("int32")
        zero_offset = int(form == "gptq")
    else:
        form, zero_point = _text(get("version") or get("format") or "gemm"), get("zero_point", True)
        what = f"quant_method='awq', {bits} bits, version {form!r}, zero_point {zero_point}"
        readable, zero_offset = bits == 4 and form == "gemm" and zero_point, 0
    if not readable or not isinstance(group, int) or not (group == -1 or group > 0):
        raise _refused(config, what + f", group_size {group!r}")
    return GroupedIntegers(method, bits, group, zero_offset)


def _config_getter(quantization):
    """``get(key, default)`` on a ``quantization_config`` as a dict or as transformers' config object."""
    if isinstance(quantization, dict):
        return quantization.get
    return lambda key, default=None: getattr(quantization, key, default)


def quant_method(config) -> str | None:
    """The ``quant_method`` a config declares, lower-case (None: no quantization_config)."""
    quantization = getattr(config, "quantization_config", None)
    return _text(_config_getter(quantization)("quant_method")) if quantization else None


def read_quantization(config) -> Quantization | None:
    """The quantization a config declares (None: none), removed from the config (a model holding floats
    saves none; one holding its weights kept quantized saves the original back); anything hf_parallel does
    not read is refused by name, before any weight is read."""
    method = quant_method(config)
    if method is None:
        return None
    get = _config_getter(config.quantization_config)
    block = get("weight_block_size")
    if method == "compressed-tensors":
        found = _compressed_tensors(config, get)
    elif method in ("gptq", "awq"):
        found = _grouped(config, get, method)
    elif method == "fp8" and block:
        found = ScaledFP8("block", tuple(int(n) for n in block), "_scale_inv")
    elif method == "mxfp4":
        found = MXFP4()
    else:
        raise _refused(config, f"quant_method={method!r}" + (", per-tensor (no weight_block_size)" * (method == "fp8")))
    del config.quantization_config
    return found


def stored_in_parts(key: str, files, quantization: Quantization | None) -> bool:
    """Whether the weight ``key`` is stored in parts in ``files`` (``<name>_packed``, ``<name>_blocks``,
    ``<module>.qweight``): its format's marking part is there, and it is this key's (a GPTQ module's bias shares
    the module, not the qweight)."""
    stored_as = getattr(quantization, "stored_as", None)
    if not stored_as:
        return False
    stored = quantization.part_key(key, stored_as)
    return stored in files and quantization.weight_key(stored) == key


def with_stored_keys(files: dict[str, str], quantization: Quantization | None) -> dict[str, str]:
    """``files`` (checkpoint key -> file) with each weight stored in parts under its own key too
    (``<name>_packed`` / ``<name>_blocks`` -> ``<name>``, ``<module>.qweight`` -> ``<module>.weight``), so it
    maps to its parameter like any key."""
    if not getattr(quantization, "stored_as", None):
        return files
    out = dict(files)
    for key, file in files.items():
        weight = quantization.weight_key(key)
        if quantization.part_key(weight, quantization.stored_as) == key:  # key is a weight's marking part
            out.setdefault(weight, file)
    return out


def activation_scale(key: str) -> str:
    """The static activation scale of the module whose weight is ``key``."""
    return f"{key.rpartition('.')[0]}.{ACTIVATION_SCALE}"


def companion_keys(key: str, quantization: Quantization | None) -> set[str]:
    """The keys read with the weight ``key`` in the checkpoint's format (its scales, zero points, packed
    parts) or made moot by its dequantization (an FP8 module's activation scale); none without one."""
    if quantization is None:
        return set()
    moot = {activation_scale(key)} if isinstance(quantization, ScaledFP8) else set()
    return {quantization.part_key(key, part) for part in quantization.parts} | moot


def _span(start: int, stop: int, size: int) -> slice:
    """The blocks of ``size`` that elements ``[start, stop)`` touch."""
    return slice(start // size, -(-stop // size))


def _spread(per_block: torch.Tensor, dim: int, size: int, offset: int, count: int) -> torch.Tensor:
    """Values held per block of ``size`` along ``dim``, one per element of the ``count`` elements from
    ``offset`` in the first block; one block stays one (it broadcasts)."""
    if per_block.shape[dim] == 1:
        return per_block
    return per_block.repeat_interleave(size, dim).narrow(dim, offset, count)


def box_of(index, shape) -> list[tuple[int, int]]:
    """A tuple of step-1 slices (or fewer) as (start, stop) per dim."""
    index = index if isinstance(index, tuple) else (index,)
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for part, n in zip(index, shape):
        start, stop, step = part.indices(n)
        if step != 1:
            raise IndexError(f"a quantized weight is read in runs, not with step {step}")
        out.append((start, stop))
    return out


def _take(part, index: tuple, meta: bool) -> torch.Tensor:
    """``part[index]`` (a safetensors slice or a tensor); with ``meta``, only its shape and dtype (no read)."""
    if not meta or isinstance(part, torch.Tensor):
        return part[index] if not meta else part[index].to("meta")
    shape = [len(range(*s.indices(n))) for s, n in zip(index, part.get_shape())] + part.get_shape()[len(index) :]
    return torch.empty(shape, dtype=torch_dtype(part.get_dtype()), device="meta")


@dataclass
class Kept:
    """One box of a quantized weight as stored: the elements of its parts that the box needs, dequantized
    on demand (``dequantize``: float32) so a rank can hold a weight quantized and compute with it; ``at``:
    each part's field -> (its key, where the elements sit in the stored tensor), to save it back."""

    at: dict[str, tuple[str, tuple]]
    holds_experts = False  # its tensors' leading dim is the experts' (MXFP4's fused experts), dequantized with it

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device) -> "Kept":
        return replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def stored(self) -> dict[str, tuple[tuple, torch.Tensor]]:
        """Part key -> (where in the stored tensor, the elements this box holds)."""
        return {key: (index, getattr(self, field)) for field, (key, index) in self.at.items()}


@dataclass
class KeptFP8(Kept):
    weight: torch.Tensor  # float8, the box
    scales: torch.Tensor  # of the blocks it touches
    block: tuple[int, int]
    offset: tuple[int, int]  # the box's start inside its first block

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        (rows, columns), (bm, bn), (r, c) = self.weight.shape, self.block, self.offset
        scales = self.scales.float()
        if scales.dim() != 2:  # one scale, as stored ([] or [1])
            scales = scales.reshape(1, 1)
        grid = tuple(scales.shape)
        if (r, c) == (0, 0) and (rows, columns) == (grid[0] * bm, grid[1] * bn):  # whole blocks: broadcast, no
            blocks = self.weight.float().view(grid[0], bm, grid[1], bn)  # scale spread to every element
            return (blocks * scales[:, None, :, None]).view(rows, columns).to(dtype)
        scales = _spread(_spread(scales, 0, bm, r, rows), 1, bn, c, columns)
        return (self.weight.float() * scales).to(dtype)


class GroupedValues(NamedTuple):
    """A kept box of integers in groups of inputs, as kernels take them: ``W[o, i] = (values[o, i] - zero[g, o])
    * scales[g, o]`` with ``g = groups[i]``, every value unsigned (GPTQ / AWQ as stored; compressed-tensors'
    offset as stored)."""

    values: torch.Tensor  # [outputs, inputs] uint8
    zero: torch.Tensor  # [the box's groups, outputs] float32
    scales: torch.Tensor  # [the box's groups, outputs] float32
    groups: torch.Tensor  # [inputs] int64: each input's row in zero and scales
    group: int  # the format's inputs per group
    bits: int


@dataclass
class KeptIntegers(Kept):
    words: torch.Tensor  # int32, the box's rows and the words its columns touch
    scales: torch.Tensor  # its rows, the groups its columns touch
    zero: torch.Tensor | None  # the words its rows touch (packed along the rows), those groups; None: symmetric
    bits: int
    group: int
    offset: tuple[int, int, int]  # the box's start inside its first word of rows, of columns, and its first group
    columns: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.words.shape[0], self.columns)

    def groups(self, device=None) -> torch.Tensor:
        """Each of the box's inputs' column in ``scales``, int64 (on ``device``, else the words')."""
        return (torch.arange(self.columns, device=device or self.words.device) + self.offset[2]) // self.group

    def grouped_values(self) -> GroupedValues:
        """Unsigned as stored (the values offset by ``2 ** (bits - 1)``, and so the zero points; symmetric: the
        offset alone), so ``q - z`` is the format's."""
        (row, column, _), rows = self.offset, self.words.shape[0]
        values = _codes(self.words, self.bits, 1).narrow(1, column, self.columns)
        groups = self.groups()
        if self.zero is None:
            zero = torch.full(self.scales.shape, float(1 << (self.bits - 1)), device=values.device)
        else:
            zero = _codes(self.zero, self.bits, 0).narrow(0, row, rows).float()
        return GroupedValues(values, zero.T, self.scales.float().T, groups, self.group, self.bits)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        (row, column, in_group), rows = self.offset, self.words.shape[0]
        values = _unpack(self.words, self.bits, 1).narrow(1, column, self.columns).float()
        if self.zero is not None:
            zero = _unpack(self.zero, self.bits, 0).narrow(0, row, rows).float()
            values = values - _spread(zero, 1, self.group, in_group, self.columns)
        return (values * _spread(self.scales.float(), 1, self.group, in_group, self.columns)).to(dtype)


@dataclass
class KeptMXFP4(Kept):
    holds_experts = True
    blocks: torch.Tensor  # uint8 [E, out, groups, 16]: the box's experts and outputs, the groups of its inputs
    scales: torch.Tensor  # uint8 [E, out, groups]
    offset: int  # the box's first input inside its first group
    inputs: int

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """Expert by expert into the [E, in, out] result (the temporaries: one expert's, in float32)."""
        experts, outputs = self.blocks.shape[:2]
        out = torch.empty(experts, self.inputs, outputs, dtype=dtype, device=self.blocks.device)
        table = _fp4_table(self.blocks.device)
        exponents = self.scales.view(torch.uint8) if self.scales.dtype == torch.float8_e8m0fnu else self.scales
        for e in range(experts):
            codes = self.blocks[e].to(torch.int32)
            values = torch.stack((table[codes & 0x0F], table[codes >> 4]), -1).flatten(-2)  # [o, g, 32]
            values = torch.ldexp(values, (exponents[e].to(torch.int32) - 127).unsqueeze(-1)).flatten(-2)
            out[e] = values.narrow(1, self.offset, self.inputs).T
        return out


@dataclass
class KeptGrouped(Kept):
    words: torch.Tensor  # int32 qweight: GPTQ the words of the box's inputs x its outputs; AWQ its inputs x words
    scales: torch.Tensor  # the groups its inputs belong to (a run of them) x its outputs
    zero: torch.Tensor  # int32: those groups x the words of its outputs
    g_idx: torch.Tensor | None  # int32: each of its inputs' group (GPTQ); None: consecutive groups (AWQ)
    ordered: bool  # its inputs' groups are consecutive runs of ``group`` (no act-order)
    form: GroupedIntegers
    group: int  # inputs per group (the whole input dim for group_size -1)
    offset: tuple[int, int, int]  # its first input inside its first word (GPTQ) and group, first output in its word
    first_group: int  # the group of ``scales[0]``
    shape: tuple[int, int]  # (outputs, inputs), as the parameter

    @property
    def bits(self) -> int:
        return self.form.bits

    def integers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The box's unsigned values [in, out] (uint8) and their zero points [its groups, out] (float32, the
        stored zero plus ``zero_offset``): ``W.T = (values - zero[group]) * scales[group]`` per input's group."""
        (outputs, inputs), (in_word, _, out_word), form = self.shape, self.offset, self.form
        if form.method == "gptq":
            values = _codes(self.words, form.bits, 0).narrow(0, in_word, inputs)
        else:
            values = _codes(self.words, form.bits, 1, form.order).narrow(1, out_word, outputs)
        zero = _codes(self.zero, form.bits, 1, form.order).narrow(1, out_word, outputs).float() + form.zero_offset
        return values, zero

    def groups(self, device=None) -> torch.Tensor:
        """Each of the box's inputs' row in ``scales`` (and in ``integers``' zero points), int64 (on ``device``,
        else the words'; a box kept with ``meta`` holds its act-order ``g_idx`` as read)."""
        inputs, in_group = self.shape[1], self.offset[1]
        if not self.ordered:  # act-order: each input its own group
            return self.g_idx.to(device or self.g_idx.device).long() - self.first_group
        return (torch.arange(inputs, device=device or self.words.device) + in_group) // self.group

    def grouped_values(self) -> GroupedValues:
        values, zero = self.integers()
        return GroupedValues(values.T, zero, self.scales.float(), self.groups(), self.group, self.bits)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """In float32 (each value exact: a small integer times an fp16 scale), rounded once to ``dtype``; the
        [out, in] result is the transpose of an [in, out] tensor (what ``F.linear`` multiplies by)."""
        (outputs, inputs), in_group = self.shape, self.offset[1]
        if outputs == 0 or inputs == 0:
            return torch.empty(self.shape, dtype=dtype, device=self.words.device)
        values, zero = self.integers()
        scales, values = self.scales.float(), values.float()
        if not self.ordered:  # act-order: each input its own group
            groups = self.groups()
            weight = values.sub_(zero.index_select(0, groups)).mul_(scales.index_select(0, groups))
        elif in_group == 0 and inputs % self.group == 0:  # whole groups: broadcast, no per-input copy
            grouped = values.reshape(-1, self.group, outputs)
            weight = grouped.sub_(zero[:, None]).mul_(scales[:, None]).view(inputs, outputs)
        else:
            spread = functools.partial(_spread, dim=0, size=self.group, offset=in_group, count=inputs)
            weight = values.sub_(spread(zero)).mul_(spread(scales))
        return weight.to(dtype).T


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes


@functools.cache
def _fp4_table(device) -> torch.Tensor:
    return torch.tensor(FP4_VALUES, device=device)


class Dequantized:
    """A quantized weight read like a safetensors slice: ``[index]`` (step-1 slices) gives that box of
    the dequantized weight, in float32, reading only the box and the scales of its blocks (``keep``: the
    box as stored; with ``meta``, only its parts' shapes, for a plan's bytes). ``on(device)``: the box's
    stored parts go to ``device`` and are dequantized there (a GPU: the bytes that cross are the
    quantized ones, and the arithmetic is the GPU's)."""

    shape: tuple[int, ...]
    parts: dict  # key -> its safetensors slice (the parts a box reads elements of)
    constants: Mapping[str, torch.Tensor] = MappingProxyType({})  # key -> a part written whole
    device: torch.device = torch.device("cpu")  # where a box is dequantized

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def on(self, device: torch.device) -> "Dequantized":
        self.device = device
        return self

    def __getitem__(self, index) -> torch.Tensor:
        kept = self.keep(box_of(index, self.shape))
        return (kept if self.device.type == "cpu" else kept.to(self.device)).dequantize()  # float32, as floats read


def _check_scales(key: str, scale, shape, block, name: str) -> None:
    """The scales of a weight of ``shape`` scaled per ``block`` are a grid of one per block (a single scale
    may be stored as [1] or []); another shape is refused naming the key."""
    found = tuple(scale.get_shape())
    want = tuple(-(-n // b) for n, b in zip(shape, block))
    if found == want or (want == (1, 1) and math.prod(found) == 1):
        return
    raise CheckpointError(
        f"{key!r} {tuple(shape)} scaled per blocks of {tuple(block)} needs a {name!r} of shape {want}, and it is "
        f"{found}: written otherwise than the config says?"
    )


class DequantizedFP8(Dequantized):
    """A scaled FP8 matrix: ``W = q * s`` per block."""

    def __init__(self, key: str, weight, scale, quantization: ScaledFP8):
        self.shape = tuple(weight.get_shape())
        if len(self.shape) != 2:
            raise CheckpointError(f"{key!r} is FP8 of shape {self.shape}; hf_parallel dequantizes matrices")
        self.weight, self.block, self.scale_key = weight, quantization.block_for(self.shape), key + quantization.suffix
        _check_scales(key, scale, self.shape, self.block, self.scale_key)
        self.key, self.scale, self.parts = key, scale, {key: weight, self.scale_key: scale}

    def keep(self, box, meta: bool = False) -> KeptFP8:
        (r0, r1), (c0, c1) = box
        (bm, bn) = self.block
        grid = tuple(self.scale.get_shape())  # a single scale is read whole, as stored ([] or [1])
        scales = (_span(r0, r1, bm), _span(c0, c1, bn)) if len(grid) == 2 else tuple(slice(0, n) for n in grid)
        at = {"weight": (self.key, (slice(r0, r1), slice(c0, c1))), "scales": (self.scale_key, scales)}
        weight, scales = _take(self.weight, at["weight"][1], meta), _take(self.scale, at["scales"][1], meta)
        return KeptFP8(at, weight, scales, self.block, (r0 % bm, c0 % bn))


def _codes(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """A matrix of int32 words, each ``32 // bits`` unsigned values (uint8) along ``dim``: value i at bit
    ``i * bits``, standing for element ``order[i]`` of the word's run (None: element i). Read through the
    words' bytes (little-endian, as every host and GPU torch runs on): byte b holds values 2b and 2b + 1 (its
    low and high nibble) at 4 bits, value b at 8; a quarter of the memory traffic of shifting int32 words."""
    data = words.contiguous().view(torch.uint8).view(*words.shape, 4)
    values = data if bits == 8 else torch.stack((data & 0x0F, data >> 4), -1).view(*words.shape, 8)
    if order is not None:
        values = values[..., [order.index(n) for n in range(len(order))]]
    return values.flatten(1) if dim == 1 else values.transpose(1, 2).flatten(0, 1)


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """compressed-tensors' words: values offset to unsigned, as the signed values."""
    return _codes(words, bits, dim).short() - (1 << (bits - 1))


class DequantizedIntegers(Dequantized):
    """compressed-tensors' pack-quantized matrix: ``W = (q - z) * s`` per group of columns (or row)."""

    def __init__(self, key: str, part, quantization: PackedIntegers):
        self.shape = tuple(int(n) for n in part("_shape")[:].tolist())
        self.bits, self.per = quantization.bits, 32 // quantization.bits
        self.packed, self.zero = part("_packed"), part("_zero_point")
        if len(self.shape) != 2:
            raise CheckpointError(f"{key!r} is pack-quantized of shape {self.shape}; hf_parallel dequantizes matrices")
        rows, columns = self.shape
        if tuple(self.packed.get_shape()) != (rows, -(-columns // self.per)):
            raise CheckpointError(
                f"{key + '_packed'!r} is {tuple(self.packed.get_shape())} for a weight of shape {self.shape} "
                f"({key + '_shape'!r}) in {self.bits}-bit words: written otherwise than the config says?"
            )
        self.group = quantization.block_for(self.shape)[1]
        self.scale = part("_scale")
        _check_scales(key, self.scale, self.shape, (1, self.group), key + "_scale")
        if (self.zero is None) != quantization.symmetric:
            raise CheckpointError(
                f"{key + '_zero_point'!r} is {'missing' if self.zero is None else 'there'}, and the config says the "
                f"weights are {'' if quantization.symmetric else 'not '}symmetric"
            )
        self.key = key
        self.parts = {key + "_packed": self.packed, key + "_scale": self.scale, key + "_zero_point": self.zero}
        self.constants = {key + "_shape": part("_shape")[:]}  # written back whole
        groups = -(-columns // self.group)
        if self.zero is not None and tuple(self.zero.get_shape()) != (-(-rows // self.per), groups):
            raise CheckpointError(f"{key + '_zero_point'!r} is {tuple(self.zero.get_shape())}, not {rows} rows packed "
                                  f"by {self.per} x {groups}")  # fmt: skip

    def keep(self, box, meta: bool = False) -> KeptIntegers:
        (r0, r1), (c0, c1) = box
        groups = _span(c0, c1, self.group)
        at = {"words": (self.key + "_packed", (slice(r0, r1), _span(c0, c1, self.per))),
              "scales": (self.key + "_scale", (slice(r0, r1), groups))}  # fmt: skip
        if self.zero is not None:
            at["zero"] = (self.key + "_zero_point", (_span(r0, r1, self.per), groups))
        taken = {field: _take(self.parts[key], index, meta) for field, (key, index) in at.items()}
        offset = (r0 % self.per, c0 % self.per, c0 % self.group)
        words, scales, zero = taken["words"], taken["scales"], taken.get("zero")
        return KeptIntegers(at, words, scales, zero, self.bits, self.group, offset, c1 - c0)


class DequantizedMXFP4(Dequantized):
    """gpt-oss's MXFP4 experts: 32 e2m1 values per e8m0 scale along the input dim, the parameter their
    transpose ([E, in, out]), as transformers' ``convert_moe_packed_tensors`` makes it."""

    def __init__(self, key: str, blocks, scales):
        found, grid = tuple(blocks.get_shape()), tuple(scales.get_shape())
        if len(found) != 4 or found[-1] != 16 or grid != found[:-1]:
            raise CheckpointError(
                f"{key + '_blocks'!r} {found} and {key + '_scales'!r} {grid} are not MXFP4 experts "
                "([E, out, in / 32, 16] bytes and [E, out, in / 32] exponents)"
            )
        if torch_dtype(blocks.get_dtype()) != torch.uint8 or torch_dtype(scales.get_dtype()) not in EXPONENTS:
            raise CheckpointError(f"{key + '_blocks'!r} is {blocks.get_dtype()} and {key + '_scales'!r} "
                                  f"{scales.get_dtype()}: MXFP4 stores bytes (U8) and exponents (U8 or F8_E8M0)")
        self.blocks, self.scales, self.key = blocks, scales, key
        self.parts = {key + "_blocks": blocks, key + "_scales": scales}
        self.shape = (found[0], found[2] * 32, found[1])

    def keep(self, box, meta: bool = False) -> KeptMXFP4:
        (e0, e1), (i0, i1), (o0, o1) = box
        index = (slice(e0, e1), slice(o0, o1), _span(i0, i1, 32))
        at = {"blocks": (self.key + "_blocks", index), "scales": (self.key + "_scales", index)}
        return KeptMXFP4(at, _take(self.blocks, index, meta), _take(self.scales, index, meta), i0 % 32, i1 - i0)


class DequantizedGrouped(Dequantized):
    """A GPTQ or AWQ module's matrix (``GroupedIntegers``), read as the [out, in] weight it stands for. A box
    of inputs reads the qweight words and groups they touch; under act-order (a GPTQ ``g_idx`` that sends any
    input to any group) the run of groups from the least to the greatest its inputs name, found from its slice
    of ``g_idx`` (read even for a plan: one int32 an input)."""

    def __init__(self, key: str, part, form: GroupedIntegers):
        self.form, self.per, self.key = form, 32 // form.bits, key
        self.keys = {name: form.part_key(key, name) for name in form.parts}
        found = {name: part(name) for name in form.parts}
        self.parts = {self.keys[name]: stored for name, stored in found.items() if stored is not None}
        for name in ("scales", "qzeros"):
            if found[name] is None:
                raise CheckpointError(f"{self.keys['qweight']!r} is stored quantized with no {self.keys[name]!r}")
        self.words, self.scale, self.zero, self.g_idx = (found.get(name) for name in ("qweight", "scales", "qzeros",
                                                                                        "g_idx"))  # fmt: skip
        shapes = {name: self._shape_of(name, stored) for name, stored in found.items() if stored is not None}
        inputs = shapes["qweight"][0] * (self.per if form.method == "gptq" else 1)
        inputs, outputs = shapes.get("g_idx", (inputs,))[0], shapes["scales"][1]
        self.group = form.group if form.group > 0 else inputs
        self.groups, self.shape = -(-inputs // self.group), (outputs, inputs)
        words = -(-outputs // self.per)
        want = {"qweight": (-(-inputs // self.per), outputs) if form.method == "gptq" else (inputs, words),
                "scales": (self.groups, outputs), "qzeros": (self.groups, words)}  # fmt: skip
        for name, shape in want.items():
            if shapes[name] != shape:
                raise CheckpointError(
                    f"{self.keys[name]!r} is {shapes[name]}, not {shape}: {form.method} {form.bits}-bit, group_size "
                    f"{form.group}, for a weight of {outputs} outputs ({self.keys['scales']!r}) and {inputs} inputs: "
                    "written otherwise than the config says?"
                )

    def _shape_of(self, name: str, part) -> tuple[int, ...]:
        """A part's shape, its dims and dtype checked against what the format stores."""
        shape, dtype, dtypes = tuple(part.get_shape()), torch_dtype(part.get_dtype()), GROUPED_DTYPES[name]
        dims = 1 if name == "g_idx" else 2
        if len(shape) != dims or dtype not in dtypes:
            named = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(
                f"{self.keys[name]!r} is {dtype} {shape}: {self.form.method} stores it as a {dims}-dim {named} tensor"
            )
        return shape

    def _groups(self, i0: int, i1: int) -> tuple[slice, bool]:
        """The groups inputs ``[i0, i1)`` belong to, as the run from the first to the last, and whether they
        are in order (each input in group ``i // group``, as without act-order)."""
        if self.g_idx is None:
            return _span(i0, i1, self.group), True
        named = self.g_idx[i0:i1]
        if named.numel() == 0:  # an empty box (a dim smaller than the ranks it is split over)
            return slice(0, 0), True
        low, high = int(named.min()), int(named.max())
        if low < 0 or high >= self.groups:
            raise CheckpointError(f"{self.keys['g_idx']!r} names group {low if low < 0 else high}, and "
                                  f"{self.keys['scales']!r} has {self.groups}")  # fmt: skip
        ordered = torch.equal(named.long(), torch.arange(i0, i1) // self.group)
        return slice(low, high + 1), ordered

    def keep(self, box, meta: bool = False) -> KeptGrouped:
        (o0, o1), (i0, i1) = box
        (groups, ordered), outputs = self._groups(i0, i1), slice(o0, o1)
        words = (slice(i0, i1), _span(o0, o1, self.per)) if self.form.method == "awq" else (_span(i0, i1, self.per),
                                                                                             outputs)  # fmt: skip
        at = {"words": (self.keys["qweight"], words), "scales": (self.keys["scales"], (groups, outputs)),
              "zero": (self.keys["qzeros"], (groups, _span(o0, o1, self.per)))}  # fmt: skip
        if self.g_idx is not None:
            at["g_idx"] = (self.keys["g_idx"], (slice(i0, i1),))
        # the groups read even for ``meta`` (4 bytes an input, read already by ``_groups``): a plan's int4 figure
        taken = {field: _take(self.parts[key], index, meta and field != "g_idx") for field, (key, index) in at.items()}
        offset = (i0 % self.per, i0 % self.group, o0 % self.per)
        return KeptGrouped(at, taken["words"], taken["scales"], taken["zero"], taken.get("g_idx"), ordered,
                           self.form, self.group, offset, groups.start, (o1 - o0, i1 - i0))  # fmt: skip


def readable(handle, files: dict[str, str], key: str, quantization: Quantization | None):
    """``key``'s safetensors slice (``handle(file)``: the file opened), or, stored quantized, a
    ``Dequantized`` of it. A float8 weight without its scale, or FP8 in a checkpoint whose config
    declares no quantization, is refused by name."""
    if stored_in_parts(key, files, quantization):

        def part(name):
            found = quantization.part_key(key, name)
            return handle(files[found]).get_slice(found) if found in files else None

        if isinstance(quantization, GroupedIntegers):
            return DequantizedGrouped(key, part, quantization)
        if isinstance(quantization, MXFP4):
            if part("_scales") is None:
                _missing(files, key, "_scales")
            return DequantizedMXFP4(key, part("_blocks"), part("_scales"))
        for needed in ("_scale", "_shape"):
            if part(needed) is None:
                _missing(files, key, needed)
        return DequantizedIntegers(key, part, quantization)
    weight = handle(files[key]).get_slice(key)
    dtype = weight.get_dtype()  # safetensors' code, or a torch dtype (a pickle checkpoint's)
    if torch_dtype(dtype) not in FP8:
        return weight
    scale = key + quantization.suffix if isinstance(quantization, ScaledFP8) else None
    if scale not in files:
        missing = f"{scale!r} beside it" if scale else "quantization_config in the config"
        if quantization is not None and scale is None:
            missing = f"FP8 in its quantization_config ({type(quantization).__name__})"
        raise CheckpointError(
            f"{files[key]}: {key!r} is {weight.get_dtype()} with no {missing}: its scales are unknown, so its values "
            "would load wrong"
        )
    return DequantizedFP8(key, weight, handle(files[scale]).get_slice(scale), quantization)


def _missing(files: dict[str, str], key: str, suffix: str):
    raise CheckpointError(f"{files[key]}: {key!r} is stored quantized with no {key + suffix!r} beside it")


def dequantized_sources(files: dict[str, str], sources: dict, handle, quantization: Quantization | None) -> dict:
    """Parameter name -> ``Dequantized`` for every parameter read from one key stored quantized
    (per-expert keys are dequantized tile by tile: ``ShardReader.fused``)."""
    out = {}
    for name, key in sources.items():
        if isinstance(key, str):
            found = readable(handle, files, key, quantization)
            if isinstance(found, Dequantized):
                out[name] = found
    return out
