"""Saving weights kept quantized: each stored part gathered whole to the TP group's first rank (a
gathered save) or written as this rank's pieces with their boxes (a per-rank save). The bytes move as
bytes (float8 does not pickle), under NCCL's point-to-point rules."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..core.tiles import union_volume
from ..distributed import p2p
from ..distributed.devices import to_wire
from ..distributed.faults import collective
from ..quant.base import box_of
from ..quant.kept import KeptWeight


def _listing(weight: KeptWeight, tp) -> dict[str, list]:
    """Every part of ``weight`` -> each TP rank's pieces of it [(index, shape)], one object all-gather for all
    the weight's parts (kept on the weight: a save asks for its parts one after another, in the same order on
    every rank); every rank checks each part is covered, so a refusal is every rank's, before any byte moves."""
    if weight.listing is None:
        mine: dict[str, list] = {}
        for piece in weight.pieces:
            for key, (index, tensor) in piece.kept.stored().items():
                mine.setdefault(key, []).append((index, tuple(tensor.shape)))
        everyone = [mine]
        if tp.size > 1:
            everyone = [None] * tp.size
            with collective(f"listing the kept pieces of {weight.pieces[0].key} (rank {tp.ranks[tp.rank]})"):
                dist.all_gather_object(everyone, mine, group=tp.group)
        weight.listing = {key: [theirs.get(key, []) for theirs in everyone] for key in weight.stored}
        for key, (shape, _) in weight.stored.items():
            boxes = [tuple(box_of(index, shape)) for pieces in weight.listing[key] for index, _ in pieces]
            if union_volume(boxes) != math.prod(shape):
                raise RuntimeError(f"{key}: the ranks' kept pieces do not cover it; refusing to write it")
    return weight.listing


def gathered_part(weight: KeptWeight, part: str, tp, device) -> torch.Tensor | None:
    """The whole stored ``part`` (a checkpoint key) of a kept weight on the TP group's first rank (None
    elsewhere), as the checkpoint held it: every rank's elements placed where they came from (runs that
    overlap, the scales of a block two ranks share, agree). Where each piece goes is listed once per weight
    (``_listing``); the bytes go as bytes (float8 does not pickle), on ``device`` (the wire: the device
    the groups' backend carries)."""
    if part in weight.constants:
        return weight.constants[part].cpu() if tp.rank == 0 else None
    shape, dtype = weight.stored[part]
    mine = [t for piece in weight.pieces for key, (_, t) in piece.kept.stored().items() if key == part]
    places = _listing(weight, tp)[part]
    if tp.rank != 0:
        for tensor in mine:
            data = to_wire(tensor.reshape(-1).contiguous().view(torch.uint8), device)
            p2p.send(data, tp.ranks[0], f"sending {part} (kept quantized) to rank {tp.ranks[0]}", tp.group)
        return None
    full = torch.empty(shape, dtype=dtype)
    for rank, pieces in enumerate(places):
        for n, (index, piece_shape) in enumerate(pieces):
            if rank == 0:
                tensor = mine[n]
            else:
                tensor = torch.empty(math.prod(piece_shape) * dtype.itemsize, dtype=torch.uint8, device=device)
                p2p.recv(tensor, tp.ranks[rank], f"receiving {part} from rank {tp.ranks[rank]}", tp.group)
                tensor = tensor.view(dtype).reshape(piece_shape)
            full[index] = tensor.cpu()
    return full


def saved_pieces(weights: list[KeptWeight], tp, first_file: int) -> tuple[dict, dict]:
    """For a per-rank save: (this rank's tensors by their name in its file, every stored part's
    (shape, dtype, [(file, name, box)]), the same on every rank of the group). A rank's pieces of a part
    are named ``<key>@<tp rank>.<n>``; a part kept whole is written by the group's first rank as its key."""
    mine, listed, specs = {}, {}, {}  # listed: key -> this rank's [(name, box)]
    for weight in weights:
        specs.update(weight.stored)
        for key, value in weight.constants.items():
            specs[key] = (tuple(value.shape), value.dtype)
            if tp.rank == 0:
                mine[key], listed[key] = value, [(key, tuple((0, n) for n in value.shape))]
        for piece in weight.pieces:
            for key, (index, tensor) in piece.kept.stored().items():
                name = f"{key}@{tp.rank}.{len(listed.get(key, ()))}"
                mine[name] = tensor
                listed.setdefault(key, []).append((name, tuple(box_of(index, weight.stored[key][0]))))
    everyone = [listed]
    if tp.size > 1:
        everyone = [None] * tp.size
        with collective(f"listing the kept pieces each rank saves (rank {tp.ranks[tp.rank]})"):
            dist.all_gather_object(everyone, listed, group=tp.group)
    described = {
        key: (shape, dtype, [(first_file + rank, name, box) for rank, theirs in enumerate(everyone)
                             for name, box in theirs.get(key, ())])
        for key, (shape, dtype) in specs.items()
    }  # fmt: skip
    for key, (shape, _, pieces) in described.items():  # on every rank, before anything is written
        if union_volume([box for _, _, box in pieces]) != math.prod(shape):
            raise RuntimeError(f"{key}: the ranks' kept pieces do not cover it; refusing to write it")
    return mine, described
