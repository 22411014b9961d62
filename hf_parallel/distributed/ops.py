"""The collectives as torch ops, so that ``torch.compile`` sees one opaque node per collective.

Traced, ``comm``'s transports call these ops instead of running: the graph holds
``hf_parallel.all_reduce(x, "1")`` where eager code would spin on shared-memory flags or call gloo,
and no Python branches on data inside a compiled forward (vLLM registers its custom all-reduce the
same way). They are ordered effects: a compiler pass that moved two independent collectives past each
other on one rank only (graphs differ between ranks where heads split unevenly) would pair the wrong
tensors. Each op's implementation is the eager transport itself, chosen per call (shared memory or
the group's backend), registered by ``comm`` beside those transports (this module imports none of them);
its fake implementation here gives the output's shape from the arguments alone.
Eager code does not go through the dispatcher (a few microseconds a call, about a hundred calls per
decoded token): ``comm`` calls its transports directly unless ``torch.compiler.is_compiling()``.

A group travels as its ``group_name`` (ops take strings, not process groups); the mesh registers
every group it creates, and a name nobody registered is an error naming it.
"""

from __future__ import annotations

import torch

from ..compat.torch import keep_in_order

_GROUPS: dict[str, object] = {}  # group_name -> process group


def register(group) -> None:
    """Make ``group`` reachable by name from the ops (the mesh calls this for each group it creates;
    ``new_group`` hands a rank outside the group a sentinel, which has no name)."""
    name = getattr(group, "group_name", None)
    if name is not None:
        _GROUPS[name] = group


def group_named(name: str):
    group = _GROUPS.get(name)
    if group is None:
        raise RuntimeError(
            f"hf_parallel: a compiled collective names process group {name!r}, which no hf_parallel mesh created"
        )
    return group


torch.library.define("hf_parallel::all_reduce", "(Tensor x, str group) -> Tensor")
torch.library.define("hf_parallel::all_gather", "(Tensor x, int dim, SymInt[] sizes, str group) -> Tensor")
torch.library.define(
    "hf_parallel::all_to_all",
    "(Tensor x, int split_dim, int cat_dim, SymInt[] split_sizes, SymInt[] cat_sizes, int rank, str group) -> Tensor",
)
torch.library.define("hf_parallel::broadcast", "(Tensor x, str group) -> Tensor")
torch.library.define("hf_parallel::ring_shift", "(Tensor x, int step, str group) -> Tensor")
for _op in ("all_reduce", "all_gather", "all_to_all", "broadcast", "ring_shift"):
    keep_in_order(f"hf_parallel::{_op}")  # ranks whose graphs differ (uneven heads) must not reorder them


@torch.library.register_fake("hf_parallel::all_reduce")
def _all_reduce_fake(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("hf_parallel::all_gather")
def _all_gather_fake(x, dim, sizes, group):
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


def exchanged_shape(shape, split_dim: int, cat_dim: int, split_size, cat_size) -> list:
    """An all-to-all's piece (or, with every rank's ``cat_size`` summed, its output): ``shape`` with
    this rank's extent along ``split_dim`` and ``cat_size`` along ``cat_dim``."""
    shape = list(shape)
    shape[split_dim], shape[cat_dim] = split_size, cat_size
    return shape


@torch.library.register_fake("hf_parallel::all_to_all")
def _all_to_all_fake(x, split_dim, cat_dim, split_sizes, cat_sizes, rank, group):
    return x.new_empty(exchanged_shape(x.shape, split_dim, cat_dim, split_sizes[rank], sum(cat_sizes)))


@torch.library.register_fake("hf_parallel::broadcast")
def _broadcast_fake(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("hf_parallel::ring_shift")
def _ring_shift_fake(x, step, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
