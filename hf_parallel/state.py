"""A loaded model's parallel state: one public object, ``parallel_state(model)``.

Everything that saving, training and ``verify`` need to know about how a model is split lives here
and is passed to them explicitly; no module reads a private attribute of the model to find it.
The state is kept beside the model (a weak mapping: it goes with the model), not on it.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .distributed import comm

if TYPE_CHECKING:
    from .adapters.placement import Adapters
    from .distributed.mesh import Mesh
    from .pipeline.stage import Stage
    from .runtime import Runtime
    from .sequence.shard import SequenceSplit
    from .tensor.gradients import GradientSums
    from .quant.kept import KeptWeight
    from .tensor.parallelize import ModelLayout, ShardedParam
    from .tensor.styles import Hooks


@dataclass
class ParallelState:
    """How a model is split over the mesh, and what it was loaded from."""

    mesh: Mesh  # every process group, and this rank's place in them
    layout: ModelLayout  # every parameter's rule and layout (tensor and expert parallelism)
    source_keys: dict  # parameter (or persistent buffer) name -> checkpoint key (or per-expert keys) it was read from
    runtime: Runtime  # what runs around the model's forward: the sequence split and the pipeline stage
    gradients: GradientSums  # which gradient is summed over which group (TP styles, SP, adapters record here)
    hooks: dict[str, Hooks]  # module path -> the hooks its TP style installed (adapters move them)
    adapters: Adapters  # peft's adapters added since, placed like their modules
    keep_quantized: bool | str = False  # the checkpoint's quantized weights held as stored (the same on every rank)
    kept: dict[str, KeptWeight] = field(default_factory=dict)  # this rank's of them (a stage may hold none)
    quantization_config: object = None  # the checkpoint's, saved back with the kept weights
    compute_dtype: object = None  # mixed precision's (a torch dtype): the parameters are float32 masters
    expert_tokens: dict = field(default_factory=dict)  # experts path -> this rank's tokens per expert since read

    def tokens_per_expert(self, reset: bool = True) -> dict[str, list[int]]:
        """``from_pretrained(ep_size=N, count_expert_tokens=True)``: per experts module, the tokens every rank
        routed to each expert since the last read (each token once: the world's sum of each rank's own), read
        after a step with one collective over the world and one host read; ``reset``: counting starts again."""
        if not self.expert_tokens:
            raise ValueError("tokens_per_expert: load with ep_size=N and count_expert_tokens=True to count them")
        paths = list(self.expert_tokens)
        table = comm.all_reduce(torch.stack([self.expert_tokens[path] for path in paths]), self.mesh.world.group)
        if reset:
            for counts in self.expert_tokens.values():
                counts.zero_()
        return dict(zip(paths, table.cpu().tolist()))

    def entry(self, name: str) -> ShardedParam | None:
        """The layout and full shape of the parameter called ``name`` (as loaded, or an adapter
        added since); None: hf_parallel did not place it."""
        return self.layout.params.get(name) or self.adapters.entries.get(name)

    @property
    def stage(self) -> Stage | None:
        """This rank's pipeline stage, when there are several (the runtime's)."""
        return self.runtime.stage

    @property
    def sequence(self) -> SequenceSplit | None:
        """The sequence-parallel group, when sequences are split (the runtime's)."""
        return self.runtime.sequence

    def __repr__(self) -> str:
        stage = "" if self.stage is None else f", layers {self.stage.layers().start}-{self.stage.layers().stop - 1}"
        return (
            f"ParallelState({self.mesh} of {self.mesh.shape}{stage}; plan from {self.layout.source}, "
            f"{len(self.layout.unique_params())} parameters)"
        )


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(model: nn.Module, state: ParallelState) -> None:
    _STATES[model] = state


def parallel_model(model: nn.Module) -> nn.Module:
    """The model ``hf_parallel.from_pretrained`` loaded: ``model``, or the one a peft wrapper
    (``PeftModel``, ``LoraModel``) holds."""
    try:
        if model in _STATES:
            return model
    except TypeError:
        pass
    peft = sys.modules.get("peft")
    if peft is not None:
        from peft.tuners.tuners_utils import BaseTuner

        if isinstance(model, peft.PeftModel):
            return parallel_model(model.base_model)
        if isinstance(model, BaseTuner):
            return parallel_model(model.model)
    raise ValueError(
        f"{type(model).__name__} was not loaded by hf_parallel.from_pretrained, so it has no parallel state"
    )


def parallel_models() -> list[nn.Module]:
    """Every model ``hf_parallel.from_pretrained`` loaded in this process that is still alive."""
    return list(_STATES.keys())


def is_parallel(model: nn.Module) -> bool:
    """Whether ``model`` (or the model a peft wrapper holds) was loaded by hf_parallel."""
    try:
        parallel_model(model)
    except ValueError:
        return False
    return True


def parallel_state(model: nn.Module) -> ParallelState:
    """The parallel state of a model ``hf_parallel.from_pretrained`` loaded (or of a peft model around it)."""
    return _STATES[parallel_model(model)]
