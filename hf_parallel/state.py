"""A loaded model's parallel state: one public object, ``parallel_state(model)``.

Everything that saving, training and ``verify`` need to know about how a model is split lives here
and is passed to them explicitly; no module reads a private attribute of the model to find it.
The state is kept beside the model (a weak mapping: it goes with the model), not on it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .distributed.mesh import Mesh
    from .pipeline.stage import Stage
    from .runtime import Runtime
    from .sequence.shard import SequenceSplit
    from .tensor.parallelize import ShardPlan


@dataclass
class ParallelState:
    """How a model is split over the mesh, and what it was loaded from."""

    mesh: Mesh  # every process group, and this rank's place in them
    plan: ShardPlan  # every parameter's rule and layout (tensor and expert parallelism)
    source_keys: dict  # parameter (or persistent buffer) name -> checkpoint key (or per-expert keys) it was read from
    runtime: Runtime  # what runs around the model's forward: the sequence split and the pipeline stage

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
            f"ParallelState({self.mesh} of {self.mesh.shape}{stage}; plan from {self.plan.source}, "
            f"{len(self.plan.unique_params())} parameters)"
        )


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(model: nn.Module, state: ParallelState) -> None:
    _STATES[model] = state


def parallel_state(model: nn.Module) -> ParallelState:
    """The parallel state of a model ``hf_parallel.from_pretrained`` loaded."""
    try:
        return _STATES[model]
    except (KeyError, TypeError):
        raise ValueError(
            f"{type(model).__name__} was not loaded by hf_parallel.from_pretrained, so it has no parallel state"
        ) from None
