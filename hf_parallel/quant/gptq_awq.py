"""GPTQ and AWQ: integer weights in groups of inputs, stored transposed under the module's name
(``<module>.qweight``, ``.qzeros``, ``.scales``, GPTQ's ``.g_idx``). The two differ only in which dim the
words pack and in what order (``GroupedIntegers.order``), so one form reads both; a shard may end inside a
word or a group, and a row-parallel act-order slice reads the groups its ``g_idx`` names."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..core.dtypes import torch_dtype
from ..core.errors import CheckpointError
from .base import Dequantized, GroupedValues, Kept, codes, config_text, refused, span, spread, take

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
GROUPED_DTYPES = {"qweight": (torch.int32,), "qzeros": (torch.int32,), "scales": FLOATS,
                  "g_idx": (torch.int32, torch.int64)}  # GPTQ's and AWQ's parts, as stored  # fmt: skip


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


def read_config(config, get, method: str) -> GroupedIntegers:
    """GPTQ (4 or 8 bits, ``checkpoint_format`` gptq or gptq_v2, int32 words) or AWQ (4 bits, GEMM, zero points);
    any other of their variants (2 / 3 bits, marlin- or exllama-packed, GEMV) refused by name."""
    bits, group = get("bits"), get("group_size", 128)
    if method == "gptq":
        form = config_text(get("checkpoint_format") or get("format") or "gptq")
        packed = config_text(get("pack_dtype") or "int32")
        what = f"quant_method='gptq', {bits} bits, checkpoint_format {form!r}, pack_dtype {packed!r}"
        readable = bits in (4, 8) and form in ("gptq", "gptq_v2") and packed.endswith("int32")
        zero_offset = int(form == "gptq")
    else:
        form, zero_point = config_text(get("version") or get("format") or "gemm"), get("zero_point", True)
        what = f"quant_method='awq', {bits} bits, version {form!r}, zero_point {zero_point}"
        readable, zero_offset = bits == 4 and form == "gemm" and zero_point, 0
    if not readable or not isinstance(group, int) or not (group == -1 or group > 0):
        raise refused(config, what + f", group_size {group!r}")
    return GroupedIntegers(method, bits, group, zero_offset)


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
            values = codes(self.words, form.bits, 0).narrow(0, in_word, inputs)
        else:
            values = codes(self.words, form.bits, 1, form.order).narrow(1, out_word, outputs)
        zero = codes(self.zero, form.bits, 1, form.order).narrow(1, out_word, outputs).float() + form.zero_offset
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
            per_input = functools.partial(spread, dim=0, size=self.group, offset=in_group, count=inputs)
            weight = values.sub_(per_input(zero)).mul_(per_input(scales))
        return weight.to(dtype).T


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
            return span(i0, i1, self.group), True
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
        words = (slice(i0, i1), span(o0, o1, self.per)) if self.form.method == "awq" else (span(i0, i1, self.per),
                                                                                             outputs)  # fmt: skip
        at = {"words": (self.keys["qweight"], words), "scales": (self.keys["scales"], (groups, outputs)),
              "zero": (self.keys["qzeros"], (groups, span(o0, o1, self.per)))}  # fmt: skip
        if self.g_idx is not None:
            at["g_idx"] = (self.keys["g_idx"], (slice(i0, i1),))
        # the groups read even for ``meta`` (4 bytes an input, read already by ``_groups``): a plan's int4 figure
        taken = {field: take(self.parts[key], index, meta and field != "g_idx") for field, (key, index) in at.items()}
        offset = (i0 % self.per, i0 % self.group, o0 % self.per)
        return KeptGrouped(at, taken["words"], taken["scales"], taken["zero"], taken.get("g_idx"), ordered,
                           self.form, self.group, offset, groups.start, (o1 - o0, i1 - i0))  # fmt: skip
