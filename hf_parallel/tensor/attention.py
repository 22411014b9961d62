"""Make transformers' attention modules run unchanged on their local heads.

Model code reshapes with ``-1`` heads, but reads ``num_key_value_groups`` (repeat_kv), widths
such as GPT-2's ``split_size`` and, in some families, head counts from ``self.config`` (Phi-3).
Each sharded attention module gets those attributes and a private shallow copy of the config with
its local head counts; the model's own config is never changed, so ``save_pretrained`` writes the
original. ALiBi biases (BLOOM, Falcon-RW) arrive built for all heads and are cut to the local ones.
"""

from __future__ import annotations

import copy
import inspect

from torch import nn

from .heads import HeadSplit

HEAD_ATTRIBUTES = {
    "num_heads": "q",
    "n_heads": "q",  # T5 (its cross-attention's zero position bias is built for n_heads)
    "num_attention_heads": "q",
    "num_key_value_heads": "kv",
    "num_kv_heads": "kv",
    "num_key_value_groups": "groups",
}


# attributes holding the width of all query heads (heads x head_dim), used to split or merge heads
WIDTH_ATTRIBUTES = ("split_size", "embed_dim", "all_head_size", "hidden_size", "inner_dim")


def is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def attention_root(path: str, modules: dict[str, nn.Module]) -> str | None:
    """The outermost attention module above ``path``, if any (BERT's output projection sits in
    ``attention.output``, beside the self-attention, not inside it)."""
    parts = path.split(".")
    return next(
        (".".join(parts[:i]) for i in range(1, len(parts)) if is_attention(modules.get(".".join(parts[:i])))), None
    )


def inside_attention(path: str, modules: dict[str, nn.Module]) -> bool:
    return attention_root(path, modules) is not None


def outermost(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules under ``root`` that sit in no other attention module."""
    modules = dict(root.named_modules())
    return [(p, m) for p, m in modules.items() if p and is_attention(m) and not inside_attention(p, modules)]


def check_localizable(module: nn.Module, heads: HeadSplit) -> None:
    """Refuse attention that keeps one module per head: its code would index them by local head number."""
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and len(child) in (heads.num_heads, heads.num_kv_heads):
            raise ValueError(
                f"{type(module).__name__}.{name} holds one module per head ({len(child)}), which the model would "
                "index by local head number; keep this attention replicated (no rule for its projections)"
            )


def localize(module: nn.Module, heads: HeadSplit, rank: int) -> None:
    """Set ``module``'s head counts to the ones this rank holds."""
    q, kv = heads.local_q(rank), heads.local_kv(rank)
    values = {"q": q, "kv": kv, "groups": q // kv}
    for attr in WIDTH_ATTRIBUTES:
        if getattr(module, attr, None) == heads.num_heads * heads.head_dim:
            setattr(module, attr, q * heads.head_dim)
    for attr, which in HEAD_ATTRIBUTES.items():
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, values[which])
    signature = inspect.signature(module.forward)
    if "alibi" in signature.parameters:
        _slice_alibi(module, signature, heads, rank)
    config = getattr(module, "config", None)
    if config is not None:
        local = copy.copy(config)
        for attr, which in (("num_attention_heads", "q"), ("num_key_value_heads", "kv")):
            if hasattr(local, attr):
                setattr(local, attr, values[which])
        module.config = local


def refuse_attention_weights(model: nn.Module) -> None:
    """A model whose attention runs on local heads returns each rank's own heads' attention weights:
    ``output_attentions`` (and what reads them, Whisper's token timestamps by alignment head) is
    refused at the call instead of answered with another set of heads."""

    def check(module, args, kwargs):
        if kwargs.get("output_attentions") or getattr(module.config, "output_attentions", False):
            raise ValueError(
                "output_attentions=True: under tensor parallelism each rank's attention weights are its own heads' "
                "(hf_parallel does not gather them), so they, and what reads them (Whisper's return_token_timestamps), "
                "would be wrong; call without them"
            )

    model.register_forward_pre_hook(check, with_kwargs=True)


def _slice_alibi(module: nn.Module, signature: inspect.Signature, heads: HeadSplit, rank: int) -> None:
    """The model builds ALiBi biases for all heads (BLOOM: ``alibi`` [batch * heads, 1, keys];
    Falcon: folded into a [batch, heads, queries, keys] ``attention_mask``); keep this rank's heads."""
    start, stop = heads.q_ranges[rank]

    def local(tensor):
        if tensor is None or tensor.dim() not in (3, 4):
            return tensor
        if tensor.dim() == 4:
            return tensor[:, start:stop] if tensor.shape[1] == heads.num_heads else tensor
        full = tensor.reshape(-1, heads.num_heads, *tensor.shape[1:])
        return full[:, start:stop].reshape(-1, *tensor.shape[1:])

    def hook(m, args, kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        for name in ("alibi", "attention_mask"):
            if name in bound.arguments:
                bound.arguments[name] = local(bound.arguments[name])
        return bound.args, bound.kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)
