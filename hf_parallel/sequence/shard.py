"""Sequence parallelism on a transformers causal LM: which tokens each rank holds, and the loss.

The model's forward runs as written, on the whole batch, up to its first decoder layer: embeddings,
positions (RoPE tables for every position) and the attention masks are built for the whole
sequence, so global positions, padding, packed samples and sliding windows are the model's own.
From the first decoder layer on, each rank holds its run of tokens (the first ``S % sp`` ranks one
more, so no padding is needed), and each layer is handed its tokens' slice of the position tables;
attention sees every token through ``ulysses.py``. Only a sequence shorter than sp is padded (to
one token per rank): the padding comes last, is masked out of attention, and is dropped from
gathered outputs and from the loss.

With ``labels`` the logits stay split: labels are shifted on the whole sequence first (no label is
lost at a boundary), each rank sums the cross-entropy of its tokens, and the sum over the group
divided by the batch's token count is the loss of one process. Without labels (inference,
``generate``) the final hidden states are gathered before the LM head, so logits are whole.

Every parameter is replicated over the sequence group and saw only its tokens, so its gradient is
summed over the group; the split at the first layer passes back ``1/sp`` of the gathered gradient,
the share of what came before it, so that sum is exact for the embeddings too.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import torch
from torch import nn

from ..distributed import comm
from ..tensor import attention
from ..tensor.discover import repeated_layers
from ..tensor.layout import even_sizes, sizes_to_ranges
from .ulysses import NAME, SequenceState

SERVED_IMPLEMENTATIONS = ("sdpa", "eager")
POSITION_KWARGS = {"position_embeddings": -2, "position_ids": -1, "cache_position": 0}  # name -> its sequence dim


def check_sequence_parallel(model: nn.Module, sp: int) -> None:
    """What sequence parallelism cannot serve, refused before any weight is read."""
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    if implementation not in SERVED_IMPLEMENTATIONS:
        raise ValueError(
            f"sp_size={sp}: the Ulysses wrapper serves attn_implementation {' or '.join(SERVED_IMPLEMENTATIONS)}, "
            f"not {implementation!r}; load with attn_implementation='sdpa'"
        )
    if not repeated_layers(model) or model.get_output_embeddings() is None:
        raise ValueError(f"sp_size={sp}: {type(model).__name__} has no repeated decoder layers and LM head to split")
    for path, module in attention.outermost(model):
        source = inspect.getsource(type(module).forward)
        if "ALL_ATTENTION_FUNCTIONS" not in source:
            raise ValueError(
                f"sp_size={sp}: {path} ({type(module).__name__}) computes attention itself instead of through "
                "transformers' attention registry, so the Ulysses all-to-all cannot wrap it"
            )
        heads = [n for n, p in module.named_parameters() if p.dim() == 1 and "norm" not in n and "bias" not in n]
        per_head = [n for n, m in module.named_modules() if isinstance(m, nn.ModuleList)]
        if heads or per_head:
            raise ValueError(
                f"sp_size={sp}: {path} ({type(module).__name__}) holds per-head {', '.join(heads + per_head)}, "
                "which the attention would index by the heads of another split; sequence parallelism cannot split it"
            )


def pad_sequence(x: torch.Tensor, dim: int, length: int, value=0, edge: bool = False) -> torch.Tensor:
    """``x`` extended along ``dim`` to ``length`` with ``value`` (or, ``edge``, its last entry)."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    fill = x.narrow(dim, x.shape[dim] - 1, 1) if edge else torch.full_like(x.narrow(dim, 0, 1), value)
    return torch.cat([x, fill.expand(*[missing if d == dim % x.dim() else -1 for d in range(x.dim())])], dim)


def parallelize_sequence(model: nn.Module, mesh, layer_list: str | None = None) -> None:
    """Split ``model``'s sequence over ``mesh.sp`` (after tensor parallelism is installed).
    ``layer_list``: the path of the layers' ModuleList, for a pipeline stage (whose other stages'
    layers are stand-ins, so the module tree has no list of identical layers to find)."""
    group, sp = mesh.sp.group, mesh.sp.size
    state = SequenceState(group, getattr(model.config, "_attn_implementation", None) or "eager")
    for _, module in attention.outermost(model):  # a private config copy: model.config (and the save) keep theirs
        module.config = copy.copy(module.config)
        module.config._attn_implementation = NAME
        module._hfp_sequence = state
    if layer_list is not None:
        layers = list(model.get_submodule(layer_list))
    else:
        layers = [model.get_submodule(path) for path in repeated_layers(model)]

    def local(value, dim):
        if isinstance(value, (tuple, list)):
            return type(value)(local(item, dim) for item in value)
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        start, stop = sizes_to_ranges(state.seq_sizes)[mesh.sp.rank]
        return pad_sequence(value, dim, sum(state.seq_sizes), edge=True).narrow(dim, start, stop - start)

    def enter_layer(module, args, kwargs):
        kwargs = {k: local(v, POSITION_KWARGS[k]) if k in POSITION_KWARGS else v for k, v in kwargs.items()}
        if module is layers[0]:  # the sequence splits here
            hidden, *rest = args if args else (kwargs.pop("hidden_states"),)
            hidden = pad_sequence(hidden, 1, sum(state.seq_sizes))
            args = (comm.scatter_to(hidden, 1, state.seq_sizes, group, grad_scale=1 / sp), *rest)
        return args, kwargs

    for layer in layers:
        layer.register_forward_pre_hook(enter_layer, with_kwargs=True)

    def gather_final(module, args, output):  # inference: whole logits, wherever logits_to_keep points
        if state.keep_split:
            return output
        whole = comm.gather_to_use(output.last_hidden_state, 1, state.seq_sizes, group)
        output.last_hidden_state = whole[:, : state.tokens]
        return output

    model.base_model.register_forward_hook(gather_final)
    for param in model.parameters():
        comm.sum_gradient_over(param, group)
    model.generation_config.use_cache = False  # decode re-runs the sequence split: no KV cache of split tokens
    model.forward = _sequence_forward(model, model.forward, state, mesh)


def _sequence_forward(model, forward, state, mesh):
    signature = inspect.signature(forward)
    group, sp = mesh.sp.group, mesh.sp.size
    warned = []

    def sequence_forward(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        inputs = dict(bound.arguments)
        extra = inputs.pop("kwargs", {})
        inputs = comm.broadcast_batch({**inputs, **extra}, group)  # every SP rank computes the same batch
        if inputs.get("past_key_values") is not None:
            raise ValueError(
                "a sequence-parallel forward keeps no KV cache (each rank's cache would hold only its tokens); "
                "generate() re-runs the whole sequence instead, or load with sp_size=1 to decode with a cache"
            )
        if inputs.get("use_cache") and not warned:
            warnings.warn(
                "sequence-parallel forward: use_cache=True is ignored (no KV cache of split tokens)", stacklevel=2
            )
            warned.append(True)
        inputs["use_cache"] = False
        labels = inputs.pop("labels", None)
        count = inputs.pop("num_items_in_batch", None)  # the whole batch's, when this is one micro-batch
        tokens = inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs["inputs_embeds"]
        state.tokens = tokens.shape[1]
        state.seq_sizes = tuple(even_sizes(max(state.tokens, sp), sp))  # shorter than sp: padded to one per rank
        state.keep_split = labels is not None
        out = forward(**inputs)
        if labels is not None:
            out.loss = sequence_loss(model, out.logits, labels, state.seq_sizes, mesh, count)
        return out

    sequence_forward.__signature__ = signature
    return sequence_forward


def sequence_loss(
    model, logits: torch.Tensor, labels: torch.Tensor, seq_sizes, mesh, count=None, ignore_index: int = -100
):
    """The mean next-token cross-entropy of the whole batch, from this rank's logits: labels
    shifted on the whole sequence, this rank's sum over its tokens divided by the batch's count of
    labelled tokens (``count``: of a larger batch this is a micro-batch of), summed over the group
    (backward: each rank's own share)."""
    shifted = nn.functional.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    shifted = pad_sequence(shifted, 1, sum(seq_sizes), value=ignore_index)  # padding tokens carry no label
    start, stop = sizes_to_ranges(seq_sizes)[mesh.sp.rank]
    local = shifted[:, start:stop].to(logits.device)
    count = (shifted != ignore_index).sum() if count is None else count
    total = nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), local.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    return comm.reduce_from(total / count, mesh.sp.group)
