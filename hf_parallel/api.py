"""from_pretrained / parallelize / save_pretrained, and the AutoModel* drop-ins.

The returned object is the ordinary transformers model (``generate`` and friends work as is);
only its parameters are local shards and its ``save_pretrained`` gathers them back.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import transformers
from accelerate import init_empty_weights
from torch import nn

from .checkpoint.distributed_save import save_distributed
from .checkpoint.loading import load_weights
from .checkpoint.saving import save_sharded
from .distributed.mesh import Mesh, get_mesh
from .tensor.parallelize import ShardPlan, install, shard_plan
from .tensor.plan import resolve_plan, with_expert_parallel


@dataclass
class ParallelState:
    """What a loaded model remembers so it can be saved back in its source's form."""

    mesh: Mesh
    shard: ShardPlan
    source_keys: dict[str, str]  # parameter (or persistent buffer) name -> checkpoint key it was read from


def resolve_dtype(dtype, config) -> torch.dtype:
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype


def build_empty(auto_class, config, dtype: torch.dtype) -> nn.Module:
    """The model with parameters on the meta device (buffers such as RoPE tables stay real)."""
    with init_empty_weights(include_buffers=False):
        model = auto_class.from_config(config, dtype=dtype)
    model.tie_weights()  # accelerate's meta init re-creates parameters, which unties them
    return model


def from_pretrained(
    auto_class,
    path: str,
    *,
    tp_plan="auto",
    ep_plan=None,
    dtype=None,
    tp_size: int | None = None,
    device_map=None,
    allow_pickle: bool = False,
    **config_kwargs,
):
    """``tp_plan=None`` (or ``{}``): no tensor parallelism, every rank holds the whole model.
    ``ep_plan="auto"``: experts spread whole over the ranks (attention and dense layers still
    follow ``tp_plan``; ``tp_plan=None`` keeps them replicated). ``allow_pickle``: accept a
    ``pytorch_model.bin`` checkpoint (loaded with ``weights_only=True``)."""
    if device_map is not None:
        raise ValueError(
            "tp_plan and device_map cannot be combined: tensor parallelism places every shard on its own rank"
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{path!r} is not a local checkpoint directory (hf_parallel reads checkpoints from disk)"
        )
    mesh = get_mesh(tp_size)
    config = transformers.AutoConfig.from_pretrained(path, **config_kwargs)
    dtype = resolve_dtype(dtype, config)
    model = build_empty(auto_class, config, dtype)
    if ep_plan is None:
        plan = resolve_plan(model, tp_plan)
    elif ep_plan == "auto":  # the experts' rules come from the model's plan even without tensor parallelism
        plan = with_expert_parallel(resolve_plan(model, tp_plan or "auto"), keep_tensor_parallel=bool(tp_plan))
    else:
        raise ValueError(f"ep_plan must be 'auto' (experts spread over the ranks) or None, got {ep_plan!r}")
    shard = shard_plan(model, plan, mesh)
    source_keys = load_weights(model, path, shard, dtype, allow_pickle)
    install(model, shard)
    model.eval()
    model._hf_parallel = ParallelState(mesh, shard, source_keys)
    model.save_pretrained = functools.partial(save_pretrained, model)
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    return model


def save_pretrained(
    model, save_directory: str, *, max_shard_size="50GB", distributed: bool = False, **_ignored
) -> None:
    """Call on every rank. By default each tensor is gathered to rank 0, which writes a standard
    checkpoint. ``distributed=True``: every rank writes its own shards in parallel plus a manifest
    (the fast path; ``hf-parallel consolidate`` turns it into a standard checkpoint)."""
    if distributed:
        save_distributed(model, save_directory)
    else:
        save_sharded(model, save_directory, max_shard_size=max_shard_size)


class _AutoDropIn:
    _auto_class = None

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        """``transformers.<Auto>.from_pretrained`` with ``tp_plan`` sharding over torchrun's ranks."""
        return from_pretrained(cls._auto_class, path, *args, **kwargs)


class AutoModelForCausalLM(_AutoDropIn):
    _auto_class = transformers.AutoModelForCausalLM


class AutoModel(_AutoDropIn):
    _auto_class = transformers.AutoModel
