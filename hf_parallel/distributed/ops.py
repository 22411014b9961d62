"""The collectives as torch ops, so that ``torch.compile`` sees one opaque node per collective.

Traced, ``comm``'s transports call these ops instead of running: the graph holds
``hf_parallel.all_reduce(x, "1")`` where eager code would spin on shared-memory flags or call gloo,
and no Python branches on data inside a compiled forward (vLLM registers its custom all-reduce the
same way). Each op's implementation is the eager transport itself, chosen per call (shared memory or
the group's backend), and its fake implementation gives the output's shape from the arguments alone.
Eager code does not go through the dispatcher (a few microseconds a call, about a hundred calls per
decoded token): ``comm`` calls its transports directly unless ``torch.compiler.is_compiling()``.

A group travels as its ``group_name`` (ops take strings, not process groups); the mesh registers
every group it creates, and a name nobody registered is an error naming it.
"""

from __future__ import annotations

import torch

_GROUPS: dict[str, object] = {}  # group_name -> process group


def register(group) -> None:
    """Make ``group`` reachable by name from the ops (the mesh calls this for each group it creates)."""
    if group is not None:
        _GROUPS[group.group_name] = group


def group_named(name: str):
    group = _GROUPS.get(name)
    if group is None:
        raise RuntimeError(
            f"hf_parallel: a compiled collective names process group {name!r}, which no hf_parallel mesh created"
        )
    return group


def _transports():
    from . import comm  # comm imports this module: its transports are reached at call time

    return comm


torch.library.define("hf_parallel::all_reduce", "(Tensor x, str group) -> Tensor")
torch.library.define("hf_parallel::all_gather", "(Tensor x, int dim, int[] sizes, str group) -> Tensor")
torch.library.define(
    "hf_parallel::all_to_all",
    "(Tensor x, int split_dim, int cat_dim, int[] split_sizes, int[] cat_sizes, int rank, str group) -> Tensor",
)
torch.library.define("hf_parallel::broadcast", "(Tensor x, str group) -> Tensor")


@torch.library.impl("hf_parallel::all_reduce", "CompositeExplicitAutograd")
def _all_reduce(x, group):
    return _transports().all_reduce_now(x, group_named(group))


@torch.library.impl("hf_parallel::all_gather", "CompositeExplicitAutograd")
def _all_gather(x, dim, sizes, group):
    return _transports().all_gather_now(x, dim, sizes, group_named(group))


@torch.library.impl("hf_parallel::all_to_all", "CompositeExplicitAutograd")
def _all_to_all(x, split_dim, cat_dim, split_sizes, cat_sizes, rank, group):
    return _transports().all_to_all_now(x, split_dim, cat_dim, split_sizes, cat_sizes, group_named(group))


@torch.library.impl("hf_parallel::broadcast", "CompositeExplicitAutograd")
def _broadcast(x, group):
    return _transports().broadcast_now(x.clone(), group_named(group))  # an op's output never aliases its input


@torch.library.register_fake("hf_parallel::all_reduce")
def _all_reduce_fake(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("hf_parallel::all_gather")
def _all_gather_fake(x, dim, sizes, group):
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


@torch.library.register_fake("hf_parallel::all_to_all")
def _all_to_all_fake(x, split_dim, cat_dim, split_sizes, cat_sizes, rank, group):
    shape = list(x.shape)
    shape[split_dim], shape[cat_dim] = split_sizes[rank], sum(cat_sizes)
    return x.new_empty(shape)


@torch.library.register_fake("hf_parallel::broadcast")
def _broadcast_fake(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
