"""Sequence parallelism on a transformers causal LM: which tokens each rank holds, and the loss.

The model's forward runs as written, on the whole batch, up to its first decoder layer: embeddings,
positions (RoPE tables for every position) and the attention masks (under CP described, not built:
``masks.py``) are made for the whole sequence, so global positions, padding, packed samples and
sliding windows are the model's own.
From the first decoder layer on, each rank holds its run of tokens (``tokens.py``), and each layer
is handed its tokens' slice of the position tables; attention sees every token through
``ulysses.py`` (and, with a ring of Ulysses groups, ``ring.py``: context parallelism, where the
sequence is first put in its zigzag order and every per-token tensor follows it). Only a sequence
shorter than sp is padded (to one token per rank; under CP, to whole chunks): the padding comes
last, is masked out of attention, and is dropped from gathered outputs and from the loss.

With ``labels`` the logits stay split: labels are shifted on the whole sequence first (no label is
lost at a boundary), each rank sums the cross-entropy of its tokens, and the sum over the group
divided by the batch's token count is the loss of one process. Without labels (inference,
``generate``) the final hidden states are gathered before the LM head, so logits are whole.

Every parameter is replicated over the sequence group and saw only its tokens, so its gradient is
summed over the group; the split at the first layer passes back ``1/sp`` of the gathered gradient,
the share of what came before it, so that sum is exact for the embeddings too.

What changes per call (the token split, whether a loss follows) is the call's ``SequenceCall``
(``context.py``), which the hooks here read; ``SequenceSplit`` is what stays.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..compat.transformers import (
    attention_implementation,
    computes_through_registry,
    dynamic_cache_class,
    masks_built_by,
    passes_keyword,
    resolve_mask_seams,
    use_attention,
    wrap_checkpointing,
)
from ..core.context import SequenceCall, current_call, keeping_the_call
from ..distributed import comm
from ..distributed.batch import broadcast_batch
from ..core.layers import repeated_layers
from ..tensor import attention
from ..tensor.gradients import GradientSums
from ..tensor.mixers import recurrent_mixers
from .tokens import TokenLayout, token_layout, token_range

SERVED_IMPLEMENTATIONS = ("sdpa", "eager")
POSITION_KWARGS = {"position_embeddings": -2, "position_ids": -1, "cache_position": 0}  # name -> its sequence dim


@dataclass(frozen=True)
class SequenceSplit:
    """A model's sequence group (``cp`` Ulysses groups in a ring): every sequence of a call is split over it."""

    group: object
    rank: int
    size: int
    inner: str  # the attention implementation the model was configured with (wrapped by Ulysses)
    device: torch.device  # where the group's collectives receive
    ulysses: object = None  # the mesh's Dim of adjacent ranks trading tokens for heads (None: the whole group)
    cp: object = None  # the mesh's Dim of the ring (None: no ring)
    config: object = field(default=None, compare=False)  # the model's config (its masks, described under CP)
    _orders: dict = field(default_factory=dict, compare=False)  # tokens -> (order, inverse) on the device

    @property
    def rings(self) -> int:
        return self.cp.size if self.cp is not None else 1

    def masks(self, call: SequenceCall):
        """Around a forward: under context parallelism the model's masks are built as descriptions
        (``masks.py``: no ``[S, S]`` tensor), its config naming the Ulysses wrapper's mask builder meanwhile.
        A decode step's mask is the model's own (the new tokens' rows only)."""
        if self.cp is None or call.decoding:
            return contextlib.nullcontext()
        from .ulysses import NAME  # (registered with transformers' mask registry there)

        return masks_built_by(self.config, NAME)

    def layout(self, tokens: int) -> TokenLayout:
        return token_layout(tokens, self.size // self.rings, self.rings)

    def call(self, tokens: int, keep_split: bool, cache=None) -> SequenceCall:
        """One forward's split of ``tokens`` tokens (``cache``: the rank's ``SequenceCache``, if it keeps one;
        once it holds a prompt, the forward is a decode step and is not split)."""
        if cache is not None and cache.decoding:
            if keep_split:
                raise ValueError(
                    "a sequence-parallel forward with labels and a KV cache holding tokens: a decode step runs "
                    "whole and computes no split loss; compute the loss on a forward without past_key_values"
                )
            return SequenceCall(self, None, keep_split, cache=cache, decoding=True)
        layout = self.layout(tokens)
        if layout.cp == 1:  # the sequence in its own order
            return SequenceCall(self, layout, keep_split, cache=cache)
        if tokens not in self._orders:  # made on the device (no host copy), kept for the last few lengths
            if len(self._orders) >= 8:
                self._orders.pop(next(iter(self._orders)))
            chunks = torch.arange(layout.length, device=self.device).view(2 * layout.cp, layout.chunk)
            order = torch.cat([chunks[i] for g in range(layout.cp) for i in layout.chunks_of(g)])
            self._orders[tokens] = order, torch.argsort(order)
        order, inverse = self._orders[tokens]
        return SequenceCall(self, layout, keep_split, order, inverse, cache=cache)


def in_ranks_order(x: torch.Tensor, dim: int, sequence: SequenceCall, value=0, edge: bool = False) -> torch.Tensor:
    """A whole-sequence tensor padded at its end (with ``value``, or its last entry) and put in the ranks'
    order (the zigzag under CP): rank r's tokens are then its run of ``sequence.sizes``."""
    x = pad_sequence(x, dim, sequence.layout.length, value=value, edge=edge)
    return x if sequence.order is None else x.index_select(dim, sequence.order.to(x.device))


def own_tokens(x: torch.Tensor, dim: int, sequence: SequenceCall, value=0, edge: bool = False) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor (``in_ranks_order``, then this rank's run)."""
    x = in_ranks_order(x, dim, sequence, value=value, edge=edge)
    start, stop = token_range(sequence.sizes, sequence.split.rank)
    return x.narrow(dim, start, stop - start)


def whole_tokens(x: torch.Tensor, dim: int, sequence: SequenceCall, gather=comm.gather_to_use) -> torch.Tensor:
    """Every rank's tokens along ``dim`` (``gather``: with or without a backward), in the sequence's
    own order, padding dropped."""
    whole = gather(x, dim, sequence.sizes, sequence.split.group)
    if sequence.inverse is not None:
        whole = whole.index_select(dim, sequence.inverse.to(whole.device))
    return whole.narrow(dim, 0, sequence.tokens)


def check_sequence_parallel(model: nn.Module, sp: int, cp: int = 1) -> None:
    """What sequence (``sp``: Ulysses) and context (``cp``: ring) parallelism cannot serve, refused
    before any weight is read."""
    asked = ", ".join(f"{name}={size}" for name, size in (("sp_size", sp), ("cp_size", cp)) if size > 1)
    implementation = attention_implementation(model.config)
    if implementation not in SERVED_IMPLEMENTATIONS:
        raise ValueError(
            f"{asked}: the Ulysses wrapper serves attn_implementation {' or '.join(SERVED_IMPLEMENTATIONS)}, "
            f"not {implementation!r}; load with attn_implementation='sdpa'"
        )
    if not repeated_layers(model) or model.get_output_embeddings() is None:
        raise ValueError(f"{asked}: {type(model).__name__} has no repeated decoder layers and LM head to split")
    mixers = recurrent_mixers(model)
    if mixers:
        path, module = mixers[0]
        raise ValueError(
            f"{asked}: {path} ({type(module).__name__}, and {len(mixers) - 1} more like it) carries a state along "
            "the sequence (a causal convolution and a recurrence): each token needs the state of the tokens before it, "
            "so splitting the sequence needs a state handed from rank to rank, which hf_parallel does not implement; "
            "split this model by tensor parallelism (tp_size) instead"
        )
    for path, module in attention.outermost(model):
        if cp > 1 and any(getattr(inner, "is_causal", True) is False for inner in module.modules()):
            raise ValueError(
                f"{asked}: {path} ({type(module).__name__}) is not causal attention (is_causal=False: an encoder, "
                "or bidirectional attention); ring attention skips the key blocks after the queries, which such "
                "attention reads; use sp_size alone"
            )
        if not computes_through_registry(module):
            raise ValueError(
                f"{asked}: {path} ({type(module).__name__}) computes attention itself instead of through "
                "transformers' attention registry, so the Ulysses all-to-all cannot wrap it"
            )
        heads = [n for n, p in module.named_parameters() if p.dim() == 1 and "norm" not in n and "bias" not in n]
        if passes_keyword(type(module).forward, "s_aux"):  # attention sinks, handed to attention: each rank's own
            heads = [n for n in heads if n != "sinks"]
        indexers = [n for n, m in module.named_modules() if n.rsplit(".", 1)[-1] == "indexer"]
        if indexers:
            raise ValueError(
                f"{asked}: {path} ({type(module).__name__}) selects the keys each query attends to with its own "
                f"{indexers[0]} (sparse attention), which the Ulysses wrapper and ring attention do not apply; split "
                "this model by tensor parallelism (tp_size) instead"
            )
        per_head = [n for n, m in module.named_modules() if isinstance(m, nn.ModuleList)]
        if heads or per_head:
            raise ValueError(
                f"{asked}: {path} ({type(module).__name__}) holds per-head {', '.join(heads + per_head)}, "
                "which the attention would index by the heads of another split; sequence parallelism cannot split it"
            )


def pad_sequence(x: torch.Tensor, dim: int, length: int, value=0, edge: bool = False) -> torch.Tensor:
    """``x`` extended along ``dim`` to ``length`` with ``value`` (or, ``edge``, its last entry)."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    fill = x.narrow(dim, x.shape[dim] - 1, 1) if edge else torch.full_like(x.narrow(dim, 0, 1), value)
    return torch.cat([x, fill.expand(*[missing if d == dim % x.dim() else -1 for d in range(x.dim())])], dim)


def install_sequence(model: nn.Module, mesh, stages, gradients: GradientSums) -> SequenceSplit:
    """Split ``model``'s sequences over ``mesh.sp`` (after tensor parallelism is installed): the
    hooks on the decoder layers and before the LM head, Ulysses attention, and every gradient summed
    over the group. ``stages``: the pipeline's ``StageSplit``, which names the layer list (or None)."""
    from .ulysses import NAME  # registers the wrapper with transformers' attention registry

    layers = decoder_layers(model, stages)

    rings = mesh.shape.cp
    if rings > 1:
        resolve_mask_seams()  # (context parallelism describes the model's masks)
    split = SequenceSplit(
        mesh.sp.group, mesh.sp.rank, mesh.sp.size, attention_implementation(model.config),
        mesh.device, mesh.ulysses if rings > 1 else mesh.sp, mesh.cp if rings > 1 else None, model.config,
    )  # fmt: skip
    use_attention([module for _, module in attention.outermost(model)], NAME)  # model.config (and the save) keep theirs

    def local(value, dim, sequence: SequenceCall):
        if isinstance(value, (tuple, list)):
            return type(value)(local(item, dim, sequence) for item in value)
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return own_tokens(value, dim, sequence, edge=True)

    def enter_layer(module, args, kwargs):
        wrap_checkpointing(module, keeping_the_call)  # its recompute reads the call too (Ulysses attention)
        sequence = current_call().sequence
        if sequence.decoding:  # the new tokens run whole
            return args, kwargs
        kwargs = {k: local(v, POSITION_KWARGS[k], sequence) if k in POSITION_KWARGS else v for k, v in kwargs.items()}
        if module is layers[0]:  # the sequence splits here
            hidden, *rest = args if args else (kwargs.pop("hidden_states"),)
            hidden = in_ranks_order(hidden, 1, sequence)  # (index_select's backward puts the gradient back)
            args = (comm.scatter_to(hidden, 1, sequence.sizes, split.group, grad_scale=1 / split.size), *rest)
        return args, kwargs

    for layer in layers:
        layer.register_forward_pre_hook(enter_layer, with_kwargs=True)

    def gather_final(module, args, output):  # inference: whole logits, wherever logits_to_keep points
        sequence = current_call().sequence
        if sequence.keep_split or sequence.decoding:
            return output
        output.last_hidden_state = whole_tokens(output.last_hidden_state, 1, sequence)
        return output

    model.base_model.register_forward_hook(gather_final)
    for param in model.parameters():
        gradients.sum_over(param, split.group)
    if stages is not None:  # pipeline stages' micro-batches keep no split cache: decode re-runs the sequence
        model.generation_config.use_cache = False
    return split


def sequence_inputs(split: SequenceSplit, inputs: dict, warned: list, can_cache: bool = True) -> dict:
    """A forward's keyword arguments as every rank of the group computes them: the batch of the group's
    first rank, and each rank's own KV cache (``decode.py``) where the forward keeps one (``use_cache``
    without labels, or a cache given: ``generate``). ``can_cache``: False on pipeline stages, which keep
    none."""
    given = inputs.pop("past_key_values", None)  # each rank's own object: not broadcast
    inputs = broadcast_batch(inputs, split.group, split.device)
    if not can_cache:
        if given is not None:
            raise ValueError(
                "a sequence-parallel forward on pipeline stages keeps no KV cache (each rank's cache would hold "
                "only its tokens); generate() re-runs the whole sequence instead"
            )
        if inputs.get("use_cache") and not warned:
            warnings.warn("sequence-parallel forward on pipeline stages: use_cache=True is ignored", stacklevel=3)
            warned.append(True)
        inputs["use_cache"] = False
        return inputs
    keeps = given is not None or (inputs.get("use_cache") and inputs.get("labels") is None)
    inputs["use_cache"] = bool(keeps)
    if keeps:
        inputs["past_key_values"] = sequence_cache(split, given)
    return inputs


def sequence_cache(split: SequenceSplit, given):
    """The rank's ``SequenceCache``: the one given, or a new one in place of an empty cache of transformers'
    (``generate`` makes one before the prompt's forward). A cache holding tokens made elsewhere is refused."""
    from .decode import SequenceCache

    if isinstance(given, SequenceCache):
        return given
    if given is not None and (type(given) is not dynamic_cache_class() or given.offloading):
        raise ValueError(
            f"a sequence-parallel forward was given a {type(given).__name__}"
            f"{' (offloaded)' if getattr(given, 'offloading', False) else ''}: each rank keeps its own positions' "
            "keys and values in a DynamicCache of hf_parallel's; generate with cache_implementation=\"dynamic\" "
            "(a checkpoint's generation_config may name another), or use_cache=False to re-run the sequence"
        )
    if given is not None and given.get_seq_length() > 0:
        raise ValueError(
            f"a sequence-parallel forward was given a {type(given).__name__} already holding "
            f"{given.get_seq_length()} tokens, made outside hf_parallel: each rank's cache must hold the positions "
            "it computed; start generation from the prompt (no past_key_values) so each rank keeps its own"
        )
    return SequenceCache(split)


def shifted_labels(labels, sequence: SequenceCall, ignore_index=-100, shift: bool = True):
    """Each token's next-token label over the whole (padded) sequence (``shift=False``: ``labels`` are
    that already), and this rank's run of them: shifted on the whole sequence, so no label is lost at a
    boundary between ranks; padding tokens carry none."""
    shifted = nn.functional.pad(labels, (0, 1), value=ignore_index)[:, 1:] if shift else labels
    return shifted, own_tokens(shifted, 1, sequence, value=ignore_index)


def sequence_loss(logits: torch.Tensor, labels: torch.Tensor, sequence: SequenceCall, count=None, ignore_index=-100):
    """The mean next-token cross-entropy of the whole batch, from this rank's logits: labels
    shifted on the whole sequence, this rank's sum over its tokens divided by the batch's count of
    labelled tokens (``count``: of a larger batch this is a micro-batch of), summed over the group
    (backward: each rank's own share)."""
    split = sequence.split
    shifted, local = shifted_labels(labels, sequence, ignore_index)
    local = local.to(logits.device)
    count = (shifted != ignore_index).sum() if count is None else count
    total = nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), local.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    return comm.reduce_from(total / count, split.group)


def decoder_layers(model: nn.Module, stages=None) -> list[nn.Module]:
    """The layers the sequence is split at: those of the list a pipeline stage names (``stages``: the
    pipeline's ``StageSplit``; its other stages' layers are stand-ins, so the module tree has no list of
    identical layers to find), else the model's repeated layers."""
    if stages is not None:
        return list(model.get_submodule(stages.layer_list))
    return [model.get_submodule(path) for path in repeated_layers(model)]
