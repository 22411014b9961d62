"""What a rank holds, measured and predicted: the figures a layout is chosen by at 70B.

``held_bytes`` measures what a device would hold of some tensors (a DTensor's local shard, a plain
tensor whole, a meta tensor nothing; on the CPU a loaded slice may be a lazy view of the mapped
file, so the process's RSS would not say it). ``Footprint`` predicts, from the layout alone (before
any weight is read, as ``hf-parallel plan`` prints it), a rank's share of the weights and the
largest tensor it reads whole at the load: what a load straight into FSDP's shards holds.
``step_memory`` predicts, from the same layout, what a training step holds at its peak (``StepMemory``);
``benchmarks/memory.py`` measures both against these formulas.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .compat.torch import fsdp_row_range
from .core.dtypes import nbytes
from .core.layers import find_layer_list
from .distributed.fsdp import ends_of_their_own, expert_shard_dim
from .quant.kept import int4_copy_nbytes
from .sequence.tiled_loss import LOSS_CHUNK
from .state import is_parallel, parallel_state


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes a device holds of ``tensors``, each counted once: a DTensor's local shard, a plain tensor
    whole, a meta tensor nothing."""
    total, seen = 0, set()
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not local.is_meta:
            total += local.numel() * local.element_size()
    return total


def weights_held(model: torch.nn.Module) -> int:
    """Bytes this rank holds of ``model``'s weights: each parameter's local shard (``held_bytes``), and a
    checkpoint's weights kept quantized as stored (``keep_quantized``: their parts, not the placeholders in
    their slots, and the copies repacked for torch's int4 kernel beside them). Any model: transformers' own
    counts its parameters."""
    total = held_bytes(model.parameters())
    if is_parallel(model):
        total += sum(weight.nbytes for weight in parallel_state(model).kept.values()) + int4_copy_nbytes(model)
    return total


@dataclass(frozen=True)
class Footprint:
    """One rank's parameter bytes, from its layout: ``share`` (its FSDP rows of its TP shard of every
    parameter) and ``largest_slice`` (the largest TP slice of one tensor, which the load reads whole
    before keeping its rows)."""

    share: int
    largest_slice: int

    @property
    def load_peak(self) -> int:
        return self.share + self.largest_slice


def footprint(layout, dtype: torch.dtype, mesh=None) -> Footprint:
    """``layout``'s (a ``ModelLayout``) parameters on ``mesh``'s rank (default: its own mesh's), in ``dtype``.
    The plan's dry run passes each rank's ``Mesh.dry_run`` with the data-parallel sizes, which the mesh it
    builds the layout on lacks (the layout itself does not depend on them)."""
    mesh = mesh if mesh is not None else layout.mesh
    share = largest = 0
    for entry in layout.unique_params():
        over = mesh[entry.layout.over]  # (experts under ep_size: its EP rank's, FSDP-sharded over their replicas)
        shape = tuple(entry.layout.local_shape(entry.full_shape, over.rank))
        largest = max(largest, nbytes(shape, dtype))
        if mesh.shape.dp > 1 and shape:
            experts = entry.layout.over == "ep"
            fsdp = mesh["ep_replicas" if experts else "fsdp"]
            dim = expert_shard_dim(shape[0], fsdp.size) if experts else 0
            start, stop = fsdp_row_range(shape[dim], fsdp.rank, fsdp.size)
            shape = (*shape[:dim], stop - start, *shape[dim + 1 :])
        share += nbytes(shape, dtype)
    return Footprint(share, largest)


# One decoder layer's activations kept for the backward, in bytes per token and hidden unit in 16-bit
# (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.1):
# 34 without tensor parallelism, of which 10 stay whole on every TP rank and 24 are split over them;
# an attention computed unfused keeps 5 bytes per score besides (its scores, softmax and dropout mask).
LAYER_WHOLE, LAYER_SPLIT, SCORES = 10, 24, 5
MLP_SPLIT = 16  # of the 24 split: the MLP's two 4 x hidden wide tensors, which an experts layer's pairs replace
FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")  # keep no scores


@dataclass(frozen=True)
class Savings:
    """What a long-sequence step keeps less of (``plan --checkpointing --offload-checkpoints --tiled-loss N
    --tiled-mlp N``): ``model.gradient_checkpointing_enable()``, and ``from_pretrained``'s ``offload_checkpoints``,
    ``tiled_loss`` and ``tiled_mlp``, as that takes them: tokens a tile, or ``True`` for ``LOSS_CHUNK`` and
    ``hidden_size`` tokens)."""

    checkpointing: bool = False
    offload: bool = False  # each checkpointed layer's input held in host memory until the backward
    loss_chunk: bool | int = False  # tokens a chunk of the tiled loss scores at once
    mlp_tile: bool | int = False  # tokens a tile of the tiled MLP computes at once

    def tiles(self, hidden_size: int) -> tuple[int | None, int | None]:
        """(loss chunk, MLP tile) in tokens, None where not tiled."""
        loss = LOSS_CHUNK if self.loss_chunk is True else (self.loss_chunk or None)
        return loss, hidden_size if self.mlp_tile is True else (self.mlp_tile or None)

    def describe(self) -> str:
        parts = ["checkpointing"] * self.checkpointing + ["layer inputs offloaded"] * self.offload
        parts += ["tiled loss"] * bool(self.loss_chunk) + ["tiled MLP"] * bool(self.mlp_tile)
        return f" ({', '.join(parts)})" if parts else ""


@dataclass(frozen=True)
class StepMemory:
    """One rank's tensors at a training step's peak by ``step_memory``'s formula (bytes): its share of the
    parameters, their gradients and AdamW's two states, one FSDP unit whole (``gathered_unit``: its
    parameters and their gradients), and one micro-batch's activations (``batch`` rows x ``seq`` tokens)."""

    params: int
    grads: int
    optimizer: int
    gathered: int
    gathered_unit: str | None  # None: no FSDP
    activations: int
    batch: int
    seq: int
    expert_pairs: int = 0  # under ep_size: the (token, expert) pairs that may arrive per experts layer, at most
    savings: Savings = Savings()

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered + self.activations


def step_memory(model, layout, dtype: torch.dtype, batch: int = 1, seq: int = 2048, mesh=None,
                savings: Savings = Savings(), trainable: int | None = None) -> StepMemory:
    """A training step's peak on ``mesh``'s rank (default: the layout's own), from the layout alone: what a
    layout is chosen by before anything loads. The model states are the ZeRO paper's, each the rank's
    share: parameters, gradients, and AdamW's two states (``torch.optim.AdamW`` makes them ``zeros_like``
    each parameter: float32 for float32 masters); under FSDP one unit is whole besides, parameters and
    gradients, while it computes; then one micro-batch's activations (``activation_bytes``). Counted all at
    once, an upper estimate: with ``zero_grad(set_to_none=True)`` no gradient exists in the forward. Left
    out: a second unit FSDP holds whole (the next one prefetched in the backward, the last layer kept from
    the forward), the optimizer's step counts, the allocator's slack. ``savings``: what the step recomputes or
    moves instead (``activation_bytes``); ``trainable``: the bytes of this rank's trainable parameters where not
    every parameter trains (LoRA's adapters, float32 as peft keeps them): only they have gradients and AdamW's
    states."""
    mesh = mesh if mesh is not None else layout.mesh
    share = footprint(layout, dtype, mesh).share
    unit, gathered = gathered_unit(model, layout, dtype, mesh) if mesh.shape.dp > 1 else (None, 0)
    tokens = -(-batch * seq // mesh.sp.size)  # each rank of the sequence group holds its tokens
    exchange = token_exchange(model, layout, mesh, tokens)
    activations = activation_bytes(model, mesh.tp.size, tokens, seq, dtype, exchange, savings)
    pairs = exchange.arriving if exchange else 0
    if trainable is not None:  # the base frozen: its gathered unit's gradients never exist
        return StepMemory(share + trainable, trainable, 2 * trainable, gathered, unit, activations, batch, seq, pairs,
                          savings)  # fmt: skip
    return StepMemory(share, share, 2 * share, 2 * gathered, unit, activations, batch, seq, pairs, savings)


@dataclass(frozen=True)
class TokenExchangeCount:
    """Per experts layer under ``ep_size`` (``tensor/token_exchange.py``), on one rank: the (token, expert) pairs
    it sends (its share of its TP group's tokens, ``top_k`` each) and those that may arrive (every EP rank's
    share, each token at most ``min(top_k, local experts)`` pairs here: dropless routing bounds nothing
    lower), the experts' intermediate size, and that of the shared experts every token also goes through
    (Qwen2-MoE's ``shared_expert``, DeepSeek's ``n_shared_experts``; 0 without), split over TP."""

    layers: int
    sent: int
    arriving: int
    intermediate: int
    shared_intermediate: int = 0


def token_exchange(model, layout, mesh, tokens: int) -> TokenExchangeCount | None:
    """The token exchange of ``layout``'s experts on ``mesh``'s rank, ``tokens`` its tokens; None without
    ``ep_size`` (experts split over the TP group compute on the rank's own tokens)."""
    layers = len(layout.exchanging_experts())
    if not layers:
        return None
    text = model.config.get_text_config()
    top_k = text.num_experts_per_tok
    first = next(entry for entry in layout.unique_params() if entry.layout.over == "ep")
    local = first.layout.local_shape(first.full_shape, mesh.ep.rank)[0]  # this rank's experts
    share = -(-tokens // mesh.tp.size)  # the TP ranks of an EP group split their tokens (token_exchange.py)
    intermediate = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    if hasattr(text, "shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert of its own width
        shared = text.shared_expert_intermediate_size or 0
    else:  # DeepSeek: n_shared_experts of the routed experts' width
        shared = (getattr(text, "n_shared_experts", None) or 0) * intermediate
    arriving = mesh.ep.size * share * min(top_k, local)
    return TokenExchangeCount(layers, share * top_k, arriving, intermediate, shared)


def gathered_unit(model, layout, dtype: torch.dtype, mesh=None) -> tuple[str, int]:
    """The largest module FSDP gathers whole at once, and its bytes on ``mesh``'s rank (its TP shard, no
    longer split over FSDP): a decoder layer, the untied input embedding or LM head, which are units of
    their own (``shard_data_parallel``), or the root (the rest: a tied embedding and head, the final norm)."""
    mesh = mesh if mesh is not None else layout.mesh
    layers = find_layer_list(model)
    paths = {id(module): path for path, module in model.named_modules()}
    units = [f"{layers}.{index}" for index in range(len(model.get_submodule(layers)))]
    units += [paths[id(end)] for end in ends_of_their_own(model)]
    sizes = dict.fromkeys([*units, ROOT_UNIT], 0)
    for entry in layout.unique_params():
        unit = next((unit for unit in units if entry.name.startswith(unit + ".")), ROOT_UNIT)
        sizes[unit] += nbytes(tuple(entry.layout.local_shape(entry.full_shape, mesh[entry.layout.over].rank)), dtype)
    return max(sizes.items(), key=lambda item: item[1])


ROOT_UNIT = "the root"  # what no layer or end of its own holds: the final norm, a tied embedding with its head


def activation_bytes(model, tp: int, tokens: int, seq: int, dtype: torch.dtype,
                     exchange: TokenExchangeCount | None = None, savings: Savings = Savings()) -> int:
    """One micro-batch's activations kept for its backward on one rank, ``tokens`` of it on this rank (its
    rows x ``seq`` over the sequence group). Per decoder layer the standard estimate (Korthikanti et al.
    2022), scaled from 16-bit to ``dtype``: ``tokens x hidden x (10 + 24 / tp)``, plus the attention scores
    ``5 x heads / tp x seq x tokens`` when the attention is not fused (eager). Then the logits, whole on
    every TP rank (gathered for the loss): in ``dtype``, and twice in float32 for the loss (the
    log-probabilities cross-entropy keeps, and their gradient). An estimate: it counts GPT's layer, and a
    model's own norms, gates and rotary tables keep somewhat more or less.

    Under ``ep_size`` (``exchange``) an experts layer computes on the pairs that arrive, not on the rank's tokens:
    its MLP's split part (``16 / tp``) is replaced by each arriving pair's input row and its gated MLP's four
    intermediate-wide tensors (gate, up, the activation, their product: ``hidden + 4 x intermediate``) and each
    sent pair's output row, kept for the routing weight's product (``hidden``); arriving at their bound. Shared
    experts keep their four tensors per token, over TP.

    ``savings``: under checkpointing each layer keeps its input alone (``tokens x hidden``; none on the device
    with ``offload``), and one layer's activations exist at once, while the backward recomputes it; a tiled MLP
    keeps its 16 split bytes for one tile of tokens; a tiled loss holds one chunk's logits and the final hidden
    states it scores them from."""
    text = model.config.get_text_config()
    itemsize = torch.empty((), dtype=dtype).element_size()
    loss_chunk, mlp_tile = savings.tiles(text.hidden_size)
    mlp_share = min(mlp_tile, tokens) / tokens if mlp_tile else 1.0
    layer = tokens * text.hidden_size * (LAYER_WHOLE + (LAYER_SPLIT - MLP_SPLIT * (1 - mlp_share)) / tp)
    if getattr(model.config, "_attn_implementation", None) not in FUSED_ATTENTION:
        layer += SCORES * getattr(text, "num_attention_heads", 0) / tp * seq * tokens
    logits = 0
    if model.get_output_embeddings() is not None:
        scored = min(loss_chunk, tokens) if loss_chunk else tokens
        logits = scored * text.vocab_size * (itemsize + 2 * 4)
        logits += tokens * text.hidden_size * itemsize if loss_chunk else 0
    computing = 1 if savings.checkpointing else text.num_hidden_layers  # layers whose activations exist at once
    total = int(computing * layer * itemsize / 2) + logits
    if savings.checkpointing and not savings.offload:
        total += text.num_hidden_layers * tokens * text.hidden_size * itemsize  # each layer's input
    if exchange is not None:
        dense_mlp = tokens * text.hidden_size * MLP_SPLIT * mlp_share / tp * itemsize / 2
        pairs = exchange.arriving * (text.hidden_size + 4 * exchange.intermediate) + exchange.sent * text.hidden_size
        shared = tokens * 4 * exchange.shared_intermediate / tp
        total += int(min(exchange.layers, computing) * ((pairs + shared) * itemsize - dense_mlp))
    return total
