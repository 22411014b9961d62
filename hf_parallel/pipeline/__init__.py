"""Pipeline parallelism: stage split, point-to-point links, schedules, the pipelined forward."""

from __future__ import annotations

import functools

from torch import nn

from ..checkpoint.keys import FusedSource, checkpoint_sources
from .forward import pipelined_forward
from .p2p import StageLink
from .schedule import SCHEDULES, train_step
from .split import StageSplit, split_stages
from .stage import StageRuntime, install_links, keep_stage

__all__ = [
    "SCHEDULES",
    "StageSplit",
    "split_stages",
    "train_step",
    "keys_held_elsewhere",
    "keep_stage",
    "link_stage",
    "tied_across_stages",
]


def keys_held_elsewhere(model: nn.Module, split: StageSplit, stage: int, files) -> set[str]:
    """The checkpoint keys of the modules other stages hold (of the full model, before
    ``keep_stage``): this stage neither reads them nor calls them unexpected."""
    direct, fused = checkpoint_sources(model, files)
    mine = split.owned(stage)

    def elsewhere(name: str) -> bool:
        owner = split.stage_of(name)
        return owner is not None and owner != stage and not any(name.startswith(p + ".") for p in mine)

    keys = {key for name, key in direct.items() if elsewhere(name)}
    for name, source in fused.items():
        if elsewhere(name) and isinstance(source, FusedSource):
            keys.update(key for block in source.keys for key in block)
    return keys


def tied_across_stages(model: nn.Module, shard) -> list[str]:
    """Parameters this stage holds only because they are tied to another stage's (first/last)."""
    names = []
    for path, module in model.named_modules():
        if getattr(module, "stand_in", False):
            names += [shard.params[f"{path}.{n}"].name for n, _ in module.named_parameters(recurse=False)]
    return sorted(set(names))


def link_stage(model: nn.Module, split: StageSplit, mesh, micro_batches: int | None = None) -> StageRuntime:
    """Install the stage's receive/send hooks and the pipelined ``model.forward`` (the model's own
    is kept in the runtime, for the schedules)."""
    runtime = StageRuntime(split, StageLink(mesh), model.forward, micro_batches)
    install_links(model, runtime)
    model.forward = functools.wraps(runtime.forward)(pipelined_forward(runtime))
    return runtime
