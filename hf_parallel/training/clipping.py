"""``clip_grad_norm_``: the norm of the whole model's gradient, over every shard, then clipping.

Each rank holds pieces of the gradient: TP and expert shards, FSDP's slices of those, a pipeline
stage's layers. Some pieces are held by several ranks (a replicated norm on every TP rank, a KV
head on the ranks that replicate it, a tied embedding on the first and the last stage, every
parameter on each sequence rank without FSDP, every slice on each HSDP replica). Clipping with
the local norm is the classic silent error; here every element counts once: each rank weights
its squares by one over the number of ranks holding the same element (a run of elements with one
count at a time), and the world sums them. Squares add up in float64, a block of a gradient at a
time: no gradient is ever copied whole.

torch's own ``torch.nn.utils.clip_grad_norm_``, which most training scripts call, is routed here for a split
model's gradients (``route_torch_clipping``): scripts need not know which function to call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..adapters.seams import named_entries
from ..compat.torch import fsdp_rows, route_gradient_clipping
from ..distributed.faults import collective
from ..state import parallel_model, parallel_models, parallel_state


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


def global_grad_norm(model, state) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (fp32), the same on every rank."""
    squares = grad_norm_squares(model, state)
    world = state.mesh.world.group
    if world is not None:
        with collective(f"summing the gradient norm over the world (rank {state.mesh.rank})"):
            dist.all_reduce(squares, group=world)
    return squares.sqrt().float()


def scale_gradients(parameters, max_norm: float, norm: torch.Tensor) -> None:
    """Every gradient times ``max_norm / norm`` where that is below 1 (torch's coefficient), in place."""
    coefficient = torch.clamp(max_norm / (local_tensor(norm) + 1e-6), max=1.0)
    for param in parameters:
        if param.grad is not None:
            local_tensor(param.grad).mul_(coefficient.to(param.grad.dtype))


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip every gradient of a parallel model so their global 2-norm is at most ``max_norm``;
    returns that global norm before clipping, the same on every rank (what one process's
    ``torch.nn.utils.clip_grad_norm_`` returns for the whole model). ``max_norm=inf``: the norm only."""
    if norm_type != 2.0:
        raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): hf_parallel computes the global 2-norm only")
    model = parallel_model(model)
    norm = global_grad_norm(model, parallel_state(model))
    if max_norm != float("inf"):
        scale_gradients(model.parameters(), max_norm, norm)
    return norm


def _split_model_holding(tensors: list, of_grads: bool):
    """The split model (one of several processes) whose gradients (``of_grads``) or parameters ``tensors``
    are, or None; one they are only a part of is refused: a part's norm has no global meaning here."""
    given = {id(t) for t in tensors}
    for model in parallel_models():
        state = parallel_state(model)
        if state.mesh.world.group is None:  # one process: torch's own norm is the whole model's
            continue
        params = list(model.parameters())
        held = {id(p.grad if of_grads else p) for p in params if p.grad is not None}
        if not given & held:
            continue
        others = given - held - {id(p) for p in params}  # (a parameter without a gradient adds nothing)
        if not held <= given or others:
            raise ValueError(
                f"torch.nn.utils.clip_grad_norm_ was given {len(given & held)} of the {len(held)} gradients of "
                f"{type(model).__name__}, which hf_parallel split over {state.mesh.shape}"
                f"{f' and {len(others)} other tensors' if others else ''}: its norm is computed for the whole "
                "model only. Pass model.parameters(), or call hf_parallel.clip_grad_norm_(model, max_norm)"
            )
        return model, state
    return None


def _torch_total_norm(grads: list, norm_type: float, error_if_nonfinite: bool):
    """torch's ``get_total_norm`` on a split model's gradients: the global norm (see ``route_torch_clipping``)."""
    found = _split_model_holding(grads, of_grads=True)
    if found is None:
        return NotImplemented
    model, state = found
    if norm_type != 2.0:
        raise ValueError(f"torch.nn.utils.clip_grad_norm_(norm_type={norm_type}) on {type(model).__name__}, split "
                         f"over {state.mesh.shape}: hf_parallel computes the global 2-norm only")  # fmt: skip
    norm = global_grad_norm(model, state)
    if error_if_nonfinite and not torch.isfinite(norm):  # torch's own check and words
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")  # fmt: skip
    return norm


def _torch_clip_with_norm(parameters: list, max_norm: float, norm: torch.Tensor):
    """torch's ``clip_grads_with_norm_`` on a split model's parameters: each rank scales its own pieces (FSDP's
    slices included) by the one coefficient."""
    if _split_model_holding(parameters, of_grads=False) is None:
        return NotImplemented
    scale_gradients(parameters, max_norm, norm)
    return None


def route_torch_clipping() -> None:
    """``torch.nn.utils.clip_grad_norm_`` on a split model clips by the global norm, as
    ``hf_parallel.clip_grad_norm_`` does (a rank-local norm clipped each rank differently, silently); on
    any other tensors it is torch's own. Installed when a split model is loaded."""
    route_gradient_clipping(_torch_total_norm, _torch_clip_with_norm)
