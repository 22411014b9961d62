"""``clip_grad_norm_``: the norm of the whole model's gradient, over every shard, then clipping.

Each rank holds pieces of the gradient: TP and expert shards, FSDP's slices of those, a pipeline
stage's layers. Some pieces are held by several ranks (a replicated norm on every TP rank, a KV
head on the ranks that replicate it, a tied embedding on the first and the last stage, every
parameter on each sequence rank without FSDP, every slice on each HSDP replica). Clipping with
the local norm is the classic silent error; here every element counts once: each rank weights
its squares by one over the number of ranks holding the same element (a run of elements with one
count at a time), and the world sums them. Squares add up in float64, a block of a gradient at a
time: no gradient is ever copied whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..adapters.seams import named_entries
from ..compat.torch import fsdp_rows
from ..distributed.faults import collective
from ..state import parallel_model, parallel_state


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: FSDP's slice of a DTensor, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


CHUNK = 1 << 20  # elements cast to float64 at a time (8 MiB): casting a whole gradient would copy all of it


def squares(piece: torch.Tensor) -> torch.Tensor:
    """The sum of ``piece``'s squares in float64, block by block (``vector_norm``'s ``dtype`` casts its
    whole input first on some devices)."""
    flat = piece.view(-1) if piece.is_contiguous() else piece
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=piece.device)
    rows = max(1, CHUNK // max(1, flat[0].numel()))
    norms = [torch.linalg.vector_norm(block, dtype=torch.float64) for block in flat.split(rows)]
    return torch.stack(norms).square().sum()


def _piece_weights(layout, rank: int, rows: slice | None) -> list[tuple[int, int, float]] | None:
    """(local start, length, 1 / holders) runs along ``layout.dim`` of ``rank``'s TP shard, cut to
    FSDP's ``rows`` (dim 0); None where every element has one holder."""
    counts = layout.replica_counts(rank)
    if layout.is_replicated or max(counts, default=1) == 1:
        return None
    low, high = (rows.start, rows.stop) if rows is not None and layout.dim == 0 else (0, layout.local_size(rank))
    runs, offset = [], 0
    for (start, stop), count in zip(layout.ranges[rank], counts):
        first, last = max(offset, low), min(offset + stop - start, high)
        if first < last:
            runs.append((first - low, last - first, 1.0 / count))
        offset += stop - start
    return runs


def grad_norm_squares(model, state) -> torch.Tensor:
    """This rank's share of the squared gradient norm (fp64), each element weighted by one over
    the number of ranks of the world that hold it."""
    mesh, stage, sequence = state.mesh, state.stage, state.sequence
    tied = set(stage.tied) if stage is not None else set()
    total = torch.zeros((), dtype=torch.float64, device=mesh.device)
    for name, param, entry in named_entries(model, state):
        if param.grad is None:
            continue
        grad = local_tensor(param.grad)
        if entry is not None and entry.layout.over == "ep":  # experts under ep_size: one holder in the world
            total += squares(grad)
            continue
        sharded = hasattr(param, "to_local")  # FSDP's slice of this rank's TP shard
        # FSDP's slices are copied on the HSDP replicas; anything else (an adapter) on every replica
        weight = 1.0 / (mesh.shape.dp_replicate if sharded else mesh.dp.size)
        if sequence is not None and not sharded:
            weight /= sequence.size
        if name in tied:
            weight /= 2
        runs = None
        if entry is None or entry.layout.is_replicated:
            weight /= mesh.tp.size
        else:
            rows = fsdp_rows(param.shape[0], grad.shape[0], mesh.fsdp.rank, mesh.fsdp.size) if sharded else None
            runs = _piece_weights(entry.layout, mesh.tp.rank, rows)
        if runs is None:
            total += squares(grad) * weight
        for start, length, share in runs or ():
            total += squares(grad.narrow(entry.layout.dim, start, length)) * (weight * share)
    return total


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip every gradient of a parallel model so their global 2-norm is at most ``max_norm``;
    returns that global norm before clipping, the same on every rank (what one process's
    ``torch.nn.utils.clip_grad_norm_`` returns for the whole model). ``max_norm=inf``: the norm only."""
    if norm_type != 2.0:
        raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): hf_parallel computes the global 2-norm only")
    model = parallel_model(model)
    state = parallel_state(model)
    squares = grad_norm_squares(model, state)
    world = state.mesh.world.group
    if world is not None:
        with collective(f"summing the gradient norm over the world (rank {state.mesh.rank})"):
            dist.all_reduce(squares, group=world)
    norm = squares.sqrt().float()
    if max_norm != float("inf"):
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for param in model.parameters():
            if param.grad is not None:
                local_tensor(param.grad).mul_(coefficient.to(param.grad.dtype))
    return norm
