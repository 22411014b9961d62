"""Continuous batching on a split model: transformers' own manager, paged cache and scheduler, over the TP group.

transformers' manager already runs at tensor parallelism (rank 0 of the group schedules and broadcasts its
decisions over a CPU group; every rank runs the same batch; one shared seed makes a sampled token the same on
every rank; a rank that fails stops the group, failing every request on every rank). What a split model adds:

- the group: the model's TP group, handed to the manager (``compat.transformers_serving``);
- the cache: sized from this rank's own heads (uneven splits, replicated KV heads), so each rank holds only its
  KV heads' pages, and from a memory budget per rank: ``kv_cache_memory_bytes`` when given, else transformers'
  share of free memory divided among the ranks sharing this device (ranks on one host, or on one GPU);
- no silent failure: ``generate_batch`` raises when a request failed or never came back (transformers logs it
  and returns what it has);
- refusals by name where the layout cannot follow the manager: pipeline stages (one rank holds the embedding,
  another the head), sequence and context parallelism (a decode step's token is not split), FSDP and data
  replicas (parameters gathered per forward; replicas would each schedule their own copy of the requests).
"""

from __future__ import annotations

import copy
import socket

import torch
import torch.distributed as dist

from ..compat import transformers_serving as serving
from ..distributed.devices import device_identity


def install_continuous_batching(model, mesh, heads, stage, kv_cache_memory_bytes: int | None = None) -> None:
    """Route ``model``'s continuous batching (transformers' ``init_continuous_batching`` and ``generate_batch``;
    ``continuous_batching_context_manager`` enters through the first) through the TP group, or refuse it by name.
    ``heads``: the attention heads' split over TP (None: attention replicated)."""
    if not hasattr(model, "init_continuous_batching") or (mesh.world_size == 1 and kv_cache_memory_bytes is None):
        return  # transformers' own, in one process
    refusal = _refusal(mesh, stage)

    def init_continuous_batching(generation_config=None, continuous_batching_config=None, workload_hints=None):
        if refusal:
            raise NotImplementedError(refusal)
        if serving.kept_manager(model) is not None:  # sized and handed the group when it was made
            return serving.init_manager(model, generation_config, continuous_batching_config, workload_hints)
        cb_config = serving.continuous_batching_config(continuous_batching_config)
        _budget(cb_config, model.device, mesh, kv_cache_memory_bytes)
        if mesh.world_size > 1:
            _no_graphs(cb_config)
        manager = serving.init_manager(model, generation_config, cb_config, workload_hints)
        if mesh.tp.size > 1 and manager.batch_processor is None:
            serving.hand_over_tp_group(manager, _tp_device_mesh(mesh), cb_config.cpu_group_timeout,
                                       _rank_config(model, heads, mesh.tp.rank))  # fmt: skip
        return manager

    def generate_batch(inputs, *args, **kwargs):
        results = serving.generate_batch(model, inputs, *args, **kwargs)
        generation_config = (args[0] if args else kwargs.get("generation_config")) or model.generation_config
        _check_results(results, len(inputs), generation_config)
        return results

    model.init_continuous_batching = init_continuous_batching
    model.generate_batch = generate_batch


def _refusal(mesh, stage) -> str | None:
    """Why continuous batching cannot run on this layout (None: it can)."""
    where = f"continuous batching (generate_batch / init_continuous_batching) on {mesh.shape}"
    if stage is not None:
        return f"{where}: pipeline stages are not supported (the manager runs the whole model on each rank); load " \
               "without pp_size / stage_tp_sizes"  # fmt: skip
    if mesh.sp.size > 1:
        return f"{where}: sequence and context parallelism are not supported (a decode step's single token " \
               "cannot be split); load without sp_size / cp_size"  # fmt: skip
    if mesh.shape.ep > 1:
        return f"{where}: ep_size (data-parallel attention, tokens exchanged between the experts' ranks) is " \
               "not supported: the manager schedules one batch for the TP group; load with ep_plan='auto'"  # fmt: skip
    if mesh.shape.dp > 1:
        return f"{where}: FSDP and data replicas are not supported (FSDP gathers parameters per forward; each " \
               "replica would schedule its own copy of the requests); load with tp_size only"  # fmt: skip
    return None


def _budget(cb_config, device: torch.device, mesh, kv_cache_memory_bytes: int | None) -> None:
    """The memory this rank gives the paged cache and its batch, as transformers' ``max_memory_percent`` of
    the free memory it measures: ``kv_cache_memory_bytes``, or transformers' default share divided among
    the ranks sharing this device. A size the user set in the config is theirs."""
    if kv_cache_memory_bytes is not None:
        if cb_config.max_memory_percent is not None or cb_config.num_blocks is not None:
            raise ValueError(
                "kv_cache_memory_bytes with ContinuousBatchingConfig(max_memory_percent / num_blocks): both size "
                "the paged cache; set one"
            )
        free = serving.device_free_memory()
        if not 0 < kv_cache_memory_bytes <= free:
            raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes}: this rank has {free} bytes free")
        cb_config.max_memory_percent = kv_cache_memory_bytes / free
    elif cb_config.max_memory_percent is None and cb_config.num_blocks is None:
        cb_config.max_memory_percent = serving.default_memory_fraction(cb_config, device) / _sharing(device, mesh)


def _no_graphs(cb_config) -> None:
    """CUDA graphs and the asynchronous double buffer (transformers' defaults on a GPU with flash attention)
    off unless asked for: they would capture the TP group's collectives, which is not checked yet (nor possible
    over gloo, several ranks sharing a GPU)."""
    if cb_config.use_cuda_graph is None:
        cb_config.use_cuda_graph = False
    if cb_config.use_async_batching is None:
        cb_config.use_async_batching = False


def _sharing(device: torch.device, mesh) -> int:
    """How many ranks share this rank's memory: those on its host (CPU) or on its device (a GPU several
    ranks share). Collective over the world."""
    if mesh.world.group is None:
        return 1
    mine = socket.gethostname() if device.type == "cpu" else device_identity(device)
    everyone = [None] * mesh.world_size
    dist.all_gather_object(everyone, mine, group=mesh.world.group)
    return everyone.count(mine)


def _tp_device_mesh(mesh):
    """The TP group as the 1-D DeviceMesh transformers' helper reads (named ``tp``)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(mesh.tp.group, mesh.device.type, mesh_dim_names=("tp",))


def _rank_config(model, heads, rank: int):
    """The text config as this rank holds it: its query and KV heads (the head size kept), which the paged
    cache sizes its pages from. None where attention is not split by heads."""
    config = model.config.get_text_config()
    if heads is None:
        return None
    local = copy.copy(config)
    local.head_dim = heads.head_dim
    local.num_attention_heads = heads.local_q(rank)
    local.num_key_value_heads = heads.local_kv(rank)
    return local


def _check_results(results: dict, prompts: int, generation_config) -> None:
    """transformers' ``generate_batch`` logs failed or missing requests and returns the rest: raise instead."""
    expected = prompts * (getattr(generation_config, "num_return_sequences", None) or 1)
    failed = {key: out.error for key, out in results.items() if out.error is not None}
    if failed or len(results) < expected:
        first = next(iter(failed.items()), None)
        raise RuntimeError(
            f"generate_batch: {len(failed)} of {expected} requests failed and {expected - len(results)} never "
            f"returned" + (f" (first: {first[0]}: {first[1]})" if first else "")
            + "; see the log of every rank for the cause"
        )
