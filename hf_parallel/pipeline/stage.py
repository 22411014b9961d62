"""One pipeline stage of a transformers model: the modules it holds, and the hooks that link it.

The model stays the transformers model and runs its own forward on every rank: masks, positions,
rotary tables and the KV cache are computed by the same code as in one process, from the same
inputs (every rank gets the batch). Only the stage's own modules compute:

- a layer another stage holds is a ``MissingLayer``: it passes the hidden states through and
  writes a one-element-wide marker into its KV-cache slot, so the cache reports the right length
  to transformers' mask sizing, which reads layer 0's (the trap of a later stage holding no layer 0);
- modules before the layers (embeddings) on a later stage, and after them (norm, LM head) on an
  earlier one, are ``StandIn`` modules that return zeros of the right shape (an expanded scalar:
  no memory); a module holding a weight tied to one the stage keeps (the input embedding on the
  last stage) stays, with only its forward replaced;
- the first layer of a stage replaces its input with the hidden states received from the stage
  before (``p2p``); the last layer of a stage that is not the last sends its output on, and the
  forward ends on entering the next layer (``StageDone``): the rest of the model is another stage's.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from .p2p import StageLink
from .split import StageSplit


class StageDone(Exception):
    """Raised on entering the first layer after a stage's own: the remaining modules are elsewhere."""


class MissingLayer(nn.Module):
    """A layer held by another stage (vLLM's ``PPMissingLayer``)."""

    held_elsewhere = True

    def __init__(self, layer_idx: int, stage: int):
        super().__init__()
        self.layer_idx, self.stage = layer_idx, stage
        self.runtime = None  # the stage's StageRuntime: the (rows, tokens) of the micro-batch running

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        """Only layers before the stage's first own layer run (a stage ends at its last), and the
        first own layer replaces their output with the received hidden states: what they return is
        never used, whatever the model's loop does with it (some index a tuple)."""
        if past_key_values is not None:  # the tokens' length in this layer's slot, at one element each
            rows, tokens = self.runtime.shape if self.runtime is not None else hidden_states.shape[:2]
            marker = torch.zeros(rows, 1, tokens, 1, device=hidden_states.device)
            getattr(past_key_values, "self_attention_cache", past_key_values).update(marker, marker, self.layer_idx)
        return hidden_states

    def extra_repr(self) -> str:
        return f"layer {self.layer_idx}, held by stage {self.stage}"


def _stand_in_forward(self, *args, **kwargs):
    first = args[0] if args else next(iter(kwargs.values()))
    width = getattr(self, "embedding_dim", None)
    if width is None:  # anything but an embedding: its input as is
        return first
    return torch.zeros((), dtype=self.dtype, device=first.device).expand(*first.shape, width)


class StandIn(nn.Module):
    """A module before or after the layers that another stage holds; zeros of its output's shape."""

    held_elsewhere = True
    forward = _stand_in_forward

    def __init__(self, original: nn.Module, stage: int):
        super().__init__()
        self.stage = stage
        self.embedding_dim = getattr(original, "embedding_dim", None)
        weight = getattr(original, "weight", None)
        self.dtype = weight.dtype if weight is not None else torch.float32

    def extra_repr(self) -> str:
        return f"held by stage {self.stage}"


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def keep_stage(model: nn.Module, split: StageSplit, stage: int) -> None:
    """Replace every module another stage holds (on the meta device: nothing to free)."""
    layers = model.get_submodule(split.layer_list)
    own = split.layers_of(stage)
    for index in range(len(layers)):
        if index not in own:
            layers[index] = MissingLayer(index, split.stage_of_layer(index))
    others = [(p, 0) for p in split.head if stage != 0] + [(p, split.num_stages - 1) for p in split.tail]
    others = [(path, owner) for path, owner in others if owner != stage]
    kept = {id(p) for path in split.owned(stage) for p in model.get_submodule(path).parameters()}
    for path, owner in others:
        module = model.get_submodule(path)
        if any(id(p) in kept for p in module.parameters()):  # tied to a weight this stage holds
            module.forward = types.MethodType(_stand_in_forward, module)
            module.stand_in = True  # its style's hooks are not installed: it computes nothing
            module.dtype = next(module.parameters()).dtype
        else:
            _set(model, path, StandIn(module, owner))


@dataclass
class StageRuntime:
    """What the hooks of a stage share: the link, the micro-batch running, what training keeps."""

    split: StageSplit
    link: StageLink
    forward: object  # the model's own forward, under the pipelined one
    micro_batches: int | None = None  # per forward (None: ``forward.default_micro_batches``)
    micro_batch: int = 0
    shape: tuple = (0, 0)  # (rows, tokens) of the micro-batch running
    training: bool = False  # keep the received input (as a leaf needing grad) and the sent output
    inputs: dict = field(default_factory=dict)  # micro-batch -> received hidden states
    outputs: dict = field(default_factory=dict)  # micro-batch -> output sent on (its graph kept)


def install_links(model: nn.Module, runtime: StageRuntime) -> None:
    """The receive before the stage's first layer and the send after its last."""
    split, link = runtime.split, runtime.link
    layers = model.get_submodule(split.layer_list)
    own = split.layers_of(link.stage)

    def receive(module, args, kwargs):
        hidden = link.recv(link.stage - 1, f"the hidden states of micro-batch {runtime.micro_batch}")
        if runtime.training:
            hidden.requires_grad_(True)
            runtime.inputs[runtime.micro_batch] = hidden
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def send(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        link.send(hidden, link.stage + 1, f"the hidden states of micro-batch {runtime.micro_batch}")
        if runtime.training:
            runtime.outputs[runtime.micro_batch] = hidden

    def stop(module, args):  # after the send and every other hook of the stage's last layer
        raise StageDone()

    for layer in layers:
        if isinstance(layer, MissingLayer):
            layer.runtime = runtime
    if not link.is_first:
        layers[own[0]].register_forward_pre_hook(receive, with_kwargs=True)
    if not link.is_last:
        layers[own[-1]].register_forward_hook(send)
        layers[own[-1] + 1].register_forward_pre_hook(stop)
