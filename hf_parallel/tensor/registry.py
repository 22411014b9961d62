"""Parallel styles by name, as plans name them; users add their own with ``register_style``."""

from __future__ import annotations

from .experts import GroupedGemm, MoEEPExperts, MoETokenExchange, MoETPExperts
from .mixers import GatedDeltaNet, Mamba1Mixer, Mamba2Mixer, ShortConv
from .styles import (
    Colwise,
    ColwiseGatherOutput,
    EmbeddingColwise,
    EmbeddingHeads,
    EmbeddingRowwise,
    GroupedQKVColwise,
    PackedColwise,
    PackedRowwise,
    ParallelStyle,
    Replicated,
    ReplicatedWithGradAllReduce,
    Rowwise,
    RowwiseSplitInput,
    ShardedRMSNorm,
    TokensOverTP,
)

STYLES: dict[str, ParallelStyle] = {
    "replicated": Replicated(),
    "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce(),
    "colwise": Colwise(),
    "colwise_gather_output": ColwiseGatherOutput(),
    "packed_colwise": PackedColwise(),
    "grouped_qkv_colwise": GroupedQKVColwise(),
    "rowwise": Rowwise(),
    "rowwise_split_input": RowwiseSplitInput(),
    "packed_rowwise": PackedRowwise(),
    "moe_tp_experts": MoETPExperts(),
    "moe_ep_experts": MoEEPExperts(),
    "moe_ep_tokens": MoETokenExchange(),  # ep_size: tokens travel to the experts (all-to-all)
    "grouped_gemm": GroupedGemm(),
    "embedding_rowwise": EmbeddingRowwise(),
    "embedding_colwise": EmbeddingColwise(),
    "embedding_heads": EmbeddingHeads(),  # T5's relative position bias: [buckets, heads], split by heads
    "sequence_parallel": TokensOverTP(),  # transformers' name; Megatron's token split inside TP, not Ulysses
    "sharded_rmsnorm": ShardedRMSNorm(),
    "mamba2_mixer": Mamba2Mixer(),  # a whole mixer block, every parameter below it placed by heads
    "mamba1_mixer": Mamba1Mixer(),
    "gated_deltanet": GatedDeltaNet(),
    "short_conv": ShortConv(),
}


def register_style(name: str, style: ParallelStyle, *, overwrite: bool = False) -> None:
    """Make ``style`` usable by name in plans."""
    if not isinstance(style, ParallelStyle):
        raise TypeError(f"register_style({name!r}): expected a ParallelStyle instance, got {type(style).__name__}")
    if name in STYLES and not overwrite:
        raise ValueError(f"style {name!r} is already registered; pass overwrite=True to replace it")
    STYLES[name] = style


def get_style(name: str, rule: str = "") -> ParallelStyle:
    try:
        return STYLES[name]
    except KeyError:
        where = f" (rule {rule!r})" if rule else ""
        raise ValueError(
            f"unknown parallel style {name!r}{where}; registered styles: {', '.join(sorted(STYLES))}"
        ) from None
