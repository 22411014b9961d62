"""Plans: wildcard rules mapping module paths to parallel styles, and where they come from.

A rule ``layers.*.self_attn.q_proj`` matches a module path of the loaded model either in full
(``model.layers.0.self_attn.q_proj``) or relative to the base model (after ``model.``), as
transformers' ``base_model_tp_plan`` is written. ``*`` matches exactly one path component. When
several rules match a module the most specific wins (fewest wildcards, then most literal
components), whatever the order of the dict; a tie between different styles is an error.

``tp_plan="auto"`` resolves, in order: a curated file in ``plans/`` (or one registered with
``register_plan``) for the config's ``model_type``, then transformers' ``base_model_tp_plan`` and
the model class's ``_tp_plan``, then a plan discovered from the module tree (``discover.py``);
``tp_plan="discover"`` asks for discovery directly.
"""

from __future__ import annotations

import re
import tomllib
import warnings
from dataclasses import dataclass, field
from importlib import resources

from torch import nn

from .styles import ParallelStyle, get_style

_COMPONENT = re.compile(r"^(\*|[A-Za-z0-9_]+)$")


@dataclass(frozen=True)
class Rule:
    pattern: str
    style_name: str
    source: str

    @property
    def style(self) -> ParallelStyle:
        return get_style(self.style_name, self.pattern)

    @property
    def specificity(self) -> tuple[int, int]:
        parts = self.pattern.split(".")
        return (-parts.count("*"), len(parts))

    def matches(self, candidates) -> bool:
        regex = compile_pattern(self.pattern)
        return any(regex.fullmatch(path) for path in candidates)


def compile_pattern(pattern: str) -> re.Pattern:
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


def validate_rule(pattern: str, style_name: str, source: str) -> Rule:
    if not isinstance(pattern, str) or not all(_COMPONENT.match(part) for part in pattern.split(".")):
        raise ValueError(
            f"malformed plan rule {pattern!r} (from {source}): use dot-separated module names, "
            "with '*' standing for exactly one whole component, e.g. 'layers.*.self_attn.q_proj'"
        )
    if not isinstance(style_name, str):
        raise ValueError(f"plan rule {pattern!r} (from {source}): the style must be a name, got {style_name!r}")
    get_style(style_name, pattern)  # unknown style: error now, before any weight is read
    return Rule(pattern, style_name, source)


@dataclass
class Plan:
    rules: list[Rule]
    source: str
    base_prefix: str = ""
    used: set = field(default_factory=set)
    notes: list[str] = field(default_factory=list)  # modules deliberately left replicated, and why

    def rule_for(self, path: str) -> Rule | None:
        candidates = [path]
        if self.base_prefix and path.startswith(self.base_prefix + "."):
            candidates.append(path[len(self.base_prefix) + 1 :])
        hits = [rule for rule in self.rules if rule.matches(candidates)]
        if not hits:
            return None
        best = max(rule.specificity for rule in hits)
        top = {rule.style_name: rule for rule in hits if rule.specificity == best}
        if len(top) > 1:
            names = ", ".join(f"{r.pattern!r} -> {r.style_name}" for r in top.values())
            raise ValueError(f"module {path!r} is matched equally well by conflicting plan rules: {names}")
        rule = next(iter(top.values()))
        self.used.update(hit.pattern for hit in hits if hit.style_name == rule.style_name)  # agreeing spellings
        return rule

    def assign(self, model: nn.Module) -> dict[str, Rule]:
        """Module (or parameter) path -> rule for everything a rule matches; warns about rules that
        match nothing. Parameter rules (``experts.gate_up_proj``) split one 3-D parameter of a module."""
        assigned = {}
        for path, module in model.named_modules():
            rule = self.rule_for(path) if path else None
            if rule is not None:
                assigned[path] = rule
            for name, _ in module.named_parameters(recurse=False):  # a rule may name one parameter
                rule = self.rule_for(f"{path}.{name}" if path else name)
                if rule is not None:
                    assigned[f"{path}.{name}" if path else name] = rule
        for rule in self.rules:
            if rule.pattern not in self.used:
                warnings.warn(
                    f"plan rule {rule.pattern!r} ({rule.style_name}, from {rule.source}) matches no module of {type(model).__name__}",
                    stacklevel=3,
                )
        return assigned


# model_type -> (rules, source); filled from plans/*.toml on first use, extended by register_plan
_REGISTERED: dict[str, tuple[dict[str, str], str]] = {}
_FILES_LOADED = False


def register_plan(model_type: str, rules: dict[str, str], *, source: str = "register_plan") -> None:
    """Use ``rules`` for ``tp_plan="auto"`` on every model whose config has this model_type."""
    for pattern, style_name in rules.items():
        validate_rule(pattern, style_name, source)
    _curated()  # files first, so a user registration overrides a shipped file
    _REGISTERED[model_type] = (dict(rules), source)


def _plan_files():
    """plans/ as installed inside the wheel, or beside the package in a source checkout."""
    try:
        return resources.files("hf_parallel.plans")
    except ModuleNotFoundError:
        return resources.files("hf_parallel").joinpath("..", "plans")


def _curated() -> dict[str, tuple[dict[str, str], str]]:
    global _FILES_LOADED
    if not _FILES_LOADED:
        _FILES_LOADED = True
        for entry in sorted(_plan_files().iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".toml"):
                data = tomllib.loads(entry.read_text())
                for model_type in data["model_types"]:
                    _REGISTERED.setdefault(model_type, (data["rules"], f"plans/{entry.name}"))
    return _REGISTERED


def curated_plan_for(model_type: str):
    return _curated().get(model_type)


def resolve_plan(model: nn.Module, tp_plan) -> Plan:
    """Turn ``tp_plan`` ("auto", "discover", a registered model_type name, a dict, or None: no
    rules, every parameter replicated) into validated rules."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    model_type = getattr(model.config, "model_type", None)
    curated = curated_plan_for(model_type)
    shipped = {**(getattr(model.config, "base_model_tp_plan", None) or {}), **(getattr(model, "_tp_plan", None) or {})}
    notes = []
    if tp_plan is None:
        rules, source = {}, "tp_plan=None (every parameter replicated)"
    elif isinstance(tp_plan, dict):
        rules, source = tp_plan, "user tp_plan"
    elif tp_plan == "auto" and curated is not None:
        rules, source = curated
    elif tp_plan == "auto" and shipped:
        rules, source = shipped, f"transformers {type(model.config).__name__}.base_model_tp_plan"
    elif tp_plan in ("auto", "discover"):
        from .discover import discover_plan

        found = discover_plan(model)
        rules, notes, source = found.rules, found.notes, f"discovered from the {type(model).__name__} module tree"
        if not rules:
            raise ValueError(
                f"no tensor-parallel plan for model_type {model_type!r}: plans/ has no file for it, transformers ships "
                f"none, and discovery found nothing to split ({'; '.join(notes) or 'no repeated layers'}); pass "
                "tp_plan={...} or register one with hf_parallel.register_plan"
            )
    elif isinstance(tp_plan, str) and curated_plan_for(tp_plan) is not None:
        rules, source = curated_plan_for(tp_plan)
    else:
        raise ValueError(
            f"tp_plan must be 'auto', 'discover', a registered model_type or a dict of rules, got {tp_plan!r}"
        )
    return Plan([validate_rule(p, s, source) for p, s in rules.items()], source, prefix, notes=notes)


def with_expert_parallel(plan: Plan, keep_tensor_parallel: bool) -> Plan:
    """``ep_plan="auto"``: experts spread whole over the ranks instead of split inside each one.
    Every ``moe_tp_experts`` rule becomes ``moe_ep_experts`` and the parameter rules under it
    ``grouped_gemm``; the other rules stay (attention and dense layers tensor-parallel) or, without
    a tensor-parallel plan, are dropped (replicated)."""
    experts = [rule.pattern for rule in plan.rules if rule.style_name == "moe_tp_experts"]
    if not experts:
        raise ValueError(f"ep_plan: the plan ({plan.source}) has no moe_tp_experts rule, so no experts to spread")
    rules = []
    for rule in plan.rules:
        if rule.style_name == "moe_tp_experts":
            rules.append(Rule(rule.pattern, "moe_ep_experts", rule.source + ", expert parallel"))
        elif any(rule.pattern.startswith(pattern + ".") for pattern in experts):
            rules.append(Rule(rule.pattern, "grouped_gemm", rule.source + ", expert parallel"))
        elif keep_tensor_parallel:
            rules.append(rule)
    return Plan(rules, plan.source + " + expert parallel", plan.base_prefix, notes=plan.notes)


def tie_embedding_rules(model: nn.Module, assigned: dict[str, Rule]) -> None:
    """Tied input/output embeddings share one tensor, so they must share one vocab split:
    give the unplanned side the matching style (embedding_rowwise / colwise_gather_output)."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None or inp.weight is not out.weight:
        return
    names = {module: path for path, module in model.named_modules()}
    inp_path, out_path = names[inp], names[out]
    inp_rule, out_rule = assigned.get(inp_path), assigned.get(out_path)
    vocab_split = {"colwise", "colwise_gather_output", "embedding_rowwise"}
    if out_rule and out_rule.style_name in vocab_split and not inp_rule:
        assigned[inp_path] = Rule(inp_path, "embedding_rowwise", f"tied to {out_path}")
    elif inp_rule and inp_rule.style_name == "embedding_rowwise" and not out_rule:
        assigned[out_path] = Rule(out_path, "colwise_gather_output", f"tied to {inp_path}")
    elif inp_rule and out_rule and (inp_rule.style_name in vocab_split) != (out_rule.style_name in vocab_split):
        raise ValueError(
            f"{inp_path} and {out_path} share one tied weight but their rules split it differently: "
            f"{inp_rule.pattern!r} -> {inp_rule.style_name}, {out_rule.pattern!r} -> {out_rule.style_name}"
        )
