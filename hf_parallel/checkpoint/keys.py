"""Checkpoint key <-> model parameter name, through transformers' own conversion registry.

transformers 5 renames legacy checkpoint keys on load (GPT-NeoX ``embed_out`` -> ``lm_head``) and
back on save, and builds fused MoE parameters (``experts.gate_up_proj`` [E, 2I, H]) from per-expert
keys (``experts.3.gate_proj.weight``) with ``MergeModulelist`` then ``Concatenate``. Using its
registry keeps us in step with it instead of a hand-written table (its internals are reached through
``compat/transformers.py``). Of the converters, only those two operations are understood (a stack of
experts, then a concatenation of blocks); a parameter behind any other stays unmapped and the loader
reports it missing, with the converter named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..compat.transformers import conversion_transforms, rename_key, stack_then_concat_dim
from ..core.layout import box_shape


@dataclass(frozen=True)
class FusedSource:
    """A fused expert parameter's checkpoint keys: ``keys[block][expert]``; blocks are concatenated
    along ``concat_dim`` of the fused tensor (None: a single block)."""

    keys: tuple[tuple[str, ...], ...]
    concat_dim: int | None

    def boxes(self, fused_shape) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
        """(key, where its tensor sits in the fused one, with a leading expert dim of 1), expert by
        expert. Blocks are equal parts of ``concat_dim`` (gate|up)."""
        out = []
        block = fused_shape[self.concat_dim] // len(self.keys) if self.concat_dim is not None else None
        for expert in range(len(self.keys[0])):
            for b, keys in enumerate(self.keys):
                box = [(expert, expert + 1)] + [(0, n) for n in fused_shape[1:]]
                if block is not None:
                    box[self.concat_dim] = (b * block, (b + 1) * block)
                out.append((keys[expert], tuple(box)))
        return out


def expert_shape(box) -> tuple[int, ...]:
    """The shape of the per-expert checkpoint tensor that sits at ``box`` of the fused one."""
    return box_shape(box[1:])


def _meta_names(model: nn.Module) -> set[str]:
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return names | {name for name, _ in model.named_buffers()}


def checkpoint_sources(model: nn.Module, keys) -> tuple[dict[str, str], dict[str, FusedSource]]:
    """Model parameter/buffer name -> the checkpoint key that holds it, and fused parameter name ->
    its per-expert keys (for the keys that map)."""
    renamings, converters = conversion_transforms(model)
    converters = [c for c in converters if stack_then_concat_dim(c) is not False]
    names = _meta_names(model)
    meta_state = dict.fromkeys(names, True)  # rename_source_key only asks whether a name exists
    prefix = getattr(model, "base_model_prefix", None)
    direct, experts = {}, {}  # experts: name -> {source pattern: {expert index: key}}
    for key in keys:
        name, pattern = rename_key(key, renamings, converters, prefix, meta_state)
        if name not in names:
            continue
        if pattern is None:
            direct.setdefault(name, key)
            continue
        renamed = rename_key(key, renamings, [], prefix, meta_state)[0]
        found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
        if found is not None:
            experts.setdefault(name, {}).setdefault(pattern, {})[int(found.group(1))] = key
    fused = {}
    for name, by_pattern in experts.items():
        converter = next(c for c in converters if set(by_pattern) <= set(c.source_patterns))
        blocks = [by_pattern.get(pattern, {}) for pattern in converter.source_patterns]
        count = max(len(block) for block in blocks)
        if all(sorted(block) == list(range(count)) for block in blocks):
            fused[name] = FusedSource(
                tuple(tuple(b[e] for e in range(count)) for b in blocks), stack_then_concat_dim(converter)
            )
    return direct, fused
