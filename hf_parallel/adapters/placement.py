"""Where each low-rank adapter (peft's LoRA) of a parallel model lives, and the sums its gradients need.

peft wraps a target module ``m`` in a layer computing ``m(x) + B A x``. On a parallel model ``m`` is
a shard with collectives at its edges (``Hooks.edges``); the wrapper takes those edges, so the
adapter's product joins the same collectives, and ``m`` keeps its local compute (``Hooks.compute``):

- colwise ``m`` (output split): ``copy_to(x)`` enters the wrapper; B's rows split as ``m``'s output
  (packed q|k|v, uneven and replicated KV heads alike), A whole, its gradient summed over TP;
- rowwise ``m`` (input split): A's columns split as ``m``'s input, B whole; ``B A_r x_r`` joins
  ``x_r W_r`` before the one all-reduce, and B's gradient is summed over TP;
- a whole ``m`` (replicated; a vocab-parallel embedding, whose adapter looks up every id): both whole.

peft builds every adapter whole. It is cut to this rank's slice when first used (a forward,
``train_step``, the Trainer, a save): what was initialised or loaded whole is what is cut, and an
optimizer built before keeps its parameters (their data is replaced, not the parameters). Then the
whole matrices are made equal on the TP, sequence and data-parallel ranks (from each group's
first), and every adapter parameter gets the gradient sums its place needs: TP as above, SP (each
rank saw its tokens), the data-parallel replicas averaged as FSDP averages its own parameters.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.faults import collective
from ..core.layout import Layout, replicated
from ..tensor.parallelize import ShardedParam
from ..tensor.styles import AdapterSplit, Hooks, apply_hooks

# peft's containers of LoRA matrices and the side of the base module each one faces
SIDES = {"lora_A": "in", "lora_embedding_A": "in", "lora_B": "out", "lora_embedding_B": "out"}
WHOLE = AdapterSplit(None, sum_whole=False)  # a module with no rule: replicated, fed whole inputs


@dataclass
class AdapterSite:
    """A module of the loaded model that peft wrapped: its place in the plan and its adapters'."""

    path: str  # the module's path, which the wrapper now holds
    base: nn.Module  # the module as loaded (the wrapper's ``base_layer``)
    rule: object | None  # its plan rule (None: replicated, no rule)
    split: AdapterSplit
    layout: Layout | None  # the base weight's TP layout, which the split side follows
    extent: int | None  # the base weight's full size along that split
    kv_group: object | None  # ranks replicating this rank's KV head (their B rows are summed)
    hooks: Hooks  # what the base's style installed
    placed: dict[str, list[str]] = field(default_factory=dict)  # adapter -> its parameters' names, once placed


class Adapters:
    """The adapters of one parallel model: their sites, and an entry (layout, full shape) for each
    placed adapter parameter, by its name in the model."""

    def __init__(self):
        self.sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # wrapper -> AdapterSite
        self.entries: dict[str, ShardedParam] = {}

    def pending(self, model: nn.Module) -> list[nn.Module]:
        """The wrappers with adapters not yet placed, in module order (the same on every rank of a stage)."""
        return [m for m in model.modules() if m in self.sites and len(self.sites[m].placed) < len(adapter_names(m))]


def adapter_names(wrapper: nn.Module) -> list[str]:
    return [*wrapper.lora_A.keys(), *wrapper.lora_embedding_A.keys()]


def adapter_params(wrapper: nn.Module, adapter: str) -> list[tuple[str, nn.Parameter, str]]:
    """(name under the wrapper, parameter, side of the base it faces) of one adapter's matrices."""
    out = []
    for container in wrapper.adapter_layer_names:
        held = getattr(wrapper, container, None)
        if held is None or adapter not in held:
            continue
        if container not in SIDES:
            raise ValueError(
                f"adapter {adapter!r} has {container} (a LoRA variant such as DoRA), which hf_parallel cannot split"
            )
        item = held[adapter]
        if isinstance(item, nn.Parameter):
            out.append((f"{container}.{adapter}", item, SIDES[container]))
        else:
            out.extend((f"{container}.{adapter}.{attr}", p, SIDES[container]) for attr, p in item.named_parameters())
    return out


def site_for(layout, path: str, base: nn.Module, hooks: dict | None = None) -> AdapterSite:
    """How adapters on the module at ``path`` split, from its rule in ``layout`` (the model's ``ModelLayout``);
    refused by name where they cannot."""
    rule = layout.rules.get(path)
    placed = layout.params.get(f"{path}.weight")
    if rule is None and placed is not None and not placed.layout.is_replicated:
        raise ValueError(
            f"{path}: its weight is split by the block rule {placed.rule.pattern!r} ({placed.rule.style_name}) "
            "together with the rest of that block, which a LoRA adapter cannot follow; leave it out of target_modules"
        )
    split = WHOLE if rule is None else rule.style.adapters
    if split is None:
        raise ValueError(
            f"{path}: its rule {rule.pattern!r} ({rule.style_name}) has no adapter split, so a LoRA adapter on it "
            "cannot follow its shards; leave it out of target_modules (adapters on linear, packed and embedding "
            "layers follow their split)"
        )
    weight = layout.layouts.get(path, {}).get("weight") if split.side is not None else None
    extent = layout.params[f"{path}.weight"].full_shape[weight.dim] if weight is not None else None
    kv_group = layout.contexts[path].kv_group if rule is not None else None
    return AdapterSite(path, base, rule, split, weight, extent, kv_group, (hooks or {}).get(path, Hooks()))


def variant_refused(path: str, adapter: str, variant: str, style: str) -> ValueError:
    return ValueError(
        f"{path}: adapter {adapter!r} uses a LoRA variant ({variant}; DoRA and the like), which hf_parallel cannot "
        f"split like its {style} shards; use plain LoRA on it or leave it out of target_modules"
    )


def adapter_layout(site: AdapterSite, side: str, ndim: int, world_size: int) -> Layout:
    """The layout of one adapter matrix: the base's ranges on its split side (A's columns, B's rows),
    whole otherwise. peft sizes most adapters whole; one it sized from a local weight (GPT-2's
    Conv1D) already has the local extent, and is kept as it is."""
    if side != site.split.side or site.layout is None:
        return replicated(world_size)
    return Layout(1 if side == "in" and ndim == 2 else 0, site.layout.ranges, site.layout.kind)


def place(state, wrappers: list[nn.Module]) -> None:
    """Cut the unplaced adapters of ``wrappers`` to this rank's slices, make their whole copies
    equal over the groups that share them, and register their gradient sums (every rank of a
    stage calls it on the same wrappers: it broadcasts)."""
    mesh = state.mesh
    whole, every = [], []
    for wrapper in wrappers:
        site = state.adapters.sites[wrapper]
        for adapter in adapter_names(wrapper):
            if adapter in site.placed:
                continue
            variant = getattr(wrapper, "lora_variant", {}).get(adapter)
            if site.split.side is not None and (variant is not None or getattr(wrapper, "lora_bias", {}).get(adapter)):
                used = type(variant).__name__ if variant is not None else "lora_bias"
                raise variant_refused(site.path, adapter, used, site.rule.style_name)
            site.placed[adapter] = []
            for sub, param, side in adapter_params(wrapper, adapter):
                entry = place_matrix(state, site, f"{site.path}.{sub}", param, side)
                state.adapters.entries[entry.name] = entry
                site.placed[adapter].append(entry.name)
                every.append(param)
                if entry.layout.is_replicated:
                    whole.append(param)
    with torch.no_grad():
        for tensors, dim in ((whole, mesh.tp), (every, mesh.sp), (every, mesh.dp)):
            broadcast_from_first(tensors, dim)


def place_matrix(state, site: AdapterSite, name: str, param: nn.Parameter, side: str) -> ShardedParam:
    """One adapter matrix cut to this rank's slice (when its side is split) and its gradient sums:
    TP as its place needs, SP, the data-parallel replicas' average."""
    mesh, gradients = state.mesh, state.gradients
    layout = adapter_layout(site, side, param.dim(), mesh.tp.size)
    full_shape = list(param.shape)
    if layout.is_replicated:
        if site.split.sum_whole:
            gradients.sum_over(param, mesh.tp.group)
    else:
        local = layout.local_size(mesh.tp.rank)
        if param.shape[layout.dim] == site.extent:
            param.data = layout.extract(param.data, mesh.tp.rank).contiguous()
        elif param.shape[layout.dim] != local:
            raise ValueError(
                f"{name} {tuple(param.shape)}: dim {layout.dim} is neither its module's {site.extent} "
                f"nor this rank's {local}"
            )
        full_shape[layout.dim] = site.extent
        gradients.sum_pieces(param, layout, mesh.tp.rank, site.kv_group)
    gradients.sum_over(param, mesh.sp.group)
    gradients.average_over(param, mesh.dp.group)
    return ShardedParam(name, (name,), layout, site.rule, tuple(full_shape))


def broadcast_from_first(tensors: list[torch.Tensor], dim) -> None:
    """Every tensor as the first rank of ``dim``'s group holds it (one message per dtype)."""
    if dim.group is None or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype, group in by_dtype.items():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        with collective(f"making adapters equal over {dim.name} (rank {dim.ranks[dim.rank]})"):
            dist.broadcast(flat, group_src=0, group=dim.group)
        offset = 0
        for tensor in group:
            tensor.data.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def cut_loaded(state, wrapper: nn.Module):
    """A ``load_state_dict`` pre-hook for ``wrapper``: a whole adapter matrix loaded into one that
    holds this rank's slice (placed, or sized locally by peft) is cut to that slice first
    (``PeftModel.from_pretrained`` / ``load_adapter`` of a saved adapter)."""
    rank, size = state.mesh.tp.rank, state.mesh.tp.size

    def hook(module, state_dict, prefix, *rest):
        site = state.adapters.sites.get(module)
        if site is None or site.split.side is None:
            return
        for adapter in adapter_names(module):
            for sub, param, side in adapter_params(module, adapter):
                layout, value = adapter_layout(site, side, param.dim(), size), state_dict.get(prefix + sub)
                if layout.is_replicated or value is None or value.dim() <= layout.dim:
                    continue
                if value.shape[layout.dim] == site.extent and param.shape[layout.dim] == layout.local_size(rank):
                    state_dict[prefix + sub] = layout.extract(value, rank).contiguous()

    return hook


def wrap(state, site: AdapterSite, wrapper: nn.Module) -> None:
    """peft put ``wrapper`` where ``site.base`` was: the base's edges move to the wrapper, its compute stays."""
    base = site.base
    state.adapters.sites[wrapper] = site
    apply_hooks(base, site.hooks.compute)
    edges = site.hooks.edges

    def pre(args, kwargs):
        if len(site.placed) < len(adapter_names(wrapper)):
            place(state, [wrapper])
        return edges.pre(args, kwargs) if edges.pre is not None else (args, kwargs)

    apply_hooks(wrapper, Hooks(pre, None, edges.post))
    wrapper.register_load_state_dict_pre_hook(cut_loaded(state, wrapper))


def unwrap(state, path: str, base: nn.Module) -> None:
    """peft put ``base`` back (``unload``, ``merge_and_unload``): its hooks go back on it, its
    adapters' entries go."""
    for wrapper, site in list(state.adapters.sites.items()):
        if site.base is base:
            for names in site.placed.values():
                for name in names:
                    state.adapters.entries.pop(name, None)
            del state.adapters.sites[wrapper]
    apply_hooks(base, state.hooks.get(path, Hooks()))
