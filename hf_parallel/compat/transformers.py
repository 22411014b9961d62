"""Every internal of transformers hf_parallel uses, and why no public seam serves.

- The conversion registry (checkpoint key <-> parameter name, per-expert keys -> fused experts):
  transformers' own table, so renamed and fused checkpoints load as they do in one process; and the keys
  it ignores for a model (read from the class attribute and rule its loader applies).
- A private config per attention module naming the Ulysses wrapper (``AttentionInterface`` is the
  public registry; ``set_attn_implementation`` would rewrite the model's config, which is saved).
- The expert-parallel sentinel: ids of other ranks' experts become ``num_experts``, which transformers'
  expert kernels skip once ``_is_expert_parallel`` is set (as its own EP does).
- The KV cache's per-layer tensors, cut into micro-batches' rows on pipeline stages.
- The Trainer: the flag by which a model says it owns its placement, the replica sizes it reads from
  ``config.distributed_config``, and the private steps ``training/trainer.py`` replaces.
"""

from __future__ import annotations

import copy
import re

import torch

from . import Seam

# -- checkpoint keys -------------------------------------------------------------------------------
CONVERSION_MAPPING = Seam(
    "transformers", "transformers.conversion_mapping:get_model_conversion_mapping",
    "to map checkpoint keys to parameters as transformers does", parameters=("model",),
)  # fmt: skip
WEIGHT_RENAMING = Seam("transformers", "transformers.core_model_loading:WeightRenaming", "to tell renamings apart")
WEIGHT_CONVERTER = Seam("transformers", "transformers.core_model_loading:WeightConverter", "to find fused experts",
                        reads=("operations", "source_patterns"))  # fmt: skip
MERGE_MODULELIST = Seam("transformers", "transformers.core_model_loading:MergeModulelist", "(experts stacked)",
                        parameters=("dim",))  # fmt: skip
CONCATENATE = Seam("transformers", "transformers.core_model_loading:Concatenate", "(gate|up concatenated)",
                   parameters=("dim",))  # fmt: skip
RENAME_SOURCE_KEY = Seam(
    "transformers", "transformers.core_model_loading:rename_source_key", "to rename a checkpoint key",
    parameters=("source_key", "weight_renamings", "weight_converters", "base_model_prefix", "meta_state_dict"),
)  # fmt: skip


def conversion_transforms(model) -> tuple[list, list]:
    """The model's (renamings, converters) from transformers' conversion registry."""
    transforms = CONVERSION_MAPPING.get()(model)
    renaming, converter = WEIGHT_RENAMING.get(), WEIGHT_CONVERTER.get()
    return [t for t in transforms if isinstance(t, renaming)], [t for t in transforms if isinstance(t, converter)]


def rename_key(key: str, renamings: list, converters: list, prefix, meta_state: dict) -> tuple[str, str | None]:
    """(parameter name, the converter's source pattern the key matched or None), as transformers renames."""
    return RENAME_SOURCE_KEY.get()(key, renamings, converters, prefix, meta_state)


def stack_then_concat_dim(converter) -> int | None | bool:
    """The concat dim of a converter that stacks experts then concatenates blocks (None: stacks
    only); False for any other converter (its parameters are reported missing, naming it)."""
    ops = converter.operations
    stacks = len(ops) in (1, 2) and type(ops[0]) is MERGE_MODULELIST.get() and ops[0].dim == 0
    if stacks and len(ops) == 1:
        return None
    if stacks and type(ops[1]) is CONCATENATE.get():
        return ops[1].dim
    return False


def unexpected_key_patterns(model):
    """The checkpoint keys transformers ignores for ``model`` without a word (its
    ``_keys_to_ignore_on_load_unexpected``, e.g. DeepSeek-V3's multi-token-prediction layer, and old RoPE /
    position-id buffers), as one regex (None: none), as ``PreTrainedModel._adjust_missing_and_unexpected_keys``."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({pattern})" for pattern in sorted(patterns))) if patterns else None


# -- attention ------------------------------------------------------------------------------------
ATTENTION_FUNCTIONS = Seam("transformers", "transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS",
                           "(the registry attention modules look their implementation up in)")  # fmt: skip
ATTENTION_INTERFACE = Seam("transformers", "transformers:AttentionInterface.register", "to register Ulysses",
                           parameters=("key", "value"))  # fmt: skip
ATTN_IMPLEMENTATION = Seam("transformers", "transformers.configuration_utils:PreTrainedConfig._attn_implementation",
                           "to name the Ulysses wrapper in an attention module's private config",
                           reads=("sub_configs",))  # fmt: skip


def attention_implementation(config) -> str:
    """The attention implementation ``config`` names (eager when it names none)."""
    ATTN_IMPLEMENTATION.get()
    return config._attn_implementation or "eager"


def register_attention(name: str, function) -> None:
    ATTENTION_INTERFACE.get()(name, function)


def attention_function(name: str):
    return ATTENTION_FUNCTIONS.get()[name]


def computes_through_registry(module) -> bool:
    """Whether an attention module's forward looks its implementation up in transformers' registry
    (which the Ulysses wrapper goes in through), from the names its code uses."""
    from . import _names_read

    ATTENTION_FUNCTIONS.get()
    return {"ALL_ATTENTION_FUNCTIONS", "_attn_implementation"} <= _names_read(type(module).forward)


def use_attention(modules, name: str) -> None:
    """Every one of ``modules`` (attention modules) computes with the registered ``name``, through a
    private deep copy of its config (the model's config, its sub-configs and the saved config keep theirs)."""
    ATTN_IMPLEMENTATION.get()
    private: dict[int, object] = {}
    for module in modules:
        config = private.get(id(module.config))
        if config is None:
            config = private[id(module.config)] = copy.deepcopy(module.config)
            config._attn_implementation = name
        module.config = config


# -- activation checkpointing --------------------------------------------------------------------
CHECKPOINTED_LAYER = Seam("transformers", "transformers.modeling_layers:GradientCheckpointingLayer.__init_subclass__",
                          "(a layer's forward is recomputed through its _gradient_checkpointing_func)",
                          reads=("_gradient_checkpointing_func",))  # fmt: skip


def wrap_checkpointing(layer, wrap) -> None:
    """``layer``'s checkpointing function (set by ``gradient_checkpointing_enable``) replaced by
    ``wrap(function)``, once; nothing to do while checkpointing is off."""
    if not getattr(layer, "gradient_checkpointing", False):
        return
    function = getattr(layer, "_gradient_checkpointing_func", None)
    if function is not None and not getattr(function, "wrapped_by_hf_parallel", False):
        CHECKPOINTED_LAYER.get()
        layer._gradient_checkpointing_func = wrap(function)
        layer._gradient_checkpointing_func.wrapped_by_hf_parallel = True


# -- mixture of experts ---------------------------------------------------------------------------
EXPERT_PARALLEL_GROUPED = Seam("transformers", "transformers.integrations.moe:grouped_mm_experts_forward",
                               "(its kernel skips ids >= num_experts when _is_expert_parallel is set)",
                               reads=("_is_expert_parallel", "num_experts"))  # fmt: skip
EXPERT_PARALLEL_BATCHED = Seam("transformers", "transformers.integrations.moe:batched_mm_experts_forward",
                               "(its kernel skips ids >= num_experts when _is_expert_parallel is set)",
                               reads=("_is_expert_parallel", "num_experts"))  # fmt: skip


def mark_expert_parallel(module, local_experts: int) -> None:
    """The experts module holds ``local_experts`` of them; ids ``>= local_experts`` are skipped."""
    EXPERT_PARALLEL_GROUPED.get(), EXPERT_PARALLEL_BATCHED.get()
    module.num_experts, module._is_expert_parallel = local_experts, True


# -- KV cache -------------------------------------------------------------------------------------
CACHE_LAYERS = Seam("transformers", "transformers.cache_utils:Cache.__init__", "(a cache's per-layer list)",
                    reads=("layers",))  # fmt: skip
CACHE_LAYER_TENSORS = Seam("transformers", "transformers.cache_utils:DynamicLayer.update",
                           "(a layer's keys and values, [rows, heads, tokens, dim])",
                           reads=("keys", "values"))  # fmt: skip


def split_cache(cache, sizes: list[int]) -> list:
    """The cache's rows as one cache per micro-batch (shallow copies: row slices of its tensors)."""
    CACHE_LAYERS.get(), CACHE_LAYER_TENSORS.get()
    parts, start = [], 0
    for size in sizes:
        part = copy.copy(cache)
        part.layers = [copy.copy(layer) for layer in cache.layers]
        for layer in part.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 4:
                    setattr(layer, name, tensor[start : start + size])
        parts.append(part)
        start += size
    return parts


def join_cache(cache, parts: list) -> None:
    """Write the micro-batches' caches back into ``cache``, rows in order."""
    while len(cache.layers) < len(parts[0].layers):
        cache.layers.append(copy.copy(parts[0].layers[len(cache.layers)]))
    for index, layer in enumerate(cache.layers):
        pieces = [part.layers[index] for part in parts]
        layer.__dict__.update(pieces[0].__dict__)  # lengths, flags: the same for every row
        for name in ("keys", "values"):
            tensors = [getattr(piece, name, None) for piece in pieces]
            if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
                setattr(layer, name, torch.cat(tensors))


# -- the Trainer ----------------------------------------------------------------------------------
OWNS_PLACEMENT = Seam("transformers",
                      "transformers.modeling_utils:PreTrainedModel.is_distributed_loading_by_transformers",
                      "(the Trainer neither wraps nor moves a model that says it owns its placement)",
                      reads=("_is_distributed_loading_by_transformers",))  # fmt: skip
FSDP_MANAGED = Seam("transformers", "transformers.distributed.fsdp:is_fsdp_managed_module",
                    "(the Trainer defers FSDP's gradient reduction under accumulation)",
                    reads=("_is_fsdp_managed_module",))  # fmt: skip
TRAINER = Seam(
    "transformers", "transformers.trainer:Trainer",
    "(its steps below, the placement flag and the replica sizes in config.distributed_config)",
    reads=("is_distributed_loading_by_transformers", "is_fsdp_managed_module", "distributed_config", "dp_size",
           "dp_replicate_size", "_clip_grad_norm", "_get_grad_norm",
           "_sync_replicated_trainable_parameters", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
           "_load_from_checkpoint"),
)  # fmt: skip
TRAINER_INIT = Seam("transformers", "transformers.trainer:Trainer.__init__",
                    "(its resume check, passed as for a model-only save; a parallel model's batches placed)",
                    parameters=("model", "args"),
                    reads=("save_only_model", "is_distributed_loading_by_transformers"))  # fmt: skip
TRAINING_ARGUMENTS = Seam("transformers", "transformers:TrainingArguments", "(the Trainer's default arguments)",
                          parameters=("output_dir", "save_only_model"))  # fmt: skip
SCHEDULER_NAME = Seam("transformers", "transformers.trainer:SCHEDULER_NAME", "(the scheduler's file in a checkpoint)")
# the Trainer's steps hf_parallel replaces on its models, with the parameters it passes them
TRAINER_STEPS = {
    name: Seam("transformers", f"transformers.trainer:Trainer.{name}", "(replaced on hf_parallel's models)",
               parameters=parameters)  # fmt: skip
    for name, parameters in {
        "_clip_grad_norm": ("model",),
        "_get_grad_norm": ("model", "grad_norm"),
        "_sync_replicated_trainable_parameters": ("model",),
        "_save_optimizer_and_scheduler": ("output_dir",),
        "_load_optimizer_and_scheduler": ("checkpoint",),
        "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    }.items()
}
CLIP_GRAD_NORM, GET_GRAD_NORM, SYNC_REPLICATED, SAVE_OPTIMIZER, LOAD_OPTIMIZER, LOAD_CHECKPOINT = TRAINER_STEPS.values()


def declare_owned_placement(model, replica_sizes, fsdp: bool) -> None:
    """Tell the Trainer ``model`` owns its placement and gradient reductions: it neither wraps nor
    moves it, and reads how many ranks share a batch from ``config.distributed_config``."""
    OWNS_PLACEMENT.get()
    model._is_distributed_loading_by_transformers = True
    model.config.distributed_config = replica_sizes
    if fsdp:
        FSDP_MANAGED.get()
        model._is_fsdp_managed_module = True
