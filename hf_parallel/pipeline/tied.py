"""Tied input/output embeddings held by the first and the last stage: one weight, two copies.

Each copy gets half of the gradient (the embedding lookup's on the first stage, the LM head's on
the last); both must step with the sum. No rank ever holds more of it than its own slice: each
rank receives, from the ranks of the other stage that hold them, exactly the rows it holds, sends
its own to the ranks that need them, and adds the two in place. The two stages may split the
vocabulary differently (VTP: TP=2 on one, TP=1 on the other), so slices are matched by the rows of
the full tensor each holds (the layouts' ranges; the other stage's layouts are asked once, through
the stages' first ranks), not rank by rank. Under FSDP a rank holds its FSDP rows of its TP shard
and trades those alone (where FSDP does not cut the rows the TP layout splits, it first gathers
its TP shard over FSDP). A rank pairs with the other stage's ranks at its own sequence index and
replica (under FSDP, which folds those in: every rank of its HSDP replica); of several holding a
row, the first in TP then FSDP order sends it. Every exchange is one batch of sends and receives
per rank (NCCL's rules: a send waits for its receive). Both stages add the first stage's part to
the last's (IEEE addition is commutative): the two copies stay bitwise equal.
"""

from __future__ import annotations

import json
import weakref

import torch
import torch.distributed as dist

from ..compat.torch import fsdp_row_range
from ..core.layout import Layout, supplying_runs
from ..distributed import p2p
from ..distributed.devices import to_wire
from ..distributed.faults import collective
from ..distributed.tags import Tag

Piece = tuple[int, int, int, int]  # (global rank, full start, full stop, local start) along the split dim
Spans = dict[int, list[tuple[int, int]]]  # peer -> (local start, length) runs, in the order both sides list them

_OTHER_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stage link -> the other stage's layouts


def full_tensor(local: torch.Tensor, layout, full_shape, tp) -> torch.Tensor:
    """The full tensor from every TP rank's shard, on every rank of the group."""
    if layout.is_replicated or tp.size == 1:
        return local
    pieces = []
    for rank in range(tp.size):
        piece = local.contiguous() if rank == tp.rank else local.new_empty(layout.local_shape(full_shape, rank))
        with collective(f"assembling a tied gradient from rank {tp.ranks[rank]}"):
            dist.broadcast(piece, group_src=rank, group=tp.group)
        pieces.append(piece)
    return layout.assemble(local.new_empty(full_shape), pieces.__getitem__)


def reshard_like(whole: torch.Tensor, sharded) -> torch.Tensor:
    """This rank's FSDP slice of ``whole`` (which every rank of the FSDP group holds), as ``sharded``."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, sharded.device_mesh, sharded.placements, src_data_rank=None)


def sum_tied_gradients(model, state) -> None:
    """Both copies of every tied weight get the sum of the two stages' gradients, slice by slice."""
    stage, mesh = state.stage, state.mesh
    if not stage.tied:
        return
    link = stage.link
    other = link.num_stages - 1 if link.is_first else 0
    entries = [state.layout.params[name] for name in stage.tied]
    for entry, their_layout in zip(entries, other_layouts(link, [entry.layout for entry in entries])):
        param = model.get_parameter(entry.name)
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dim = split_dim(entry.layout, their_layout, entry.name)
        by_rows = dim == 0 and hasattr(grad, "to_local") and cuts_rows(grad)  # FSDP's slice: trade its rows
        gathered = hasattr(grad, "full_tensor") and not by_rows  # else FSDP's slice: this TP shard first
        local = grad.to_local() if by_rows else grad.full_tensor() if gathered else grad
        size = entry.full_shape[dim]
        mine = stage_pieces(mesh, link.stage, entry.layout, size, by_rows)
        theirs = stage_pieces(mesh, other, their_layout, size, by_rows)
        if sum(stop - start for rank, start, stop, _ in mine if rank == mesh.rank) != local.shape[dim]:
            raise RuntimeError(f"rank {mesh.rank}'s slice of the tied {entry.name} is not the rows its layout gives")
        sends, receives = exchange_plan(mine, theirs, mesh.rank)
        received = swap(local, dim, sends, receives, mesh, f"the gradient of the tied {entry.name}")
        add_received(local, dim, receives, received, link.is_first)  # in place: what this rank sent is sent
        param.grad = reshard_like(local, grad) if gathered else grad


def cuts_rows(grad) -> bool:
    """Whether FSDP shards ``grad`` by rows over its last mesh dim and replicates it over any other."""
    from torch.distributed.tensor import Shard

    *others, last = grad.placements
    return last == Shard(0) and all(placement.is_replicate() for placement in others)


def other_layouts(link, layouts: list[Layout]) -> list[Layout]:
    """The other end stage's layouts of the tied weights (``layouts``, in the same order, are this
    stage's): swapped once per link between the stages' first ranks, broadcast over each TP group."""
    if link not in _OTHER_LAYOUTS:
        other = link.num_stages - 1 if link.is_first else 0
        text = json.dumps([layout.to_json() for layout in layouts]).encode()
        mine = torch.tensor(list(text), dtype=torch.int32)  # bytes: the wire's headers carry no uint8
        with link.hold_sends():  # both stages send and receive: one batch each (NCCL's rules)
            link.send(mine, other, "the layouts of the tied weights", tag=Tag.TIED)
        theirs = link.recv(other, "the layouts of the tied weights", tag=Tag.TIED)
        link.flush()
        _OTHER_LAYOUTS[link] = [Layout.from_json(data) for data in json.loads(bytes(theirs.cpu().tolist()))]
    return _OTHER_LAYOUTS[link]


def split_dim(mine: Layout, theirs: Layout, name: str) -> int:
    """The dim both stages' layouts split (0 where both are replicated)."""
    dims = {layout.dim for layout in (mine, theirs) if not layout.is_replicated}
    if len(dims) > 1:
        raise ValueError(f"the tied {name} is split along dims {sorted(dims)} by the two end stages; one dim is needed")
    return dims.pop() if dims else 0


def held_rows(layout: Layout, tp_rank: int, size: int, rows: tuple[int, int] | None = None) -> list[tuple]:
    """(full start, full stop, local start) of what TP rank ``tp_rank`` holds along the split dim
    (``size`` long in the full tensor), cut to ``rows`` of its TP shard (FSDP's slice; local starts
    then count from the slice's first row)."""
    ranges = ((0, size),) if layout.is_replicated else layout.ranges[tp_rank]
    low, high = rows if rows is not None else (0, sum(stop - start for start, stop in ranges))
    out, offset = [], 0
    for start, stop in ranges:
        first, last = max(offset, low), min(offset + stop - start, high)
        if first < last:
            out.append((start + first - offset, start + last - offset, first - low))
        offset += stop - start
    return out


def stage_pieces(mesh, stage: int, layout: Layout, size: int, by_fsdp_rows: bool) -> list[Piece]:
    """What the ranks of ``stage`` that pair with this rank hold, in TP then FSDP order: the TP ranks
    at this rank's sequence index and replica, or (``by_fsdp_rows``) every FSDP rank of each TP rank
    in this rank's HSDP replica, each with its rows of that TP rank's shard."""
    shape, pieces = mesh.shape, []
    for tp_rank in range(shape.stage_tp_sizes[stage]):
        if by_fsdp_rows:
            anchor = shape.global_rank(stage, 0, tp_rank, mesh.replica - mesh.replica % shape.dp_shard)
            group = next(ranks for ranks in shape.groups("fsdp") if anchor in ranks)
            rows = size if layout.is_replicated else layout.local_size(tp_rank)
            held = [(rank, fsdp_row_range(rows, index, len(group))) for index, rank in enumerate(group)]
        else:
            held = [(shape.global_rank(stage, mesh.sp.rank, tp_rank, mesh.replica), None)]
        for rank, cut in held:
            pieces += [(rank, *piece) for piece in held_rows(layout, tp_rank, size, cut)]
    return pieces


def suppliers(pieces: list[Piece], start: int, stop: int) -> list[Piece]:
    """Who supplies ``[start, stop)``: runs, each from the first piece holding where it starts."""
    return supplying_runs(pieces, start, stop, "a tied weight on the other stage")


def exchange_plan(mine: list[Piece], theirs: list[Piece], me: int) -> tuple[Spans, Spans]:
    """What this rank sends to and receives from each rank of the other stage: (local start, length)
    runs of its own slice, listed in the receiver's local order on both sides."""
    sends: Spans = {}
    receives: Spans = {}
    for rank, start, stop, local in mine:
        if rank == me:
            for peer, run_start, run_stop, _ in suppliers(theirs, start, stop):
                receives.setdefault(peer, []).append((local + run_start - start, run_stop - run_start))
    for peer, start, stop, _ in theirs:
        for holder, run_start, run_stop, local in suppliers(mine, start, stop):
            if holder == me:
                sends.setdefault(peer, []).append((local, run_stop - run_start))
    return sends, receives


def swap(local: torch.Tensor, dim: int, sends: Spans, receives: Spans, mesh, what: str) -> dict[int, torch.Tensor]:
    """Every send and receive of this rank in one batch; returns what came from each peer (on the wire)."""
    ops = []
    for peer, spans in sends.items():
        parts = [local.narrow(dim, start, length) for start, length in spans]
        data = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        ops.append(p2p.Op("send", to_wire(data, mesh.wire), peer, f"rank {mesh.rank} sending {what}"))
    received = {}
    for peer, spans in receives.items():
        shape = list(local.shape)
        shape[dim] = sum(length for _, length in spans)
        received[peer] = torch.empty(shape, dtype=local.dtype, device=mesh.wire)
        ops.append(p2p.Op("recv", received[peer], peer, f"rank {mesh.rank} receiving {what}"))
    if ops:
        p2p.run(ops, mesh.world.group)
    return received


def add_received(local: torch.Tensor, dim: int, receives: Spans, received: dict, is_first: bool) -> None:
    """``local``'s rows += the other stage's, first stage's part + last stage's on both stages."""
    for peer, spans in receives.items():
        offset = 0
        for start, length in spans:
            theirs = received[peer].narrow(dim, offset, length).to(local.device)
            target = local.narrow(dim, start, length)
            torch.add(*((target, theirs) if is_first else (theirs, target)), out=target)
            offset += length
