"""Plan rules: wildcard patterns over module paths, each naming a parallel style.

A rule ``layers.*.self_attn.q_proj`` matches a module path of the loaded model either in full
(``model.layers.0.self_attn.q_proj``) or relative to the base model (after ``model.``), as
transformers' ``base_model_tp_plan`` is written. ``*`` matches exactly one path component. When
several rules match a module the most specific wins (fewest wildcards, then most literal
components), whatever the order of the dict; a tie between different styles is an error.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

from torch import nn

from .registry import get_style
from .styles import ParallelStyle

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
    optional: frozenset = frozenset()  # patterns only some variants of the family have: unused is no warning

    def _candidates(self, path: str) -> list[str]:
        """``path`` as rules may spell it: in full, and relative to the base model."""
        if self.base_prefix and path.startswith(self.base_prefix + "."):
            return [path, path[len(self.base_prefix) + 1 :]]
        return [path]

    def rule_for(self, path: str) -> Rule | None:
        hits = [rule for rule in self.rules if rule.matches(self._candidates(path))]
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

    def _could_match_below(self, rule: Rule, path: str) -> bool:
        """Whether ``rule`` may match a module under ``path`` (held by another pipeline stage, whose
        children this one never sees: a hybrid's layer kinds differ from stage to stage)."""
        parts = rule.pattern.split(".")
        for candidate in self._candidates(path):
            depth = candidate.count(".") + 1
            if len(parts) > depth and compile_pattern(".".join(parts[:depth])).fullmatch(candidate):
                return True
        return False

    def assign(self, model: nn.Module, held_elsewhere: frozenset[str] = frozenset()) -> dict[str, Rule]:
        """Module (or parameter) path -> rule for everything a rule matches; warns about rules that
        match nothing. Parameter rules (``experts.gate_up_proj``) split one 3-D parameter of a module.
        ``held_elsewhere``: modules another pipeline stage holds (stand-ins here, with no children):
        their rules, and the rules that could match below them, count as used, and assign nothing."""
        assigned = {}
        for path, module in model.named_modules():
            rule = self.rule_for(path) if path else None
            if path in held_elsewhere:
                self.used.update(rule.pattern for rule in self.rules if self._could_match_below(rule, path))
                continue
            if rule is not None:
                assigned[path] = rule
            for name, _ in module.named_parameters(recurse=False):  # a rule may name one parameter
                rule = self.rule_for(f"{path}.{name}" if path else name)
                if rule is not None:
                    assigned[f"{path}.{name}" if path else name] = rule
        for rule in self.rules:
            if rule.pattern not in self.used and rule.pattern not in self.optional:
                warnings.warn(
                    f"plan rule {rule.pattern!r} ({rule.style_name}, from {rule.source}) matches no module of {type(model).__name__}",
                    stacklevel=3,
                )
        return assigned
