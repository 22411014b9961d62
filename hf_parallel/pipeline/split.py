"""Which pipeline stage owns which module: contiguous runs of layers, balanced by cost.

The repeated layers are the ``nn.ModuleList`` transformers' ``base_model_pp_plan`` names (the
entry whose module is a list), or, for a model without one, the outermost list of identical
layers of the module tree. Every other module that holds parameters goes with the layers it runs
next to: registered before the list (embeddings) to the first stage, after it (final norm, LM
head) to the last. Parameter-free modules (rotary tables) stay on every stage.

A layer's cost is its parameter count (its bytes, and its matmul FLOPs per token); the first
stage also pays for the input embedding and the last for the final norm and LM head (whose
matmul over the vocabulary is as costly as its bytes). ``balanced_layers`` finds the contiguous
split that minimises the costliest stage, exactly (a small dynamic programme).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from ..core.layers import find_layer_list


@dataclass(frozen=True)
class StageSplit:
    """The stages' layers and the modules around them, as module paths of the full model."""

    layer_list: str  # path of the ModuleList of layers
    stage_layers: tuple[int, ...]  # layers per stage, in order
    head: tuple[str, ...]  # modules before the layers: the first stage's
    tail: tuple[str, ...]  # modules after the layers: the last stage's

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def layers_of(self, stage: int) -> range:
        start = sum(self.stage_layers[:stage])
        return range(start, start + self.stage_layers[stage])

    def stage_of_layer(self, index: int) -> int:
        return next(stage for stage in range(self.num_stages) if index in self.layers_of(stage))

    def owned(self, stage: int) -> list[str]:
        """The module paths stage ``stage`` holds (layers by index, then head / tail pieces)."""
        paths = [f"{self.layer_list}.{i}" for i in self.layers_of(stage)]
        if stage == 0:
            paths = list(self.head) + paths
        if stage == self.num_stages - 1:
            paths += list(self.tail)
        return paths

    def stage_of(self, path: str) -> int | None:
        """The stage owning the module or parameter ``path`` (None: every stage, parameter-free)."""
        for stage in range(self.num_stages):
            if any(path == own or path.startswith(own + ".") for own in self.owned(stage)):
                return stage
        return None


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _around(model: nn.Module, layer_list: str) -> tuple[list[str], list[str]]:
    """Parameter-holding modules registered before / after the layer list, walking from the root
    down the list's ancestors (e.g. ``model.embed_tokens`` before, ``model.norm``, ``lm_head`` after)."""
    head, tail = [], []
    parts = layer_list.split(".")
    module, prefix = model, ""
    for depth, part in enumerate(parts):
        seen_list = False
        for name, child in module.named_children():
            if name == part:
                seen_list = True
                continue
            if _params(child) == 0:
                continue
            (tail if seen_list else head).append(prefix + name)
        module, prefix = getattr(module, part), prefix + part + "."
    return head, tail


def balanced_layers(layer_costs: list[float], num_stages: int, first_extra: float, last_extra: float) -> list[int]:
    """Layers per stage, contiguous, minimising the costliest stage (ties: earlier stages lighter)."""
    n = len(layer_costs)
    prefix = [0.0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    def cost(stage: int, start: int, stop: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[stop] - prefix[start] + extra

    # best[s][i]: the smallest max cost of placing layers [i, n) on stages s.. (each at least one layer)
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[num_stages][n] = 0.0
    for stage in range(num_stages - 1, -1, -1):
        left = num_stages - stage  # stages still to fill, this one included
        for start in range(n - left, -1, -1):
            for stop in range(start + 1, n - (left - 1) + 1):
                worst = max(cost(stage, start, stop), best[stage + 1][stop])
                if worst < best[stage][start] - 1e-9 * max(1.0, worst):
                    best[stage][start], choice[stage][start] = worst, stop
    counts, start = [], 0
    for stage in range(num_stages):
        stop = choice[stage][start]
        counts.append(stop - start)
        start = stop
    return counts


def split_stages(model: nn.Module, num_stages: int, stage_layers=None) -> StageSplit:
    """The stage split of a (meta-built) model; every error before any weight is read."""
    layer_list = find_layer_list(model)
    layers = model.get_submodule(layer_list)
    n = len(layers)
    if n < num_stages:
        raise ValueError(
            f"{type(model).__name__} has {n} layer(s) in {layer_list}, fewer than the {num_stages} pipeline stages "
            "asked for: every stage needs at least one layer"
        )
    head, tail = _around(model, layer_list)
    if stage_layers is not None:
        stage_layers = list(stage_layers)
        if len(stage_layers) != num_stages or not all(isinstance(c, int) and c >= 1 for c in stage_layers):
            raise ValueError(
                f"stage_layers={stage_layers}: give one layer count of at least 1 for each of the {num_stages} stages"
            )
        if sum(stage_layers) != n:
            raise ValueError(
                f"stage_layers={stage_layers} adds up to {sum(stage_layers)} layers, but {layer_list} has {n}"
            )
    else:
        first_extra = sum(_params(model.get_submodule(p)) for p in head)
        last_extra = sum(_params(model.get_submodule(p)) for p in tail)
        stage_layers = balanced_layers([_params(layer) for layer in layers], num_stages, first_extra, last_extra)
    return StageSplit(layer_list, tuple(stage_layers), tuple(head), tuple(tail))
