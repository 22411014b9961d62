"""Apply a plan to a model: decide every parameter's layout (the ``ModelLayout``), then install the hooks.

``model_layout`` is pure bookkeeping (works on the meta device, reads no weight), so the dry run
(`hf-parallel plan`) and the loader see exactly the same layouts. ``install`` runs after the
local weights are in place: every style's lifecycle (``styles.py``), then the attention modules
set to their local heads.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace

from torch import nn

from ..distributed.mesh import Mesh
from . import attention
from .geometry import FUSED_QKV_NAMES, OUT_NAMES, QKV_ROLES, ConfigIgnoredWarning, attention_geometry, is_conv1d, named
from .gradients import GradientSums
from .heads import HeadSplit, split_heads
from ..core.layout import Layout, replicated
from .plan import tie_embedding_rules
from .rules import Plan, Rule
from .splits import ShardContext, in_dim, out_dim
from .styles import Hooks, Rowwise


@dataclass
class ShardedParam:
    name: str  # first name of the parameter in model.named_parameters()
    aliases: tuple[str, ...]  # every name the same tensor has (tied weights)
    layout: Layout
    rule: Rule | None
    full_shape: tuple[int, ...]


@dataclass
class ModelLayout:
    plan: Plan
    mesh: Mesh
    heads: HeadSplit | None
    rules: dict[str, Rule]  # module path -> rule
    contexts: dict[str, ShardContext]  # module path -> context its style runs with
    layouts: dict[str, dict[str, Layout]]  # module path -> its parameters' layouts (full shapes)
    params: dict[str, ShardedParam]  # every name (aliases included) -> entry

    @property
    def source(self) -> str:
        """Where the plan's rules came from (a plans/ file, transformers, discovery, the user)."""
        return self.plan.source

    def exchanging_experts(self) -> list[str]:
        """The experts modules whose parameters are written over the mesh's ``ep`` dimension (``ep_size``)."""
        return [path for path, held in self.layouts.items() if any(lay.over == "ep" for lay in held.values())]

    def unique_params(self) -> list[ShardedParam]:
        seen, out = set(), []
        for entry in self.params.values():
            if entry.name not in seen:
                seen.add(entry.name)
                out.append(entry)
        return out


def _kv_group(heads: HeadSplit | None, mesh: Mesh):
    """The subgroup of TP ranks sharing this rank's (replicated) KV head; every rank asks for it."""
    if heads is None:
        return None
    return mesh.subgroup(
        "tp", lambda size: split_heads(heads.num_heads, heads.num_kv_heads, heads.head_dim, size).kv_replica_groups()
    )


def model_head_split(model: nn.Module, attention_paths: set[str], mesh: Mesh) -> HeadSplit:
    """One head split for every split attention, from the heads each computes with (``geometry``);
    what of the config that ignores is said once, on the first rank."""
    found = {}
    for path in sorted(attention_paths):
        geometry, ignored = attention_geometry(model.get_submodule(path), model.config, path)
        found.setdefault(geometry, (path, ignored))
    if len(found) > 1:
        listed = "; ".join(
            f"{path}: {g.num_heads} heads, {g.num_kv_heads} kv, head_dim {g.head_dim}" for g, (path, _) in found.items()
        )
        raise ValueError(
            f"the split attention modules differ in their heads ({listed}); split them with one geometry or keep some replicated"
        )
    ((geometry, (path, ignored)),) = found.items()
    if ignored and mesh.is_main:
        warnings.warn(f"{path} (and each split attention like it): {ignored}", ConfigIgnoredWarning, stacklevel=5)
    split = split_heads(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, mesh.tp.size)
    return replace(split, gated_query=geometry.gated_query)


def model_layout(model: nn.Module, plan: Plan, mesh: Mesh, held_elsewhere: frozenset[str] = frozenset()) -> ModelLayout:
    """Every parameter's rule and layout on this rank of ``mesh``, checked before any weight is read.
    ``held_elsewhere``: the modules another pipeline stage holds (``Plan.assign``)."""
    rules = plan.assign(model, held_elsewhere)
    tie_embedding_rules(model, rules)
    modules = dict(model.named_modules())
    roots = {path: attention.attention_root(path, modules) for path in rules}
    in_attention = {path for path, root in roots.items() if root is not None}
    # heads matter only when attention is split: expert parallelism alone may use more ranks than heads
    heads = model_head_split(model, {roots[p] for p in in_attention}, mesh) if in_attention else None
    kv_group = _kv_group(heads, mesh)
    contexts = {path: ShardContext(mesh, heads if path in in_attention else None, kv_group) for path in rules}

    layouts = {
        path: rule.style.layouts(modules[path], contexts[path], path) for path, rule in rules.items() if path in modules
    }
    for path, module in _attention_on_local_heads(modules, rules, heads, mesh):  # before any weight is read
        attention.check_localizable(module, heads)
        check_heads_add_up(path, module, heads, layouts, rules)
    for path, rule in rules.items():  # parameter rules: one parameter of the module that holds it
        if path not in modules:
            parent, _, attr = path.rpartition(".")
            layouts.setdefault(parent, {})[attr] = rule.style.param_layout(modules[parent], attr, contexts[path], path)
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    params = {}
    for name, param in model.named_parameters():
        names = tuple(aliases[id(param)])
        layout, rule = None, None
        for alias in names:
            path, attr = _owner(alias, rules, layouts)
            own = rules.get(alias) or rules.get(path)
            if own is None:
                continue
            found = layouts.get(path, {}).get(attr)
            if found is None:
                rule = rule or own
                continue
            if layout is not None and found != layout:
                raise ValueError(
                    f"tied parameters {names} get different layouts from rules {rule.pattern!r} and {own.pattern!r}"
                )
            layout, rule = found, own
        layout = layout or replicated(mesh.tp.size)
        _check_split(names[0], tuple(param.shape), layout, rule)
        for alias in names:
            params[alias] = ShardedParam(names[0], names, layout, rule, tuple(param.shape))
    shard = ModelLayout(plan, mesh, heads, rules, contexts, layouts, params)
    warn_unsharded_matrices(model, shard)
    return shard


def _owner(name: str, rules: dict[str, Rule], layouts: dict) -> tuple[str, str]:
    """(module path, attribute) whose rule places parameter ``name``: its own module's, or the nearest
    enclosing module whose style places its descendants (a mixer block). Both is an error: the block
    computes with its own split of every parameter it places, whatever another rule says."""
    path, _, attr = name.rpartition(".")
    parts = name.split(".")
    for cut in range(len(parts) - 2, 0, -1):
        block, rest = ".".join(parts[:cut]), ".".join(parts[cut:])
        if block in rules and rules[block].style.places_descendants and rest in layouts.get(block, {}):
            own = rules.get(name) or rules.get(path)
            if own is not None:
                raise ValueError(
                    f"{name}: rule {own.pattern!r} ({own.style_name}) names a parameter that the block rule "
                    f"{rules[block].pattern!r} ({rules[block].style_name}) places with the rest of {block}; "
                    "drop one of the two"
                )
            return block, rest
    return path, attr


def _check_split(name: str, shape: tuple, layout: Layout, rule) -> None:
    """An impossible split (past the tensor, or leaving a rank with none of it: more ranks than
    experts or vocab rows) is an error naming the parameter and numbers, before any weight is read."""
    if layout.is_replicated:
        return
    by = f"rule {rule.pattern!r} ({rule.style_name})" if rule is not None else "its layout"
    try:
        layout.local_shape(shape, 0)
    except ValueError as error:
        raise ValueError(f"{name} {shape}: {by}: {error}") from None
    empty = [rank for rank in range(len(layout.ranges)) if layout.local_size(rank) == 0]
    if empty:
        raise ValueError(
            f"{name} {shape}: {by} splits dim {layout.dim} (size {shape[layout.dim]}) over {len(layout.ranges)} "
            f"ranks, leaving rank(s) {empty} with none of it; use at most {shape[layout.dim]} ranks "
            "or a plan that keeps it whole"
        )


def install(
    model: nn.Module, shard: ModelLayout, gradients: GradientSums, kept_for_tied_weights: frozenset[str] = frozenset()
) -> dict[str, Hooks]:
    """Wrap forwards with collectives (the gradient sums they need recorded in ``gradients``) and give
    attention modules their local head counts; returns each module's installed hooks.
    ``kept_for_tied_weights``: modules that hold a weight tied to this pipeline stage's but that another
    stage runs: they compute nothing here, so their styles are not installed."""
    modules, hooks = dict(model.named_modules()), {}
    for path, rule in shard.rules.items():
        if path in modules and path not in kept_for_tied_weights:  # parameter rules only set a layout
            context = replace(shard.contexts[path], gradients=gradients)
            hooks[path] = rule.style.install(modules[path], context, shard.layouts.get(path, {}))
    local = [module for _, module in _attention_on_local_heads(modules, shard.rules, shard.heads, shard.mesh)]
    for module in local:
        attention.localize(module, shard.heads, shard.mesh.tp.rank)
    if local and getattr(model, "config", None) is not None:
        attention.refuse_attention_weights(model)
    return hooks


def _attention_on_local_heads(modules: dict[str, nn.Module], rules: dict[str, Rule], heads, mesh: Mesh):
    """Attention modules whose own projections split heads: they must run on this rank's heads."""
    if heads is None or mesh.tp.size == 1:
        return
    for path, module in modules.items():
        if not attention.is_attention(module):
            continue
        children = [f"{path}.{child}" for child, _ in module.named_children()]
        if any(child in rules and rules[child].style.shards_heads for child in children):
            yield path, module


def _sees_local_heads(style, role: str) -> bool:
    """Whether a projection's activations on the attention side are this rank's heads only: q/k/v
    outputs kept split (not gathered), an output projection fed split (not splitting a whole input)."""
    if role == "out":
        return isinstance(style, Rowwise) and not style.split_input
    return style.shards_heads


def check_heads_add_up(path: str, module: nn.Module, heads: HeadSplit, layouts: dict, rules: dict) -> None:
    """An attention module runs on its local heads, so on every rank its q/k/v projections must
    produce, and its output projection take, exactly that rank's heads x head_dim: a projection left
    whole or split along the other dim would be reshaped to the wrong heads without an error."""
    hd, ranks = heads.head_dim, range(heads.world_size)
    want = {
        "q": [heads.local_q(r) * hd * (2 if heads.gated_query else 1) for r in ranks],
        "k": [heads.local_kv(r) * hd for r in ranks],
        "qkv": [(heads.local_q(r) + 2 * heads.local_kv(r)) * hd for r in ranks],
        "out": [heads.local_q(r) * hd for r in ranks],
    }
    want["v"] = want["k"]
    for child, proj in module.named_modules():
        if not (isinstance(proj, nn.Linear) or is_conv1d(proj)):
            continue
        role = QKV_ROLES.get(child.rsplit(".", 1)[-1])
        role = role or ("qkv" if named(child, FUSED_QKV_NAMES) else "out" if named(child, OUT_NAMES) else None)
        if role is None:
            continue
        full = tuple(proj.weight.shape)
        dim = in_dim(proj) if role == "out" else out_dim(proj)
        rule, layout = rules.get(f"{path}.{child}"), layouts.get(f"{path}.{child}", {}).get("weight")
        local = rule is not None and layout is not None and _sees_local_heads(rule.style, role)
        got = [layout.local_shape(full, r)[dim] if local else full[dim] for r in ranks]
        if got != want[role]:
            by = f"rule {rule.pattern!r} ({rule.style_name})" if rule else "no rule (replicated)"
            side = "input" if role == "out" else "output"
            raise ValueError(
                f"{path}.{child} {full}: {by} gives its {side} {got} per rank, but {type(module).__name__} runs on "
                f"{[heads.local_q(r) for r in ranks]} query / {[heads.local_kv(r) for r in ranks]} key-value heads of "
                f"{hd} per rank, which need {want[role]}; q/k/v must be split by heads (colwise) and the output "
                "projection by heads on its input (rowwise)"
            )


class UnshardedWarning(UserWarning):
    """The plan keeps a matrix whole on every rank that looks like it should be split."""


def warn_unsharded_matrices(model: nn.Module, shard: ModelLayout) -> None:
    """Warn, with sizes, about replicated matrices at least twice as large as the smallest matrix
    the plan does split: usually a rule that is missing or misspelt, costing that memory on every
    rank. Position / token-type embeddings (not the vocabulary) and convolutional stems (Whisper's
    conv1 / conv2) are replicated by design."""
    if shard.mesh.tp.size == 1:
        return
    vocab = model.get_input_embeddings()
    by_design = {
        f"{path}.weight"
        for path, m in model.named_modules()
        if (isinstance(m, nn.Embedding) and getattr(m, "weight", None) is not getattr(vocab, "weight", 0))
        or isinstance(m, nn.modules.conv._ConvNd)
    }
    entries = [e for e in shard.unique_params() if len(e.full_shape) >= 2]
    split = [math.prod(e.full_shape) for e in entries if not e.layout.is_replicated]
    if not split:  # a plan that splits nothing asked for replication (tp_plan=None)
        return
    floor = 2 * min(split)
    whole = [
        e
        for e in entries
        if e.layout.is_replicated and math.prod(e.full_shape) >= floor and not by_design & set(e.aliases)
    ]
    if not whole:
        return
    itemsize = {name: p.element_size() for name, p in model.named_parameters()}
    sizes = {e.name: math.prod(e.full_shape) * itemsize[e.name] for e in whole}
    listed = ", ".join(f"{e.name} {'x'.join(map(str, e.full_shape))} ({sizes[e.name] / 2**20:.2f} MiB)" for e in whole)
    warnings.warn(
        f"the plan ({shard.plan.source}) leaves {len(whole)} matrix(es) unsharded, each held whole on all "
        f"{shard.mesh.tp.size} ranks ({sum(sizes.values()) / 2**20:.2f} MiB per rank): {listed}. "
        "Add a rule for them if they should be split",
        UnshardedWarning,
        stacklevel=4,
    )
