"""Every internal of transformers hf_parallel uses, and why no public seam serves.

- The conversion registry (checkpoint key <-> parameter name, per-expert keys -> fused experts):
  transformers' own table, so renamed and fused checkpoints load as they do in one process; and the keys
  it ignores for a model (read from the class attribute and rule its loader applies).
- A private config per attention module naming the Ulysses wrapper (``AttentionInterface`` is the
  public registry; ``set_attn_implementation`` would rewrite the model's config, which is saved).
- Under context parallelism, the model's config names a mask builder of ours for the length of a
  forward (``AttentionMaskInterface`` is the public registry, looked up by that name), and a mask
  function's composition is read from its closures to know it causal (and its window) without evaluating it.
- The expert-parallel sentinel: ids of other ranks' experts become ``num_experts``, which transformers'
  expert kernels skip once ``_is_expert_parallel`` is set (as its own EP does).
- The KV cache's per-layer tensors, cut into micro-batches' rows on pipeline stages.
- The Trainer: the flag by which a model says it owns its placement, the replica sizes it reads from
  ``config.distributed_config``, and the private steps ``training/trainer.py`` replaces.
- The parser of sizes such as ``20GiB`` that ``save_pretrained(max_shard_size=...)`` reads (not exported
  from ``transformers.utils``): the CLI's byte flags take what transformers takes.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
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


def checkpoints_activations(model) -> bool:
    """Whether a model's layers are under activation checkpointing (transformers 5.23 renamed
    ``is_gradient_checkpointing`` to ``is_activation_checkpointing``, warning on the old name)."""
    if getattr(type(model), "is_activation_checkpointing", None) is not None:
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def passes_keyword(function, name: str) -> bool:
    """Whether ``function``'s code passes a keyword argument ``name`` in some call (``s_aux=self.sinks``)."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is not None and _passes_keyword(code, name)


def _passes_keyword(code, name: str) -> bool:
    for const in code.co_consts:
        if isinstance(const, tuple) and name in const:  # a call's keyword names
            return True
        if isinstance(const, type(code)) and _passes_keyword(const, name):
            return True
    return False


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


# -- attention masks -----------------------------------------------------------------------------
MASK_INTERFACE = Seam("transformers", "transformers.masking_utils:AttentionMaskInterface.register",
                      "to hand ring attention a mask's description instead of the mask", parameters=("key", "value"))
CREATE_CAUSAL_MASK = Seam("transformers", "transformers.masking_utils:create_causal_mask",
                          "(it looks its mask builder up by the model config's _attn_implementation)",
                          reads=("_attn_implementation", "ALL_MASK_ATTENTION_FUNCTIONS"))  # fmt: skip
SDPA_MASK = Seam(
    "transformers", "transformers.masking_utils:sdpa_mask", "to build a chunk pair's mask from a mask function",
    parameters=("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "mask_function", "attention_mask",
                "allow_is_causal_skip", "use_vmap", "device"),
)  # fmt: skip
CAUSAL_MASK_FUNCTION = Seam("transformers", "transformers.masking_utils:causal_mask_function",
                            "(causal: keys up to the query)")  # fmt: skip
SLIDING_WINDOW_OVERLAY = Seam("transformers", "transformers.masking_utils:sliding_window_overlay",
                              "(keys less than the window back)", parameters=("sliding_window",))  # fmt: skip
# the compositions a mask function is read through (their closures hold what they compose, under these names)
MASK_COMPOSITIONS = {
    "and_masks.<locals>.and_mask": Seam("transformers", "transformers.masking_utils:and_masks",
                                        "(an intersection: causal if any part is)", parameters=("mask_functions",)),
    "or_masks.<locals>.or_mask": Seam("transformers", "transformers.masking_utils:or_masks",
                                      "(a union: causal if every part is)", parameters=("mask_functions",)),
    "remap_positions_for_packed_sequence.<locals>.inner_mask": Seam(
        "transformers", "transformers.masking_utils:remap_positions_for_packed_sequence",
        "(packed documents: causal in each document's positions)", parameters=("mask_function", "position_ids"),
    ),
}  # fmt: skip
REMAP_QUALNAME = "remap_positions_for_packed_sequence.<locals>.inner_mask"
PACKED_QUALNAME = "packed_sequence_mask_function.<locals>.inner_mask"
PACKED_SEQUENCE_MASK = Seam("transformers", "transformers.masking_utils:packed_sequence_mask_function",
                            "(each query in its own document)", parameters=("packed_sequence_mask",))  # fmt: skip


def register_mask(name: str, function) -> None:
    """``function`` builds the masks of models whose config names ``name`` (transformers' mask registry)."""
    MASK_INTERFACE.get()(name, function)


def resolve_mask_seams() -> None:
    """The seams described masks are read through, resolved (and checked) at load, not first inside a forward
    ``torch.compile`` traces (which cannot import)."""
    for seam in (CREATE_CAUSAL_MASK, SDPA_MASK, CAUSAL_MASK_FUNCTION, SLIDING_WINDOW_OVERLAY, PACKED_SEQUENCE_MASK,
                 *MASK_COMPOSITIONS.values()):  # fmt: skip
        seam.get()


@contextlib.contextmanager
def masks_built_by(config, name: str):
    """While it runs, ``config`` (and its text decoder's, where it has sub-configs) name ``name``, so the model's
    mask creation goes through the mask builder registered under it; each one's own is put back after."""
    CREATE_CAUSAL_MASK.get()
    configs = list({id(each): each for each in (config, config.get_text_config(decoder=True))}.values())
    held = [each._attn_implementation_internal for each in configs]
    try:
        for each in configs:  # the model's and its text decoder's, which its masks are made with; no other tower
            each._attn_implementation_internal = name
        yield
    finally:
        for each, implementation in zip(configs, held):
            each._attn_implementation_internal = implementation


def mask_block(mask_function, padding, batch: int, queries: tuple[int, int], keys: tuple[int, int], use_vmap: bool,
               device) -> torch.Tensor:  # fmt: skip
    """The ``[batch, 1, queries, keys]`` boolean mask of the queries ``range(*queries)`` against the keys
    ``range(*keys)``, built by transformers' own ``sdpa_mask`` from the model's mask function and 2D padding."""
    return SDPA_MASK.get()(
        batch_size=batch, q_length=queries[1] - queries[0], kv_length=keys[1] - keys[0], q_offset=queries[0],
        kv_offset=keys[0], mask_function=mask_function, attention_mask=padding, allow_is_causal_skip=False,
        use_vmap=use_vmap, device=device,
    )  # fmt: skip


def mask_reach(mask_function) -> tuple[bool, int | None]:
    """How far back and forward a transformers mask function lets a query see, read from how transformers
    composed it, with no mask evaluated: (causal: no key after its query; the sliding window no key is
    further back than, or None). Causal: ``causal_mask_function``, an intersection with a causal part, a
    union of causal parts, packed documents' remapping of a causal function beside the packed-documents mask
    (``_packed_reach``). Anything else (a model's bidirectional overlay, a function of its own) reads (False, None):
    that mask must be checked by evaluating it."""
    if mask_function is CAUSAL_MASK_FUNCTION.get():
        return True, None
    if torch.compiler.is_compiling():  # traced, a composition's closure cannot be read: the mask is evaluated
        return False, None
    name = getattr(mask_function, "__qualname__", "")
    if name == "sliding_window_overlay.<locals>.inner_mask":
        SLIDING_WINDOW_OVERLAY.get()
        return False, _closure(mask_function)["sliding_window"]
    seam = MASK_COMPOSITIONS.get(name)
    if seam is None or "mask_functions" not in seam.parameters:  # (packed documents' remap: only with their mask)
        return False, None
    seam.get()
    parts = _closure(mask_function)["mask_functions"]
    reaches = [_packed_reach(part, parts) for part in parts]
    windows = [window for _, window in reaches if window is not None]
    if mask_function.__name__ == "and_mask":
        return any(causal for causal, _ in reaches), min(windows, default=None)
    return all(causal for causal, _ in reaches), max(windows) if len(windows) == len(reaches) else None


def _packed_reach(part, parts) -> tuple[bool, int | None]:
    """A part's reach within an intersection: packed documents' remapping of a function reaches as that
    function does only beside the packed-documents mask that keeps each query in its document (positions
    then run on by one); alone, it would let a query see another document's keys."""
    if getattr(part, "__qualname__", "") != REMAP_QUALNAME:
        return mask_reach(part)
    if not any(getattr(other, "__qualname__", "") == PACKED_QUALNAME for other in parts):
        return False, None
    MASK_COMPOSITIONS[REMAP_QUALNAME].get()
    PACKED_SEQUENCE_MASK.get()
    return mask_reach(_closure(part)["mask_function"])


def _closure(function) -> dict:
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__)))


# -- the KV cache --------------------------------------------------------------------------------
DYNAMIC_CACHE = Seam("transformers", "transformers.cache_utils:DynamicCache",
                     "(a sequence-parallel rank's KV cache is one, holding that rank's positions)", reads=("layers",))
MASK_SIZES = Seam("transformers", "transformers.masking_utils:_preprocess_mask_arguments",
                  "(the mask's sizes come from the cache's lengths, which a sequence-parallel cache gives whole)",
                  reads=("get_query_offset", "get_mask_sizes"))  # fmt: skip


def dynamic_cache_class() -> type:
    MASK_SIZES.get()
    return DYNAMIC_CACHE.get()


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


# -- sizes -----------------------------------------------------------------------------------------
FILE_SIZE = Seam("transformers", "transformers.utils.hub:convert_file_size_to_int",
                 "to read sizes such as 20GiB as save_pretrained's max_shard_size does",
                 parameters=("size",))  # fmt: skip


def size_in_bytes(size: str) -> int:
    """``"20GiB"`` -> 21474836480, ``"500MB"`` -> 500000000, ``"1024"`` -> 1024: transformers' reading."""
    return int(size) if size.isdigit() else FILE_SIZE.get()(size)
