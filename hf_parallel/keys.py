"""Checkpoint key <-> model parameter name, through transformers' own conversion registry.

transformers 5 renames legacy checkpoint keys on load (GPT-NeoX ``embed_out`` -> ``lm_head``) and
back on save; using its registry keeps us in step with it instead of a hand-written table.
Only renamings are applied here: fused-expert converters belong to the MoE loader.
"""

from __future__ import annotations

from torch import nn


def param_names_for_keys(model: nn.Module, keys) -> dict[str, str]:
    """Model parameter/buffer name -> the checkpoint key that holds it (for the keys that map)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in model.named_buffers()}
    meta_state = dict.fromkeys(names, True)  # rename_source_key only asks whether a name exists
    out = {}
    for key in keys:
        name, _ = rename_source_key(key, renamings, [], getattr(model, "base_model_prefix", None), meta_state)
        if name in names:
            out.setdefault(name, key)
    return out
