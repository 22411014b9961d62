"""The plan's lines for a quantized checkpoint: what each rank reads of its quantized weights and their scales,
and what it holds kept as stored, counted from the files' headers (``hf-parallel plan`` on such a checkpoint)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def quantized_lines(path: str, model, shard, tp: int, quantization, dtype) -> list[str]:
    """What each rank reads of a quantized checkpoint (its slices of the quantized weights, and of their
    scales and zero points), from the files' headers (``placed_boxes``, as the load places them); what it
    holds with ``keep_quantized=True``; and what ``keep_quantized="int4"`` holds besides (a plain linear's
    int4 weight in boxes of whole rows, and on CPU gated experts' two weights, repacked for torch's int4
    kernel as ``hold_linear`` and ``hold_experts`` take them: from each box's groups, act-order's ``g_idx``
    read)."""
    tally = _quantized_bytes(path, model, shard, tp, quantization, dtype)
    kept = [k + r for k, r in zip(tally.kept, tally.read)]
    return [
        f"quantized ({type(quantization).__name__}): each rank reads {tally.read} bytes of quantized weights, of "
        f"which scales and zero points {tally.scales}; dequantized into the dtype as read (the bytes per rank "
        f"below); with keep_quantized=True held as read: {kept} bytes per rank{_int4_besides(tally, dtype)}"
    ]


@dataclass
class _QuantizedBytes:
    """Per rank, what the plan's quantized line adds up while it walks the checkpoint's headers."""

    read: list[int]  # quantized bytes read
    scales: list[int]  # of them, scales and zero points
    kept: list[int]  # held with keep_quantized=True besides what is read (the weights stored unquantized)
    int4: list[int]  # held besides for torch's int4 kernel by plain linears
    # per experts module and rank, each gated weight's int4 stack bytes (None: not through the kernel)
    experts: dict[tuple[str, int], dict[str, int | None]]


def _quantized_bytes(path: str, model, shard, tp: int, quantization, dtype) -> _QuantizedBytes:
    """Walk every parameter's checkpoint tensors (opened once each, headers only) and tally its bytes on
    every rank."""
    from contextlib import ExitStack

    from safetensors import safe_open

    from ..checkpoint.keys import FusedSource, checkpoint_sources
    from ..checkpoint.loading import checkpoint_files
    from ..quant.formats import readable, with_stored_keys

    files = with_stored_keys(checkpoint_files(path), quantization)
    direct, fused = checkpoint_sources(model, files)
    tally = _QuantizedBytes([0] * tp, [0] * tp, [0] * tp, [0] * tp, {})
    with ExitStack() as stack:
        handles = {}

        def handle(file):
            return handles.get(file) or handles.setdefault(file, stack.enter_context(safe_open(file, "pt")))

        for entry in shard.unique_params():
            source = next(direct.get(a) or fused.get(a) for a in entry.aliases if a in direct or a in fused)
            whole = tuple((0, n) for n in entry.full_shape)
            boxes = source.boxes(entry.full_shape) if isinstance(source, FusedSource) else [(source, whole)]
            tiles = [(key, box, readable(handle, files, key, quantization)) for key, box in boxes]
            _tally_param(tally, model, entry, tiles, tp, dtype)
    return tally


def _tally_param(tally: _QuantizedBytes, model, entry, tiles: list, tp: int, dtype) -> None:
    """Add one parameter's bytes on each rank: those of its boxes as the load places them, and what
    torch's int4 kernel would hold besides (a plain linear's rows; a gated experts' weight's stack)."""
    from torch import nn

    from ..quant.base import Dequantized
    from ..quant.kernels.int4_torch import pack_form
    from ..quant.kept import placed_boxes
    from ..quant.kept_experts import gated_experts, int4_stack_nbytes
    from ..quant.kept_linear import row_boxes

    module, _, attr = entry.name.rpartition(".")
    plain = attr == "weight" and type(model.get_submodule(module)) is nn.Linear
    # transformers' gated experts (hold_experts' other conditions hold for its experts modules)
    gated = attr in ("gate_up_proj", "down_proj") and gated_experts(model.get_submodule(module))
    for rank in range(tp):
        local = tuple(entry.layout.local_shape(entry.full_shape, rank))
        if not isinstance(tiles[0][2], Dequantized):
            tally.kept[rank] += math.prod(local) * dtype.itemsize
            continue
        placed = [(weight.keep(box, meta=True), at) for _, weight, box, at in
                  placed_boxes(tiles, entry.layout, rank, entry.full_shape)]  # fmt: skip
        for box, _ in placed:
            held = box.tensors()
            tally.read[rank] += sum(t.nbytes for t in held.values())
            tally.scales[rank] += sum(held[f].nbytes for f in ("scales", "zero") if f in held)
        rows = row_boxes(placed, local) if plain else None  # as hold_linear takes them
        if rows is not None:
            forms = [pack_form(box, shape, dtype) for box, shape in rows]
            tally.int4[rank] += 0 if None in forms else sum(form.nbytes for form in forms)  # every box or none
        if gated:
            tally.experts.setdefault((module, rank), {})[attr] = int4_stack_nbytes(placed, local, dtype)


def _int4_besides(tally: _QuantizedBytes, dtype) -> str:
    """The clause on what ``keep_quantized='int4'`` holds besides for torch's int4 kernel, on CPU and on
    CUDA (empty when nothing would be)."""
    on_cpu = list(tally.int4)
    for (_, rank), parts in tally.experts.items():  # both weights through the kernel, or neither
        both = set(parts) == {"gate_up_proj", "down_proj"} and None not in parts.values()
        on_cpu[rank] += sum(parts.values()) if both else 0
    if not any(on_cpu):
        return ""
    on_cuda = tally.int4 if dtype == torch.bfloat16 else [0] * len(on_cpu)  # CUDA's kernel: bfloat16 only, no experts
    return (f"; keep_quantized='int4' holds besides, for torch's int4 kernel (where it passes its load "
            f"check): {on_cpu} bytes per rank on CPU ({on_cuda} on CUDA: bfloat16 only, experts dequantized "
            f"there)")
