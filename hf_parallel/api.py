"""from_pretrained / parallelize / save_pretrained, and the AutoModel* drop-ins.

The returned object is the ordinary transformers model (``generate`` and friends work as is);
only its parameters are local shards and its ``save_pretrained`` gathers them back.
"""

from __future__ import annotations

import functools

import torch
import transformers

from .adapters.placement import Adapters
from .adapters.seams import watch
from .build import build_rank_model, resolve_dtype
from .checkpoint.distributed_save import save_distributed
from .checkpoint.files import MAX_SHARD_SIZE
from .checkpoint.hub import local_checkpoint
from .checkpoint.loading import checkpoint_files, load_weights, materialise_shards, shard_shapes_on_meta
from .checkpoint.saving import save_sharded
from .on_device import check_on_device, move_module_state
from .distributed.mesh import get_mesh
from .pipeline.stage import install_stage
from .runtime import Runtime, forward_under_autocast
from .serving.batching import install_continuous_batching
from .sequence.shard import decoder_layers, install_sequence
from .sequence.tiled_loss import LOSS_CHUNK, TiledLoss
from .sequence.tiled_mlp import tile_mlps
from .state import ParallelState, attach, parallel_state
from .tensor.gradients import GradientSums
from .quant.kept import hold_quantized
from .tensor.parallelize import install
from .tensor.token_exchange import count_expert_tokens as count_expert_tokens_of
from .tensor.token_exchange import refuse_local_router_loss
from .distributed.fsdp import fsdp_policies, return_freed_blocks_to_the_os, shard_data_parallel
from .training.fused_head import vocab_rows
from .training.clipping import route_torch_clipping
from .training.trainer import from_distributed_config, install_trainer_seams


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
    fsdp_size: int = 1,
    dp_replicate_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    distributed_config=None,
    device_map=None,
    allow_pickle: bool = False,
    keep_quantized: bool | str = False,
    mixed_precision: str | None = None,
    fsdp_cpu_offload: bool = False,
    tiled_mlp: bool | int = False,
    tiled_loss: bool | int = False,
    offload_checkpoints: bool = False,
    kv_cache_memory_bytes: int | None = None,
    count_expert_tokens: bool = False,
    **config_kwargs,
):
    """Load the checkpoint at ``path`` split over the ranks: each rank reads only its own slices.

    Run it on every rank (under ``torchrun``; one process is one rank). The ranks form a mesh of
    ``dp_replicate x fsdp x pp x cp x sp x tp``, the data-parallel dimensions outermost.

    :param auto_class: the transformers class to build, e.g. ``transformers.AutoModelForCausalLM``.
    :param path: a local checkpoint directory (safetensors, or ``pytorch_model.bin`` with ``allow_pickle``), or
        a hub id (``"org/name"``), found as transformers finds it: huggingface_hub's cache, downloading what is
        missing unless ``HF_HUB_OFFLINE=1``.
    :param tp_plan: (str | dict | None, default ``"auto"``) the tensor-parallel rules: ``"auto"`` (a shipped
        plan, else transformers', else discovered), ``"discover"``, a registered model_type, a dict of
        rules, or the path of a TOML/JSON file of rules (as the CLI's ``--tp-plan``); ``None`` or ``{}``: no
        tensor parallelism, every rank holds the whole model.
    :param ep_plan: (str | None, default None) ``ep_plan="auto"``: experts spread whole over the ranks;
        attention and dense layers still follow ``tp_plan`` (``tp_plan=None`` keeps them replicated).
    :param dtype: (torch.dtype | str | None, default None) the dtype to load in; None or ``"auto"``: the
        config's, else float32.
    :param tp_size: (int | None, default None) ranks a layer is split over; None: the ranks the other
        sizes leave of the world.
    :param sp_size: (int, default 1) ranks each sequence is split over (Ulysses); TP groups sit inside.
    :param pp_size: (int, default 1) pipeline stages of contiguous layers, each at ``tp_size``.
    :param stage_tp_sizes: (list[int] | None, default None) one pipeline stage per entry, each with its
        own TP size (the replica is their sum); leave ``tp_size`` unset.
    :param stage_layers: (list[int] | None, default None) layers per stage; None: balanced by parameters,
        embeddings and head included.
    :param micro_batches: (int | None, default None) micro-batches a pipelined forward cuts its rows into;
        None: one per stage (one for a decode step).
    :param fsdp_size: (int, default 1) data-parallel replicas whose parameters, gradients and optimizer
        state FSDP2 shards between them.
    :param dp_replicate_size: (int, default 1) copies of the FSDP group (HSDP), gradients all-reduced.
    :param cp_size: (int, default 1) SP groups in a ring (context parallelism): each holds two zigzag
        chunks of the sequence, key/value blocks travel around the ring.
    :param ep_size: (int, default 1) ranks holding distinct experts, tokens travelling to them by all-to-all
        (transformers' ``ep_size``): ``tp_size`` times a divisor of ``dp_replicate_size x fsdp_size x cp_size x
        sp_size``, the EP group borrowed from the data (and sequence) ranks, so attention and dense layers are
        data-parallel over it and each rank routes only its own tokens. Experts are spread unevenly where they do
        not divide; each FSDP-sharded over the ranks holding the same ones. 1: no token exchange
        (``ep_plan="auto"`` still spreads experts over the TP group, each rank on the group's whole batch).
    :param distributed_config: (transformers ``DistributedConfig`` | None, default None) the sizes and
        plans as transformers asks for them, instead of the keywords above.
    :param device_map: must be None: each shard is placed on its own rank.
    :param allow_pickle: (bool, default False) accept a ``pytorch_model.bin`` (read with ``weights_only=True``).
    :param keep_quantized: (bool | str, default False) False: a quantized checkpoint is dequantized as read.
        True: each rank keeps its slices as stored, dequantized (or multiplied as stored) module by module
        in the forward; inference only, saved back in the checkpoint's format. ``"fp8"`` / ``"int4"``:
        besides, FP8 (W8A8) products / torch's int4 kernel. Which mode to choose: docs/guides/quantized.md,
        "Choosing a mode"; which kernel runs where: docs/architecture.md, "Kept quantized weights".
    :param mixed_precision: (str | None, default None) ``"bf16"``: compute in bfloat16 with float32 master
        weights and optimizer state (the load reads float32: pass ``dtype=torch.float32`` or leave it unset);
        under FSDP its policy (parameters gathered in bf16, gradients reduced in float32, TP/SP sums too),
        otherwise the forward under ``torch.autocast``. ``DistributedConfig(fsdp_mixed_precision=True)`` asks
        the same.
    :param fsdp_cpu_offload: (bool, default False) FSDP's shards (and their gradients and optimizer state) in
        host memory between uses (FSDP2's ``CPUOffloadPolicy``); an accelerator's ranks only.
    :param tiled_mlp: (bool | int, default False) each decoder layer's MLP run over tiles of the sequence
        (ALST), each checkpointed in training, so its intermediate activations exist for one tile at a time;
        True: tiles of ``hidden_size`` tokens, an int: that many tokens. Exact; dense MLPs only.
    :param tiled_loss: (bool | int, default False) a forward given ``labels`` computes its loss from the final
        hidden states a chunk of tokens at a time (ALST), vocab-parallel where the LM head's vocabulary is split,
        each chunk recomputed in backward, so the whole ``[tokens, vocab]`` logits never exist; the output's
        ``logits`` are None. True: chunks of 1024 tokens, an int: that many. Exact; causal LMs only.
    :param offload_checkpoints: (bool, default False) what a training forward keeps for its backward outside its
        checkpointed layers (each layer's input, and the model's own loss's logits: pair it with ``tiled_loss``)
        held in host memory until the backward (pinned on a GPU); needs gradient checkpointing.
    :param kv_cache_memory_bytes: (int | None, default None) the memory each rank gives continuous batching
        (``generate_batch``, ``init_continuous_batching``, ``hf-parallel serve``): the paged cache of its own
        KV heads and the batch's buffers; None: transformers' share of the free memory, divided among the ranks
        sharing this rank's device (its host, or a GPU several ranks share).
    :param count_expert_tokens: (bool, default False) under ``ep_size``: count the tokens routed to each expert,
        on the device without a host read in the step; ``parallel_state(model).tokens_per_expert()`` reads the
        world's counts since the last read.
    :param config_kwargs: config attributes that override the checkpoint's (as in transformers).
    :returns: the ordinary transformers model, its parameters this rank's shards: ``generate`` works as
        is, and its ``save_pretrained`` gathers the shards back (or writes each rank's: ``distributed=True``).
    :raises ValueError: a size, plan, layout or checkpoint that cannot be honoured, refused by name before
        any weight is read (``CheckpointError``, a ValueError: the checkpoint's).
    :raises FileNotFoundError: ``path`` is neither a directory nor shaped like a hub id.
    :raises OSError: a hub id neither cached nor reachable (huggingface_hub's error, with the id).
    :raises TypeError: a keyword neither hf_parallel nor the config takes.
    """
    # the steps after the empty build, in this order, each owning what it sets up and none rewriting an
    # earlier one's (one line a step)
    if keep_quantized not in (False, True, "fp8", "int4"):
        raise ValueError(f"keep_quantized={keep_quantized!r}: one of False, True, 'fp8' and 'int4'")
    path = local_checkpoint(path, allow_pickle)
    config = _read_config(path, device_map, config_kwargs)
    sizes = dict(tp_size=tp_size, sp_size=sp_size, pp_size=pp_size, stage_tp_sizes=stage_tp_sizes,
                 fsdp_size=fsdp_size, dp_replicate_size=dp_replicate_size, cp_size=cp_size,
                 ep_size=ep_size)  # fmt: skip
    if distributed_config is not None:
        sizes, tp_plan, ep_plan, policies = from_distributed_config(distributed_config, sizes, tp_plan, ep_plan)
        mixed_precision = mixed_precision or policies["mixed_precision"]
        fsdp_cpu_offload = fsdp_cpu_offload or policies["fsdp_cpu_offload"]
    compute_dtype = _compute_dtype(mixed_precision, dtype, keep_quantized)
    if count_expert_tokens and sizes.get("ep_size", 1) == 1:
        raise ValueError("count_expert_tokens=True without ep_size: the tokens are counted as they are exchanged")
    mesh = get_mesh(**sizes)  # every process group, created once
    dtype = torch.float32 if compute_dtype is not None else resolve_dtype(dtype, config)  # mixed: fp32 masters
    policies = _fsdp_policies(mesh, compute_dtype, fsdp_cpu_offload)
    files = checkpoint_files(path, allow_pickle) if mesh.num_stages > 1 else None  # a stage sets the others' aside
    # 1. layouts: this rank's empty model, cut to its stage, every parameter's layout; all refusals
    built = build_rank_model(auto_class, config, dtype, mesh, tp_plan, ep_plan, stage_layers, files)
    model, cut = built.model, built.cut
    kept = _keep_quantized(path, built, mesh) if keep_quantized else None
    # 2. load: each rank reads its slices (those kept quantized: dequantized in each module's call); under
    # FSDP after step 6, straight into the shards of a model sharded while empty
    load = functools.partial(load_weights, model, path, built.layout, dtype, allow_pickle, built.ignore_keys,
                             files=files, quantization=built.quantization)  # fmt: skip
    sharded = mesh.shape.dp > 1
    source_keys = shard_shapes_on_meta(model, built.layout, dtype) if sharded else load(kept=kept)
    hold_quantized(model, kept or {}, fp8_products=keep_quantized == "fp8", int4_kernels=keep_quantized == "int4")
    _read_generation_config(model, path)
    # 3. tensor (and expert) parallelism: each module's collectives; gradient sums recorded
    gradients = GradientSums()
    hooks = install(model, built.layout, gradients, cut.kept_for_tied_weights if cut is not None else frozenset())
    # 4. the sequence split (Ulysses, and the ring of context parallelism)
    sequence = install_sequence(model, mesh, built.split, gradients) if mesh.sp.size > 1 else None
    if tiled_mlp:  # (ALST) each layer's MLP over tiles of the sequence
        tile_mlps(decoder_layers(model, built.split), config.hidden_size if tiled_mlp is True else int(tiled_mlp))
    # 5. the pipeline stage: receive, send, stop
    stage = install_stage(model, built.split, cut, built.layout, mesh, micro_batches) if cut is not None else None
    move_module_state(model, mesh.device)  # buffers and tables the checkpoint did not hold, to this rank's device
    # 6. the data dimensions (FSDP2 / HSDP), then every gradient sum registered once
    stage_forward = None
    if sharded:
        gradients.reduce_dtype = torch.float32 if compute_dtype is not None else None
        experts = [model.get_submodule(path) for path in built.layout.exchanging_experts()]
        stage_forward = shard_data_parallel(model, mesh, gradients, sequence, stage is not None, policies, experts)
        materialise_shards(model, torch.device("cpu") if fsdp_cpu_offload else mesh.device)
        source_keys = load(into_shards=True)
        move_module_state(model, mesh.device)  # the buffers the checkpoint held, read on the host
    else:
        gradients.register(model)
    # 7. the runtime around the forward, and the state every later call reads
    loss = _tiled_loss(model, tiled_loss, built.layout, mesh, stage, keep_quantized) if tiled_loss else None
    runtime = Runtime(model, sequence, stage, own=stage_forward, tiled_loss=loss,
                      offload_checkpoints=offload_checkpoints)  # fmt: skip
    if compute_dtype is not None and mesh.shape.dp == 1:  # (under FSDP its policy casts)
        runtime.autocast = (mesh.device.type, compute_dtype)  # the micro-batches of a stage's schedule
        forward_under_autocast(model, mesh.device, compute_dtype)  # model.forward, generate, a Trainer's step
    install_continuous_batching(model, mesh, built.layout.heads, stage, kv_cache_memory_bytes)
    model.eval()
    state = ParallelState(mesh, built.layout, source_keys, runtime, gradients, hooks, Adapters(), keep_quantized,
                          kept or {}, built.quantization_config, compute_dtype)  # fmt: skip
    if count_expert_tokens:
        state.expert_tokens = count_expert_tokens_of(model, built.layout.exchanging_experts(), mesh.device)
    if mesh.shape.ep > 1:
        refuse_local_router_loss(model)
    attach(model, state)
    model.save_pretrained = functools.partial(save_pretrained, model)
    # 8. adapters (peft) and the Trainer's seams, each installed when its library is first imported
    watch(model, state)
    install_trainer_seams(model, state)
    if mesh.world.group is not None:  # torch's clipping by the global norm (one process: torch's own is that)
        route_torch_clipping()
    check_on_device(model, mesh.device, parameters=not fsdp_cpu_offload)  # (offloaded: on the host)
    return model


def _tiled_loss(model, tokens, layout, mesh, stage, keep_quantized) -> TiledLoss:
    """The tiled loss of ``from_pretrained(tiled_loss=...)``: vocab-parallel where the LM head's weight is this
    rank's vocabulary rows as a plain tensor (not kept quantized, not sharded by FSDP), else through the head."""
    if stage is not None:
        raise ValueError(
            "tiled_loss on pipeline stages: the last stage's loss is computed by its schedule; load without "
            "tiled_loss, or without pp_size / stage_tp_sizes"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"tiled_loss on an encoder-decoder ({type(model.config).__name__}): its labels are the decoder's, aligned "
            "by its own loss; load without tiled_loss"
        )
    config = model.config.get_text_config()
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "tiled_loss with output_router_logits=True: the router's auxiliary loss is added by the model's own "
            "loss, which the tiled loss replaces; load with output_router_logits=False"
        )
    plain_head = mesh.shape.dp == 1 and not keep_quantized
    split = vocab_rows(model, layout.params.get, mesh.tp, "tiled_loss") if plain_head else None
    return TiledLoss(model, LOSS_CHUNK if tokens is True else int(tokens), split)


def _fsdp_policies(mesh, compute_dtype, cpu_offload: bool) -> dict:
    """FSDP's policies for this mesh (none without data-parallel dimensions, where offloading is refused)."""
    if cpu_offload and mesh.shape.dp == 1:
        raise ValueError("fsdp_cpu_offload=True without fsdp_size / dp_replicate_size: it offloads FSDP's shards")
    return fsdp_policies(mesh, compute_dtype, cpu_offload) if mesh.shape.dp > 1 else {}


def _compute_dtype(mixed_precision, dtype, keep_quantized) -> torch.dtype | None:
    """``mixed_precision``'s compute dtype (None: the parameters'), refused by name where it cannot hold: only
    bf16 (fp16 needs loss scaling, which nothing here does), float32 masters, and training weights."""
    if mixed_precision is None:
        return None
    if mixed_precision not in ("bf16", "bfloat16", torch.bfloat16):
        raise ValueError(
            f"mixed_precision={mixed_precision!r}: hf_parallel computes mixed precision in bf16 only (\"bf16\"); "
            "fp16 would need loss scaling"
        )
    if dtype not in (None, "auto", "float32", torch.float32):
        raise ValueError(
            f"mixed_precision={mixed_precision!r} with dtype={dtype}: mixed precision keeps float32 master weights "
            "(small updates vanish in bf16 ones); leave dtype unset or pass torch.float32, or drop mixed_precision"
        )
    if keep_quantized:
        raise ValueError(f"mixed_precision={mixed_precision!r} with keep_quantized: kept weights are inference-only")
    return torch.bfloat16


def _keep_quantized(path: str, built, mesh) -> dict:
    """Where ``keep_quantized=True`` cannot hold: refused by name before any weight is read. An empty dict
    the load fills."""
    if built.quantization is None:
        raise ValueError(f"keep_quantized=True: {path} is not a quantized checkpoint (its config has no "
                         "quantization_config)")  # fmt: skip
    if mesh.shape.ep > 1:
        raise ValueError(
            f"keep_quantized=True with ep_size={mesh.shape.ep}: kept experts are spread over the TP group only; "
            "load with ep_plan='auto' instead of ep_size"
        )
    if mesh.shape.dp > 1:
        raise ValueError(
            f"keep_quantized=True with fsdp_size / dp_replicate_size ({mesh.shape}): FSDP shards and trains "
            "parameters, and kept weights are inference-only; load without keep_quantized to train"
        )
    if mesh.device.type == "cpu":  # each module's weight is dequantized for its call and freed after it: glibc
        return_freed_blocks_to_the_os()  # would keep those blocks and grow back towards the dequantized model
    return {}


def _read_config(path: str, device_map, config_kwargs: dict):
    """The checkpoint's config with the user's overrides; what cannot apply refused by name."""
    if device_map is not None:
        raise ValueError(
            "tp_plan and device_map cannot be combined: tensor parallelism places every shard on its own rank"
        )
    config, unknown = transformers.AutoConfig.from_pretrained(path, return_unused_kwargs=True, **config_kwargs)
    if unknown:
        raise TypeError(
            f"from_pretrained() got keyword argument(s) that hf_parallel does not take and {type(config).__name__} "
            f"does not define: {', '.join(sorted(unknown))}. hf_parallel takes tp_plan, ep_plan, dtype, tp_size, "
            "sp_size, pp_size, stage_tp_sizes, stage_layers, micro_batches, fsdp_size, dp_replicate_size, "
            "cp_size, ep_size, distributed_config, device_map, allow_pickle, keep_quantized, mixed_precision, "
            "fsdp_cpu_offload, tiled_mlp, tiled_loss, offload_checkpoints, kv_cache_memory_bytes and "
            "count_expert_tokens; any other "
            "keyword must be a config attribute (it overrides the checkpoint's)"
        )
    return config


def _read_generation_config(model, path: str) -> None:
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    except OSError:
        pass


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
    max_shard_size=MAX_SHARD_SIZE,
    distributed: bool = False,
    is_main_process: bool = True,
    safe_serialization: bool = True,
    save_original_format: bool = True,
    state_dict=None,
    **unsupported,
) -> None:
    """Call on every rank. By default each tensor is gathered to rank 0, which writes a standard
    checkpoint. ``distributed=True``: every rank writes its own shards in parallel plus a manifest
    (the fast path; ``hf-parallel consolidate`` turns it into a standard checkpoint).

    transformers' ``is_main_process`` is accepted and has no effect (every rank must call; rank 0
    writes); ``safe_serialization`` and ``save_original_format`` are accepted as True and
    ``state_dict`` as None (the Trainer's ``save_model`` passes them), which is what hf_parallel
    always does. Any other keyword is refused, before anything is written."""
    if state_dict is not None:
        unsupported["state_dict"] = state_dict
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
    state = parallel_state(model)
    if distributed:  # either way, under FSDP one layer whole at a time, as the save reaches it
        save_distributed(model, state, save_directory)
    else:
        save_sharded(model, state, save_directory, max_shard_size=max_shard_size)


class _AutoDropIn:
    _auto_class = None

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        """``transformers.<Auto>.from_pretrained`` with ``tp_plan`` sharding over torchrun's ranks."""
        return from_pretrained(cls._auto_class, path, *args, **kwargs)


class AutoModelForCausalLM(_AutoDropIn):
    """transformers' ``AutoModelForCausalLM``, loaded parallel: ``from_pretrained(path, tp_plan="auto", ...)``
    takes ``from_pretrained``'s keywords (above)."""

    _auto_class = transformers.AutoModelForCausalLM


class AutoModel(_AutoDropIn):
    """transformers' ``AutoModel`` (encoders such as BERT, base models), loaded parallel."""

    _auto_class = transformers.AutoModel


class AutoModelForSeq2SeqLM(_AutoDropIn):
    """transformers' ``AutoModelForSeq2SeqLM`` (T5, BART), loaded parallel."""

    _auto_class = transformers.AutoModelForSeq2SeqLM


class AutoModelForSpeechSeq2Seq(_AutoDropIn):
    """transformers' ``AutoModelForSpeechSeq2Seq`` (Whisper), loaded parallel."""

    _auto_class = transformers.AutoModelForSpeechSeq2Seq
