"""Make transformers' attention modules run unchanged on their local heads.

Model code reshapes with ``-1`` heads, but reads ``num_key_value_groups`` (repeat_kv) and, in
some families, head counts from ``self.config`` (Phi-3). Each sharded attention module gets
those attributes and a private shallow copy of the config with its local head counts; the
model's own config is never changed, so ``save_pretrained`` writes the original.
"""

from __future__ import annotations

import copy

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


def localize(module: nn.Module, heads: HeadSplit, rank: int) -> None:
    """Set ``module``'s head counts to the ones this rank holds."""
    q, kv = heads.local_q(rank), heads.local_kv(rank)
    values = {"q": q, "kv": kv, "groups": q // kv}
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
