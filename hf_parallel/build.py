"""This rank's model before any weight is read: built on the meta device, checked, cut to its
pipeline stage, and every parameter's rule and layout decided. ``from_pretrained`` loads into it;
``hf-parallel plan`` prints it, as any rank would see it, with no processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .checkpoint.keys import FusedSource, checkpoint_sources
from .quant.formats import Quantization, read_quantization, with_stored_keys
from .compat.accelerate import init_empty_weights
from .distributed.mesh import Mesh
from .pipeline.split import StageSplit, split_stages
from .pipeline.stage import StageCut, cut_to_stage
from .sequence.shard import check_sequence_parallel
from .tensor.mixers import recurrent_mixers
from .tensor.parallelize import ModelLayout, model_layout
from .tensor.plan import resolve_plan
from .distributed.fsdp import layers_to_shard, return_freed_blocks_to_the_os


@dataclass
class RankModel:
    """A rank's empty model and everything decided about it."""

    model: nn.Module  # parameters on the meta device (buffers such as RoPE tables real)
    layout: ModelLayout  # every parameter's rule and layout on this rank
    split: StageSplit | None = None  # the pipeline's stages, when there are several
    cut: StageCut | None = None  # what this rank's stage holds in place of the others' modules
    ignore_keys: frozenset[str] = frozenset()  # checkpoint keys the other stages read
    quantization: Quantization | None = None  # the checkpoint's (its weights dequantized as read)
    quantization_config: object = None  # the config's, as read (a model holding its weights quantized saves it)


def resolve_dtype(dtype, config) -> torch.dtype:
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype


def build_empty(auto_class, config, dtype: torch.dtype) -> nn.Module:
    """The model with parameters on the meta device (buffers such as RoPE tables stay real)."""
    with init_empty_weights():
        model = auto_class.from_config(config, dtype=dtype)
    model.tie_weights()  # accelerate's meta init re-creates parameters, which unties them
    return model


def keys_held_elsewhere(model: nn.Module, split: StageSplit, stage: int, keys) -> frozenset[str]:
    """The checkpoint keys of the modules other stages hold (of the full model, before the cut):
    this stage neither reads them nor calls them unexpected."""
    direct, fused = checkpoint_sources(model, keys)
    mine = split.owned(stage)

    def elsewhere(name: str) -> bool:
        owner = split.stage_of(name)
        return owner is not None and owner != stage and not any(name.startswith(p + ".") for p in mine)

    found = {key for name, key in direct.items() if elsewhere(name)}
    for name, source in fused.items():
        if elsewhere(name) and isinstance(source, FusedSource):
            found.update(key for block in source.keys for key in block)
    return frozenset(found)


def check_encoder_decoder(config, mesh: Mesh) -> None:
    """Encoder-decoders (T5, BART, Whisper) split by tensor parallelism alone: the other dimensions
    assume one stack of layers over one sequence (Ulysses would split the encoder's and the decoder's
    sequences, of different lengths, around cross-attention; pipeline stages and FSDP cut one list
    of layers). Refused by name before any weight is read."""
    asked = {
        "sp_size": mesh.shape.ulysses,
        "cp_size": mesh.shape.cp,
        "pp_size / stage_tp_sizes": mesh.num_stages,
        "fsdp_size": mesh.shape.dp_shard,
        "dp_replicate_size": mesh.shape.dp_replicate,
    }
    refused = [f"{name}={size}" for name, size in asked.items() if size > 1]
    if refused:
        raise ValueError(
            f"{type(config).__name__} is an encoder-decoder (T5, BART, Whisper, ...): hf_parallel splits it by tensor "
            f"parallelism (tp_size) only, not {', '.join(refused)}"
        )


def check_mixers_under_fsdp(model: nn.Module, tp: int, fsdp: int) -> None:
    """Recurrent mixers split by TP under FSDP are refused: a group's rows held by several ranks need
    gradient sums, which under FSDP hook the unsharded parameters when their module runs, and the
    mixers read their conv weight without calling its module (the sum would be skipped silently)."""
    mixers = recurrent_mixers(model) if tp > 1 and fsdp > 1 else []
    if mixers:
        path, module = mixers[0]
        raise ValueError(
            f"fsdp_size={fsdp} with tp_size={tp}: {path} ({type(module).__name__}) is a "
            "recurrent mixer, which hf_parallel splits by tensor parallelism or shards with FSDP, not both; "
            "use one of the two for this model"
        )


def build_rank_model(
    auto_class,
    config,
    dtype: torch.dtype,
    mesh: Mesh,
    tp_plan="auto",
    ep_plan=None,
    stage_layers=None,
    checkpoint_keys=None,
) -> RankModel:
    """Everything that can be refused is refused here, before any weight is read. ``checkpoint_keys``
    (under pipeline stages): the checkpoint's keys, of which the other stages' are set aside."""
    if stage_layers is not None and mesh.num_stages == 1:
        raise ValueError(f"stage_layers={list(stage_layers)} needs pipeline stages: pass pp_size or stage_tp_sizes")
    quantization_config = getattr(config, "quantization_config", None)
    quantization = read_quantization(config)  # others refused by name; the config left without it
    if getattr(config, "is_encoder_decoder", False):
        check_encoder_decoder(config, mesh)
    if mesh.shape.ep > 1 and getattr(config.get_text_config(), "output_router_logits", False):
        raise ValueError(
            f"ep_size={mesh.shape.ep} with output_router_logits=True: the router's auxiliary loss would count only "
            "this rank's tokens per expert, not the global batch's; load with output_router_logits=False"
        )
    model = build_empty(auto_class, config, dtype)
    if mesh.sp.size > 1:
        check_sequence_parallel(model, mesh.shape.ulysses, mesh.shape.cp)
    check_mixers_under_fsdp(model, mesh.tp.size, mesh.shape.dp_shard)
    if mesh.shape.dp > 1:
        layers_to_shard(model, mesh)  # FSDP wraps them one by one: a model without them is refused here
        if mesh.device.type == "cpu":
            return_freed_blocks_to_the_os()  # before the load allocates: FSDP frees gathered layers to the OS
    built = RankModel(model, None, quantization=quantization, quantization_config=quantization_config)
    if mesh.num_stages > 1:  # cut the meta model down to this stage before anything else sees it
        if model.get_output_embeddings() is None:
            raise ValueError(
                f"pipeline stages need a model with an LM head (the last stage's logits are what every rank gets); "
                f"{type(model).__name__} has none: load it with AutoModelForCausalLM, or without pp_size/stage_tp_sizes"
            )
        built.split = split_stages(model, mesh.num_stages, stage_layers)
        if checkpoint_keys is not None:
            stored = with_stored_keys(checkpoint_keys, quantization)  # quantized weights under their own names too
            built.ignore_keys = keys_held_elsewhere(model, built.split, mesh.stage, stored)
        built.cut = cut_to_stage(model, built.split, mesh.stage)
    held_elsewhere = built.cut.held_elsewhere if built.cut is not None else frozenset()
    plan = resolve_plan(model, tp_plan, ep_plan, exchange_tokens=mesh.shape.ep > 1)
    built.layout = model_layout(model, plan, mesh, held_elsewhere)
    return built
