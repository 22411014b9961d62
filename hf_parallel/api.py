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
from .checkpoint.loading import checkpoint_files, load_weights
from .checkpoint.saving import save_sharded
from .distributed.mesh import Mesh, get_mesh
from .pipeline import keep_stage, keys_held_elsewhere, link_stage, split_stages, tied_across_stages
from .sequence import check_sequence_parallel, parallelize_sequence
from .tensor.parallelize import ShardPlan, install, shard_plan
from .tensor.plan import resolve_plan, with_expert_parallel


@dataclass
class ParallelState:
    """What a loaded model remembers so it can be saved back in its source's form."""

    mesh: Mesh
    shard: ShardPlan
    source_keys: dict[str, str]  # parameter (or persistent buffer) name -> checkpoint key it was read from
    pipeline: object = None  # the stage's StageRuntime under pipeline parallelism
    tied_across_stages: tuple = ()  # parameters held by the first and the last stage


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
    sp_size: int = 1,
    pp_size: int = 1,
    stage_tp_sizes=None,
    stage_layers=None,
    micro_batches: int | None = None,
    device_map=None,
    allow_pickle: bool = False,
    **config_kwargs,
):
    """``tp_plan=None`` (or ``{}``): no tensor parallelism, every rank holds the whole model.
    ``ep_plan="auto"``: experts spread whole over the ranks (attention and dense layers still
    follow ``tp_plan``; ``tp_plan=None`` keeps them replicated). ``sp_size``: split every sequence
    over that many ranks (Ulysses), TP groups inside SP groups; the world is tp x sp.
    ``pp_size``: that many pipeline stages of contiguous layers, each at ``tp_size`` (and ``sp_size``); or
    ``stage_tp_sizes=[2, 1]``: one stage per entry with its own TP size (the world is their sum).
    ``stage_layers``: layers per stage (default: balanced by parameters, embeddings and head
    included); ``micro_batches``: rows of a batch per forward are cut into this many (default one per stage).
    ``allow_pickle``: accept a ``pytorch_model.bin`` checkpoint (loaded with ``weights_only=True``)."""
    if device_map is not None:
        raise ValueError(
            "tp_plan and device_map cannot be combined: tensor parallelism places every shard on its own rank"
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{path!r} is not a local checkpoint directory (hf_parallel reads checkpoints from disk)"
        )
    config, unknown = transformers.AutoConfig.from_pretrained(path, return_unused_kwargs=True, **config_kwargs)
    if unknown:
        raise TypeError(
            f"from_pretrained() got keyword argument(s) that hf_parallel does not take and {type(config).__name__} "
            f"does not define: {', '.join(sorted(unknown))}. hf_parallel takes tp_plan, ep_plan, dtype, tp_size, "
            "sp_size, pp_size, stage_tp_sizes, stage_layers, micro_batches, device_map and allow_pickle; any other "
            "keyword must be a config attribute (it overrides the checkpoint's)"
        )
    mesh = get_mesh(tp_size, sp_size=sp_size, pp_size=pp_size, stage_tp_sizes=stage_tp_sizes)
    if stage_layers is not None and mesh.num_stages == 1:
        raise ValueError(f"stage_layers={list(stage_layers)} needs pipeline stages: pass pp_size or stage_tp_sizes")
    dtype = resolve_dtype(dtype, config)
    model = build_empty(auto_class, config, dtype)
    if mesh.sp.size > 1:
        check_sequence_parallel(model, mesh.sp.size)
    split, elsewhere, files = None, set(), None
    if mesh.num_stages > 1:  # cut the meta model down to this stage before anything else sees it
        if model.get_output_embeddings() is None:
            raise ValueError(
                f"pipeline stages need a model with an LM head (the last stage's logits are what every rank gets); "
                f"{type(model).__name__} has none: load it with AutoModelForCausalLM, or without pp_size/stage_tp_sizes"
            )
        split = split_stages(model, mesh.num_stages, stage_layers)
        files = checkpoint_files(path, allow_pickle)
        elsewhere = keys_held_elsewhere(model, split, mesh.stage, files)
        keep_stage(model, split, mesh.stage)
    if ep_plan is None:
        plan = resolve_plan(model, tp_plan)
    elif ep_plan == "auto":  # the experts' rules come from the model's plan even without tensor parallelism
        plan = with_expert_parallel(resolve_plan(model, tp_plan or "auto"), keep_tensor_parallel=bool(tp_plan))
    else:
        raise ValueError(f"ep_plan must be 'auto' (experts spread over the ranks) or None, got {ep_plan!r}")
    shard = shard_plan(model, plan, mesh)
    source_keys = load_weights(model, path, shard, dtype, allow_pickle, ignore_keys=elsewhere, files=files)
    install(model, shard)
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    if mesh.sp.size > 1:
        parallelize_sequence(model, mesh, split.layer_list if split is not None else None)
    model.eval()
    model._hf_parallel = state = ParallelState(mesh, shard, source_keys)
    if split is not None:
        state.pipeline = link_stage(model, split, mesh, micro_batches)
        state.tied_across_stages = tuple(tied_across_stages(model, shard))
    model.save_pretrained = functools.partial(save_pretrained, model)
    return model


# transformers' save_pretrained keywords that cannot mean anything here, and why
REFUSED_SAVE_KEYWORDS = {
    "state_dict": "hf_parallel saves the model's own shards, gathered; it cannot write another state_dict",
    "push_to_hub": "hf_parallel writes to disk only; upload the saved directory with huggingface_hub",
    "token": "hf_parallel writes to disk only; upload the saved directory with huggingface_hub",
    "variant": "hf_parallel writes model.safetensors (or its sharded index), with no variant in the names",
    "save_peft_format": "the model is no PEFT adapter",
    "distributed_checkpoint": "hf_parallel's per-rank checkpoint is distributed=True",
}


def save_pretrained(
    model,
    save_directory: str,
    *,
    max_shard_size="50GB",
    distributed: bool = False,
    is_main_process: bool = True,
    safe_serialization: bool = True,
    save_original_format: bool = True,
    **unsupported,
) -> None:
    """Call on every rank. By default each tensor is gathered to rank 0, which writes a standard
    checkpoint. ``distributed=True``: every rank writes its own shards in parallel plus a manifest
    (the fast path; ``hf-parallel consolidate`` turns it into a standard checkpoint).

    transformers' ``is_main_process`` is accepted and has no effect (every rank must call; rank 0
    writes); ``safe_serialization`` and ``save_original_format`` are accepted as True, which is what
    hf_parallel always does. Any other keyword is refused, before anything is written."""
    for name in unsupported:
        if name in REFUSED_SAVE_KEYWORDS:
            raise TypeError(f"save_pretrained({name}=...): {REFUSED_SAVE_KEYWORDS[name]}")
        raise TypeError(
            f"save_pretrained() got an unexpected keyword argument {name!r}; hf_parallel takes max_shard_size, "
            "distributed, and transformers' is_main_process, safe_serialization=True, save_original_format=True"
        )
    if not safe_serialization:
        raise TypeError("save_pretrained(safe_serialization=False): hf_parallel writes safetensors only, never pickles")
    if not save_original_format:
        raise TypeError(
            "save_pretrained(save_original_format=False): hf_parallel writes the checkpoint's own key names and layout"
        )
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
