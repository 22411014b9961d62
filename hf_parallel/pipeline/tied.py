"""Tied input/output embeddings held by the first and the last stage: one weight, two copies.

Each copy gets half of the gradient (the embedding lookup's on the first stage, the LM head's on
the last); both must step with the sum. The two stages may split the vocabulary differently (VTP:
TP=2 on one, TP=1 on the other), so shards cannot be paired rank by rank: each stage assembles
its full gradient over its TP group, the two first ranks swap them (one batch of a send and a receive
each: two sends first would wait for each other on NCCL), every rank adds the two in
the same order (bitwise the same sum on both stages) and keeps its own rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.faults import collective
from ..distributed.tags import Tag


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
    """Both copies of every tied weight get the sum of the two stages' gradients."""
    stage, tp = state.stage, state.mesh.tp
    if not stage.tied:
        return
    link = stage.link
    other = link.num_stages - 1 if link.is_first else 0
    for name in stage.tied:
        entry = state.layout.params[name]
        param = model.get_parameter(entry.name)
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        sharded = hasattr(grad, "full_tensor")  # FSDP's slice: whole over the data-parallel ranks first
        mine = full_tensor(grad.full_tensor() if sharded else grad, entry.layout, entry.full_shape, tp)
        with link.hold_sends():  # both stages send and receive: one batch each (NCCL's rules)
            link.send(mine, other, f"the gradient of the tied {entry.name}", tag=Tag.TIED)
        theirs = link.recv(other, f"the gradient of the tied {entry.name}", tag=Tag.TIED)
        total = mine + theirs if link.is_first else theirs + mine
        summed = entry.layout.extract(total, tp.rank, out=total.new_empty(param.shape))
        param.grad = reshard_like(summed, grad) if sharded else summed
    link.flush()
