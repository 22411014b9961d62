"""The batch a sequence-parallel group computes on, sent from its first rank: its structure (dicts, lists,
tuples, the shapes and dtypes of its tensors) first, as an object, then each tensor into a buffer of its own
(vLLM's ``broadcast_tensor_dict``). Once a forward, beside ``comm.py``'s collectives, which carry activations."""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from . import ops  # noqa: F401  (importing it defines the collectives as torch ops: the compiled broadcast)
from .faults import collective
from .shm import channel_for


def _describe(value, leaves: list):
    """The batch's structure, each tensor in it as its shape and dtype (the tensors appended to
    ``leaves`` in order): what other ranks need to receive the tensors into buffers of their own."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return ("dict", {key: _describe(item, leaves) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_describe(item, leaves) for item in value])
    return ("value", value)


def broadcast_batch(batch, group, device: torch.device):
    """``batch`` (tensors in dicts, lists and tuples, of any dtype and shape) as the group's first
    rank holds it, on every rank of the group, on ``device`` (the group's): the structure, shapes
    and dtypes go first, as an object (vLLM's ``broadcast_tensor_dict``), then each tensor,
    received into a buffer on ``device``. Non-tensor leaves travel with the structure."""
    if group is None or dist.get_world_size(group) == 1:
        return batch
    if torch.compiler.is_compiling():  # one op per tensor, the first rank's values in each rank's shapes
        name = group.group_name  # (checked); the structure and non-tensor arguments are each rank's own, as traced
        return tree_map_only(torch.Tensor, lambda t: torch.ops.hf_parallel.broadcast(t.to(device), name), batch)
    leaves = []
    first = dist.get_global_rank(group, 0)
    mine = dist.get_rank(group) == 0
    channel = channel_for(group) if device.type == "cpu" else None

    def shared(tensor: torch.Tensor | None, what: str) -> torch.Tensor | None:
        """Through shared memory in one step, when the group has it and the tensor fits a slot."""
        return None if channel is None else channel.broadcast(tensor, 0, what)

    what = "broadcasting the batch's structure over the sequence-parallel group"
    layout = _describe(batch, leaves)
    pickled = shared(torch.frombuffer(bytearray(pickle.dumps(layout)), dtype=torch.uint8) if mine else None, what)
    if pickled is not None:
        layout = layout if mine else pickle.loads(pickled.numpy().tobytes())
    else:
        boxed = [layout]
        with collective(what):
            dist.broadcast_object_list(boxed, src=first, group=group)
        layout = boxed[0]

    def build(spec):
        kind, *rest = spec
        if kind == "tensor":
            shape, dtype = rest
            what = f"broadcasting a batch tensor of {shape}"
            tensor = leaves.pop(0).to(device).contiguous() if mine else None
            received = shared(tensor, what)
            if received is not None:
                return received
            tensor = tensor if mine else torch.empty(shape, dtype=dtype, device=device)
            with collective(what):
                dist.broadcast(tensor, src=first, group=group)
            return tensor
        if kind == "dict":
            return {key: build(item) for key, item in rest[0].items()}
        if kind in ("list", "tuple"):
            items = [build(item) for item in rest[0]]
            return items if kind == "list" else tuple(items)
        return rest[0]

    return build(layout)
