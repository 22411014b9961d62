"""Tied input/output embeddings held by the first and the last stage: one weight, two copies.

Each copy gets half of the gradient (the embedding lookup's on the first stage, the LM head's on
the last); both must step with the sum. The two stages may split the vocabulary differently (VTP:
TP=2 on one, TP=1 on the other), so shards cannot be paired rank by rank: each stage assembles
its full gradient over its TP group, the two first ranks swap them, every rank adds the two in
the same order (bitwise the same sum on both stages) and keeps its own rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.faults import collective
from .p2p import TIED


def full_tensor(local: torch.Tensor, layout, full_shape, tp) -> torch.Tensor:
    """The full tensor from every TP rank's shard, on every rank of the group."""
    if layout.is_replicated or tp.size == 1:
        return local
    full = local.new_empty(full_shape)
    for rank in range(tp.size):
        piece = local.contiguous() if rank == tp.rank else local.new_empty(layout.local_shape(full_shape, rank))
        with collective(f"assembling a tied gradient from rank {tp.ranks[rank]}"):
            dist.broadcast(piece, group_src=rank, group=tp.group)
        offset = 0
        for index in layout.index(full_shape, rank):
            size = full[index].shape[layout.dim]
            full[index] = piece.narrow(layout.dim, offset, size)
            offset += size
    return full


def local_rows(full: torch.Tensor, layout, rank: int) -> torch.Tensor:
    pieces = [full[index] for index in layout.index(tuple(full.shape), rank)]
    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim=layout.dim)


def sum_tied_gradients(model) -> None:
    state = model._hf_parallel
    runtime = state.pipeline
    if runtime is None or not state.tied_across_stages:
        return
    link, tp = runtime.link, state.mesh.tp
    other = link.num_stages - 1 if link.is_first else 0
    for name in state.tied_across_stages:
        entry = state.shard.params[name]
        param = model.get_parameter(entry.name)
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        mine = full_tensor(grad, entry.layout, entry.full_shape, tp)
        link.send(mine, other, f"the gradient of the tied {entry.name}", tag=TIED)
        theirs = link.recv(other, f"the gradient of the tied {entry.name}", tag=TIED)
        total = mine + theirs if link.is_first else theirs + mine
        param.grad = local_rows(total, entry.layout, tp.rank)
    link.flush()
