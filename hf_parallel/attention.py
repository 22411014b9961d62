"""Make transformers' attention modules run unchanged on their local heads.

Model code reshapes with ``-1`` heads, but reads ``num_key_value_groups`` (repeat_kv) and, in
some families, head counts from ``self.config`` (Phi-3). Each sharded attention module gets
those attributes and a private shallow copy of the config with its local head counts; the
model's own config is never changed, so ``save_pretrained`` writes the original.

A rank that holds no heads (9 heads / 3 KV groups over 4 ranks) still joins every collective
its peers make: ``idle_forward`` runs the (empty) projections and norms, keeps the KV cache
length right, and contributes zeros to the output all-reduce.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .heads import HeadSplit

HEAD_ATTRIBUTES = {
    "num_heads": "q",
    "num_attention_heads": "q",
    "num_key_value_heads": "kv",
    "num_kv_heads": "kv",
    "num_key_value_groups": "groups",
}


def is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def localize(module: nn.Module, heads: HeadSplit, rank: int, roles: dict[str, str]) -> None:
    """Set local head counts on ``module``; ``roles`` maps child name -> style name."""
    q, kv = heads.local_q(rank), heads.local_kv(rank)
    values = {"q": q, "kv": kv, "groups": q // kv if kv else 0}
    for attr, which in HEAD_ATTRIBUTES.items():
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, values[which])
    config = getattr(module, "config", None)
    if config is not None:
        local = copy.copy(config)
        for attr, which in (("num_attention_heads", "q"), ("num_key_value_heads", "kv")):
            if hasattr(local, attr):
                setattr(local, attr, values[which])
        module.config = local
    if heads.idle(rank):
        module.forward = idle_forward(module, heads, roles)


def idle_forward(module: nn.Module, heads: HeadSplit, roles: dict[str, str]):
    """A forward for a rank with no heads: same collectives as its peers, zero contribution."""
    inputs = [name for name, style in roles.items() if "colwise" in style]
    norms = [name for name, style in roles.items() if style in ("replicated_with_grad_allreduce", "sharded_rmsnorm")]
    outputs = [name for name, style in roles.items() if "rowwise" in style]
    if len(outputs) != 1:
        raise ValueError(f"{type(module).__name__}: an idle rank needs exactly one row-parallel output projection, found {outputs}")

    def forward(*args, **kwargs):
        hidden_states = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        lead = hidden_states.shape[:-1]
        empty = [getattr(module, name)(hidden_states).reshape(*lead, 0) for name in inputs]
        for name in norms:
            norm = getattr(module, name)
            per_head = roles[name] == "replicated_with_grad_allreduce"
            shape = (*lead, 0, norm.weight.shape[-1]) if per_head else (*lead, 0)
            empty.append(norm(hidden_states.new_zeros(shape)).reshape(*lead, 0))
        cache = kwargs.get("past_key_values", kwargs.get("layer_past"))
        if cache is not None and hasattr(cache, "update"):
            batch, seq = hidden_states.shape[0], hidden_states.shape[1]
            nothing = hidden_states.new_zeros(batch, 0, seq, heads.head_dim)
            cache.update(nothing, nothing, module.layer_idx)
        context = torch.cat(empty, dim=-1) if empty else hidden_states.new_zeros(*lead, 0)
        return getattr(module, outputs[0])(context), None

    return forward
