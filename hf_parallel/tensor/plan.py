"""Where a plan comes from: curated files, transformers' own plans, discovery, or the user.

``tp_plan="auto"`` resolves, in order: a curated file in ``plans/`` (or one registered with
``register_plan``) for the config's ``model_type``, then transformers' ``base_model_tp_plan`` and
the model's public ``tp_plan`` (its class's and its children's, prefixed), then a plan discovered
from the module tree (``discover.py``); ``tp_plan="discover"`` asks for discovery directly. Rule
matching itself is ``rules.py``.
"""

from __future__ import annotations

import json
import os
import tomllib
from importlib import resources

from torch import nn

from .discover import discover_plan
from .rules import Plan, Rule, validate_rule

# model_type -> (rules, source); filled from plans/*.toml on first use, extended by register_plan
_REGISTERED: dict[str, tuple[dict[str, str], str]] = {}
_FILES_LOADED = False
# plans/ file -> its ``optional`` patterns: rules for modules only some variants of the family have
# (T5 v1.0's DenseReluDense.wi, v1.1 / Flan-T5's wi_0 and wi_1), not warned about when unused
_OPTIONAL: dict[str, frozenset[str]] = {}


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
                _OPTIONAL[f"plans/{entry.name}"] = frozenset(data.get("optional", ()))
                for model_type in data["model_types"]:
                    _REGISTERED.setdefault(model_type, (data["rules"], f"plans/{entry.name}"))
    return _REGISTERED


def read_plan_file(path: str) -> dict[str, str]:
    """A user's rules from a file: TOML as in plans/ (a ``[rules]`` table, or the rules at top
    level) or a JSON object, pattern -> style name."""
    with open(path, "rb") as f:
        data = json.load(f) if path.endswith(".json") else tomllib.load(f)
    rules = data.get("rules", data) if isinstance(data, dict) else None
    if not isinstance(rules, dict) or not all(isinstance(v, str) for v in rules.values()):
        raise ValueError(f"{path}: a plan file holds rules as pattern = style name (in TOML, under [rules])")
    return rules


def curated_plan_for(model_type: str):
    return _curated().get(model_type)


def resolve_plan(model: nn.Module, tp_plan, ep_plan=None, exchange_tokens: bool = False) -> Plan:
    """Turn ``tp_plan`` ("auto", "discover", a registered model_type name, a dict, a TOML/JSON file of rules
    as the CLI's ``--tp-plan`` takes, or None: no rules, every parameter replicated) into validated rules. ``ep_plan="auto"``: experts spread
    whole over the ranks (``with_expert_parallel``), their rules taken from the model's plan even
    when ``tp_plan`` is None (which then keeps the rest replicated). ``exchange_tokens`` (``ep_size``): over
    the mesh's EP group, tokens travelling to them (``ep_plan`` None counts as "auto")."""
    if ep_plan == "auto" or (exchange_tokens and ep_plan is None):
        plan = resolve_plan(model, tp_plan or "auto")
        return with_expert_parallel(plan, keep_tensor_parallel=bool(tp_plan), exchange_tokens=exchange_tokens)
    if ep_plan is not None:
        raise ValueError(f"ep_plan must be 'auto' (experts spread over the ranks) or None, got {ep_plan!r}")
    prefix = getattr(model, "base_model_prefix", "") or ""
    model_type = getattr(model.config, "model_type", None)
    curated = curated_plan_for(model_type)
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    # the head's rule alone (a causal-LM class's ``lm_head``, its base model with no plan) splits
    # nothing of the layers: discovery does better
    shipped = {**base, **(getattr(model, "tp_plan", None) or {})} if base else {}
    notes = []
    if tp_plan is None:
        rules, source = {}, "tp_plan=None (every parameter replicated)"
    elif isinstance(tp_plan, dict):
        rules, source = tp_plan, "user tp_plan"
    elif isinstance(tp_plan, (str, os.PathLike)) and os.fspath(tp_plan).endswith((".toml", ".json")):
        rules, source = read_plan_file(os.fspath(tp_plan)), f"plan file {os.fspath(tp_plan)}"
    elif tp_plan == "auto" and curated is not None:
        rules, source = curated
    elif tp_plan == "auto" and shipped:
        rules, source = shipped, f"transformers {type(model.config).__name__}.base_model_tp_plan"
    elif tp_plan in ("auto", "discover"):
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
    rules = [validate_rule(p, s, source) for p, s in rules.items()]
    return Plan(rules, source, prefix, notes=notes, optional=_OPTIONAL.get(source, frozenset()))


def with_expert_parallel(plan: Plan, keep_tensor_parallel: bool, exchange_tokens: bool = False) -> Plan:
    """``ep_plan="auto"``: experts spread whole over the ranks instead of split inside each one.
    Every ``moe_tp_experts`` rule becomes ``moe_ep_experts`` and the parameter rules under it
    ``grouped_gemm``; the other rules stay (attention and dense layers tensor-parallel) or, without
    a tensor-parallel plan, are dropped (replicated). ``exchange_tokens``: ``moe_ep_tokens`` instead, which
    places every parameter of the experts module itself (the parameter rules under it dropped)."""
    experts = [rule.pattern for rule in plan.rules if rule.style_name == "moe_tp_experts"]
    if not experts:
        asked = "ep_size" if exchange_tokens else "ep_plan"
        raise ValueError(f"{asked}: the plan ({plan.source}) has no moe_tp_experts rule, so no experts to spread")
    style = "moe_ep_tokens" if exchange_tokens else "moe_ep_experts"
    rules = []
    for rule in plan.rules:
        if rule.style_name == "moe_tp_experts":
            rules.append(Rule(rule.pattern, style, rule.source + ", expert parallel"))
        elif any(rule.pattern.startswith(pattern + ".") for pattern in experts):
            if not exchange_tokens:
                rules.append(Rule(rule.pattern, "grouped_gemm", rule.source + ", expert parallel"))
        elif keep_tensor_parallel:
            rules.append(rule)
    return Plan(rules, plan.source + " + expert parallel", plan.base_prefix, notes=plan.notes)


def tie_embedding_rules(model: nn.Module, assigned: dict[str, Rule]) -> None:
    """Tied input/output embeddings share one tensor, so they must share one vocab split, and so
    must every other module that holds it (an encoder-decoder's ``shared`` table is also its
    encoder's and decoder's ``embed_tokens``, each a module of its own): once one holder splits the
    vocab, each holder without a rule gets the matching style (lookups ``embedding_rowwise``,
    projections ``colwise_gather_output``). A holder left whole would look ids up in a table of
    this rank's rows only (``IndexError: index out of range``) or project onto them."""
    shared: dict[int, dict[str, nn.Module]] = {}  # every weight several modules hold (tied to the LM head or not:
    for path, module in model.named_modules():  # an encoder-decoder's embed_tokens share ``shared`` either way)
        weight = getattr(module, "weight", None)
        if path and isinstance(weight, nn.Parameter):
            shared.setdefault(id(weight), {})[path] = module
    for holders in shared.values():
        if len(holders) > 1:
            _tie_holders(holders, assigned)


def _tie_holders(holders: dict[str, nn.Module], assigned: dict[str, Rule]) -> None:
    """One tied weight's holders: one vocab split for all of them, or none."""
    vocab_split = {"colwise", "colwise_gather_output", "embedding_rowwise"}
    ruled = {path: assigned[path] for path in holders if path in assigned}
    split = sorted(path for path, rule in ruled.items() if rule.style_name in vocab_split)
    whole = sorted(path for path, rule in ruled.items() if rule.style_name not in vocab_split)
    if split and whole:
        listed = ", ".join(f"{p}: {ruled[p].pattern!r} -> {ruled[p].style_name}" for p in split + whole)
        raise ValueError(
            f"{', '.join(sorted(holders))} share one tied weight but their rules split it differently ({listed})"
        )
    if not split:
        return
    for path, module in holders.items():
        if path in assigned:
            continue
        if isinstance(module, nn.Embedding):
            assigned[path] = Rule(path, "embedding_rowwise", f"tied to {split[0]}")
        elif isinstance(module, nn.Linear):
            assigned[path] = Rule(path, "colwise_gather_output", f"tied to {split[0]}")
        else:
            raise ValueError(
                f"{path} ({type(module).__name__}) holds the tied embedding that {split[0]} splits by vocab rows, and "
                "hf_parallel knows no vocab-parallel style for it; give it a rule or keep the embedding replicated"
            )
