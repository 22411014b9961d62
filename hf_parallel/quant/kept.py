"""Weights held quantized on each rank (``from_pretrained(..., keep_quantized=True)``): a rank keeps its
slice of each quantized weight as the checkpoint stores it (FP8 and its block scales, packed integers,
MXFP4) and dequantizes it module by module in the forward, so at rest it holds about the quantized bytes
(FP8: half of bf16) and, in a forward, one module's weight in the compute dtype besides.

Between calls the parameter's slot holds a ``KeptPlaceholder``: its local shape and dtype on the meta
device (so shape checks and the plan see the weight), refusing any computation (a meta tensor alone would
not: ``F.linear`` of a CPU input and a meta weight returns uninitialised memory). The module's forward
pre-hook puts the dequantized weight there and its forward hook puts the placeholder back, so anything
reading the weight outside its module's call fails loudly, never with a stale or wrong value. Plain linears
(``kept_linear``) and fused experts (``kept_experts``, only the experts a step goes to) compute with their
kept weights themselves instead.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from .base import Kept, box_of
from ..core.tiles import intersect
from ..core.dtypes import torch_dtype
from .kept_experts import KeptExperts, hold_experts
from .kept_linear import KeptLinear, hold_linear, row_boxes


def placed_boxes(tiles: list, layout, rank: int, full_shape):
    """Where this rank's shard of a parameter comes from: for each run of its layout and each checkpoint
    tile that run meets (``tiles``: (key, the tile's box in the parameter, its ``Dequantized``); one tile the
    whole parameter, or one per expert key of fused experts), (key, dequantized, the box to read of the
    tile, where it goes in the local tensor). A ``Dequantized`` with one dim fewer than its tile's box is
    one expert's (the box's leading expert dim dropped)."""
    offset = 0
    for index in layout.index(tuple(full_shape), rank):
        run = box_of(index, full_shape)
        for key, tile, source in tiles:
            inside = intersect(tuple(run), tile)
            if inside is None:
                continue
            read = [(a - c, b - c) for (a, b), (c, _) in zip(inside, tile)][len(tile) - len(source.shape) :]
            shift = [offset - r if dim == layout.dim else 0 for dim, (r, _) in enumerate(run)]
            yield key, source, read, tuple(slice(a + s, b + s) for (a, b), s in zip(inside, shift))
        if layout.dim is not None:
            offset += run[layout.dim][1] - run[layout.dim][0]


@dataclass
class Placed:
    key: str  # the checkpoint key its parts were read from
    kept: Kept
    at: tuple  # where it goes in the local tensor


@dataclass
class KeptWeight:
    """One parameter's local shard as stored: ``Kept`` boxes (one per run of its layout, or per expert key
    of fused experts) placed in the local tensor once dequantized. ``stored``: every part of every key it
    comes from (full key -> shape, dtype) and ``constants`` those kept whole, on every rank (a save lists
    the same keys everywhere), to save it back as it was."""

    pieces: list[Placed]
    shape: tuple[int, ...]
    dtype: torch.dtype
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]]
    constants: dict[str, torch.Tensor]
    listing: dict | None = None  # every part -> each TP rank's pieces, once a save has asked (``checkpoint/kept_saves.py``)

    @classmethod
    def read(cls, tiles: list, layout, rank: int, full_shape, dtype, device) -> "KeptWeight":
        shape = tuple(layout.local_shape(tuple(full_shape), rank))
        pieces = [Placed(key, source.keep(box).to(device), at)
                  for key, source, box, at in placed_boxes(tiles, layout, rank, full_shape)]  # fmt: skip
        if not pieces or sum(math.prod(s.stop - s.start for s in p.at) for p in pieces) != math.prod(shape):
            raise RuntimeError(f"{tiles[0][0]}: the kept pieces do not make this rank's shard {shape}")
        stored = {key: (tuple(part.get_shape()), torch_dtype(part.get_dtype()))
                  for _, _, source in tiles for key, part in source.parts.items() if part is not None}  # fmt: skip
        constants = {key: value for _, _, source in tiles for key, value in source.constants.items()}
        return cls(pieces, shape, dtype, stored, constants)

    @property
    def nbytes(self) -> int:
        return sum(piece.kept.nbytes for piece in self.pieces)

    @property
    def whole(self) -> Kept | None:
        """The one stored box that is this rank's whole shard (one run of its layout), else None."""
        first = self.pieces[0]
        return first.kept if len(self.pieces) == 1 and _covers(first.at, self.shape) else None

    @property
    def row_boxes(self) -> list[tuple[Kept, tuple[int, int]]] | None:
        """A 2-d shard's stored boxes and their shapes in order of their rows, where each holds all its columns
        (one box, ``whole``; or a packed q|k|v's or gate|up's parts, a box each), so that a kernel's products
        of the boxes concatenate to the shard's; else None."""
        return row_boxes([(piece.kept, piece.at) for piece in self.pieces], self.shape)

    def dequantize(self) -> torch.Tensor:
        if self.whole is not None:  # its one run: no copy
            return self.whole.dequantize(self.dtype).reshape(self.shape)
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for piece in self.pieces:
            target = out[piece.at]
            target.copy_(piece.kept.dequantize(self.dtype).reshape(target.shape))
        return out

    @property
    def device(self) -> torch.device:
        return next(iter(self.pieces[0].kept.tensors().values())).device


def _covers(at: tuple, shape) -> bool:
    return all(s.start == 0 and s.stop == n for s, n in zip(at, shape))


class KeptPlaceholder(nn.Parameter):
    """What a kept weight's slot holds between calls: its shape, dtype and device (meta), nothing to compute
    with: any other use raises, naming it."""

    METADATA = {getattr(torch.Tensor, name).__get__ for name in (
        "shape", "dtype", "device", "requires_grad", "ndim", "is_meta", "grad", "grad_fn", "is_leaf", "layout",
        "is_sparse", "is_quantized", "is_cuda", "is_cpu", "itemsize", "nbytes", "output_nr", "_version")}
    METADATA |= {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
                 torch.Tensor.requires_grad_,  # model.requires_grad_(False): nothing to compute
                 torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.data_ptr, torch.Tensor.__hash__,
                 torch.Tensor.__repr__}  # fmt: skip

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            f"{getattr(func, '__name__', func)} on a weight held quantized (keep_quantized=True): it is dequantized "
            "only inside its own module's call; load without keep_quantized to use the weights otherwise"
        )


def placeholder(local_shape, dtype) -> KeptPlaceholder:
    return KeptPlaceholder(torch.empty(local_shape, dtype=dtype, device="meta"), requires_grad=False)


def hold_quantized(model: nn.Module, kept: dict[str, KeptWeight], fp8_products: bool = False,
                   int4_kernels: bool = False) -> list:  # fmt: skip
    """A plain linear computes with its kept weight itself (``kept_linear``: its kernel, FP8 products with
    ``fp8_products`` where the card has them, torch's int4 kernel with ``int4_kernels``; a warning where none
    takes the kernel asked for names the first linear's refusals), a fused-experts
    module dequantizes the experts its tokens go to (``kept_experts``); any other module's kept weights are
    dequantized into their slots for its call only (hooks, returned)."""
    by_module: dict[str, dict[str, KeptWeight]] = {}
    for name, weight in kept.items():
        path, _, attr = name.rpartition(".")
        by_module.setdefault(path, {})[attr] = weight
    handles = []
    for path, weights in by_module.items():
        module = model.get_submodule(path)
        if hold_linear(module, weights, fp8_products, int4_kernels) or hold_experts(module, weights, int4_kernels):
            continue
        resting = {attr: module._parameters[attr] for attr in weights}

        def put(module, args, weights=weights):
            for attr, weight in weights.items():
                module._parameters[attr] = nn.Parameter(weight.dequantize(), requires_grad=False)

        def take_back(module, args, output, resting=resting):
            module._parameters.update(resting)

        handles += [module.register_forward_pre_hook(put), module.register_forward_hook(take_back, always_call=True)]
    if fp8_products and kept and "W8A8 FP8" not in _ways(model):
        warnings.warn(f"keep_quantized='fp8': no kept weight multiplies in FP8 on this rank (none in whole 128 x 128 "
                      f"blocks in bfloat16, or no block-scaled FP8 product on {next(iter(kept.values())).device}); "
                      f"they take the weight-only FP8 kernel where it runs, else are dequantized"
                      f"{_first(model)}")  # fmt: skip
    if int4_kernels and kept and not any(_int4_packs(module) for module in model.modules()):
        warnings.warn("keep_quantized='int4': no kept weight is multiplied by torch's int4 kernel on this rank (none "
                      "GPTQ / AWQ / compressed-tensors 4-bit in groups of 32 inputs or more held in boxes of whole "
                      "rows by a plain linear or by gated experts on CPU, or no kernel for this device and dtype); "
                      f"they are held as with keep_quantized=True{_first(model)}")  # fmt: skip
    return handles


def _ways(model: nn.Module) -> list[str]:
    """How each kept plain linear of ``model`` multiplies (its kernel's ``way``)."""
    return [module.kernel.way for module in model.modules() if isinstance(module, KeptLinear)]


def _first(model: nn.Module) -> str:
    """The first kept plain linear's refused kernels and why (``kept_linear.choose_kernel``), for a warning."""
    named = ((name, m.refusals) for name, m in model.named_modules() if isinstance(m, KeptLinear) and m.refusals)
    first = next(named, None)
    return "" if first is None else f" ({first[0]}: {first[1]})"


def kept_products(model: nn.Module) -> dict[str, int]:
    """How ``model``'s kept plain linears and fused experts multiply: a count per way (``"int4 kernel": 210``,
    ``"experts int4 kernel": 48``), so a run can say whether its kept weights took a kernel or fell back to
    dequantizing (a refused kernel warns once)."""
    counts = Counter(_ways(model))
    for module in model.modules():
        if isinstance(module, KeptExperts):
            way = "int4 kernel" if _int4_packs(module) else "FP8 kernel" if module.kernel_products else "dequantized"
            counts[f"experts {way}"] += 1
    return dict(counts)


def _int4_packs(module: nn.Module) -> list:
    """The packs for torch's int4 kernel ``module`` holds (a linear's kernel's a box, experts' a part)."""
    rows = [r for r in (getattr(module, "kept_rows", None) or {}).values() if r is not None]
    packs = list(module.kernel.packs) if isinstance(module, KeptLinear) else []
    return packs + [s for r in rows for s in r.int4_stacks or []]


def int4_copy_nbytes(model: nn.Module) -> int:
    """The bytes ``model``'s kept weights hold repacked for torch's int4 kernel, beside their stored parts."""
    packs = [pack for module in model.modules() for pack in _int4_packs(module)]
    return sum(t.nbytes for pack in packs for t in pack if isinstance(t, torch.Tensor))
