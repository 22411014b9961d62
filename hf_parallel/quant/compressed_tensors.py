"""compressed-tensors' checkpoints: its config read (float-quantized 8-bit weights are ``scaled_fp8``'s;
pack-quantized integers here) and its pack-quantized integers (the ``*-W4A16`` / ``*-W8A16`` repacks):
``<name>_packed`` int32 words of 32 / bits values each along the input dim (offset to unsigned),
``<name>_scale`` per group of columns or per row, ``<name>_zero_point`` packed along the rows where
asymmetric, ``<name>_shape``; ``W = (q - z) * s``. The tests write it with compressed-tensors' own packer and
read it back with transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import CheckpointError
from .base import Dequantized, GroupedValues, Kept, Suffixed, check_scales, codes, refused, span, spread, take
from .scaled_fp8 import ScaledFP8

@dataclass(frozen=True)
class PackedIntegers(Suffixed):
    """compressed-tensors' pack-quantized weights, as its config states them."""

    bits: int
    strategy: str  # "group": a scale per row and group of columns; "channel": per row
    group: int | None
    symmetric: bool  # else a zero point per scale, packed along the rows
    stored_as = "_packed"  # the weight's key is "<name>_packed" (and its other parts beside it)
    parts = ("_packed", "_scale", "_zero_point", "_shape")

    def block_for(self, shape) -> tuple[int, int]:
        return (1, self.group if self.strategy == "group" else shape[1])


def read_config(config, get) -> ScaledFP8 | PackedIntegers:
    """compressed-tensors: every group's weights float8 (float-quantized) or 4/8-bit integers (pack-quantized),
    one scheme throughout."""
    found = {
        (w.get("num_bits"), w.get("type"), w.get("symmetric", True), w.get("strategy"),
         tuple(w.get("block_structure") or ()), w.get("group_size"), w.get("actorder"))
        for w in (group.get("weights") or {} for group in (get("config_groups") or {}).values())
    }  # fmt: skip
    form = get("format")
    if form not in ("float-quantized", "pack-quantized") or len(found) != 1:
        raise refused(config, f"quant_method='compressed-tensors', format={form!r}, weights {sorted(found)}")
    ((bits, kind, symmetric, strategy, block, group, actorder),) = found
    what = f"quant_method='compressed-tensors', format={form!r}, {bits}-bit {kind} weights, strategy {strategy!r}"
    if get("kv_cache_scheme"):  # k_scale / v_scale for an FP8 KV cache: not read
        raise refused(config, f"quant_method='compressed-tensors', kv_cache_scheme {get('kv_cache_scheme')}")
    if form == "float-quantized" and (bits, kind, symmetric) == (8, "float", True):
        if strategy in ("tensor", "channel") or (strategy == "block" and len(block) == 2):
            return ScaledFP8(strategy, block or None, "_scale")
    elif form == "pack-quantized" and bits in (4, 8) and kind == "int" and actorder in (None, "weight", "static"):
        if strategy == "channel" or (strategy == "group" and group):  # actorder "group" stores a g_idx: not read
            return PackedIntegers(bits, strategy, group, symmetric)
    raise refused(config, what + (f", actorder {actorder!r}" if actorder else ""))


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
        values = codes(self.words, self.bits, 1).narrow(1, column, self.columns)
        groups = self.groups()
        if self.zero is None:
            zero = torch.full(self.scales.shape, float(1 << (self.bits - 1)), device=values.device)
        else:
            zero = codes(self.zero, self.bits, 0).narrow(0, row, rows).float()
        return GroupedValues(values, zero.T, self.scales.float().T, groups, self.group, self.bits)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        (row, column, in_group), rows = self.offset, self.words.shape[0]
        values = _unpack(self.words, self.bits, 1).narrow(1, column, self.columns).float()
        if self.zero is not None:
            zero = _unpack(self.zero, self.bits, 0).narrow(0, row, rows).float()
            values = values - spread(zero, 1, self.group, in_group, self.columns)
        return (values * spread(self.scales.float(), 1, self.group, in_group, self.columns)).to(dtype)


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """compressed-tensors' words: values offset to unsigned, as the signed values."""
    return codes(words, bits, dim).short() - (1 << (bits - 1))


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
        check_scales(key, self.scale, self.shape, (1, self.group), key + "_scale")
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
        groups = span(c0, c1, self.group)
        at = {"words": (self.key + "_packed", (slice(r0, r1), span(c0, c1, self.per))),
              "scales": (self.key + "_scale", (slice(r0, r1), groups))}  # fmt: skip
        if self.zero is not None:
            at["zero"] = (self.key + "_zero_point", (span(r0, r1, self.per), groups))
        taken = {field: take(self.parts[key], index, meta) for field, (key, index) in at.items()}
        offset = (r0 % self.per, c0 % self.per, c0 % self.group)
        words, scales, zero = taken["words"], taken["scales"], taken.get("zero")
        return KeptIntegers(at, words, scales, zero, self.bits, self.group, offset, c1 - c0)
