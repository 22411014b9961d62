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

What a module is here travels as explicit sets of module paths (``StageCut``), not as flags on
modules; the micro-batch running, its shape and train_step's record are the call's (``context.py``).
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass

import torch
from torch import nn

from ..core.context import current_call
from .p2p import StageLink
from .split import StageSplit


class StageDone(Exception):
    """Raised on entering the first layer after a stage's own: the remaining modules are elsewhere."""


class MissingLayer(nn.Module):
    """A layer held by another stage (vLLM's ``PPMissingLayer``)."""

    def __init__(self, layer_idx: int, stage: int, original: nn.Module | None = None):
        super().__init__()
        self.layer_idx, self.stage = layer_idx, stage
        self.returns_tuple = False
        if original is not None:  # what the model's loop reads of a layer: its kind (hybrids pick the mask
            for name, value in vars(original).items():  # by ``block_type`` / ``layer_type``), its output's form
                if not name.startswith("_") and isinstance(value, (str, int, float, bool)) and name != "training":
                    setattr(self, name, value)
            self.layer_idx, self.stage = layer_idx, stage
            self.returns_tuple = _returns_tuple(type(original).forward)

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        """Only layers before the stage's first own layer run (a stage ends at its last), and the
        first own layer replaces their output with the received hidden states: what they return is
        never used, whatever the model's loop does with it (some index a tuple)."""
        cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        if cache is not None and _counts_tokens(cache, self.layer_idx):  # the tokens' length, one element each
            call = current_call()
            rows, tokens = (call.rows, call.tokens) if call is not None else hidden_states.shape[:2]
            marker = torch.zeros(rows, 1, tokens, 1, device=hidden_states.device)
            cache.update(marker, marker, self.layer_idx)
        return (hidden_states, None) if self.returns_tuple else hidden_states

    def extra_repr(self) -> str:
        return f"layer {self.layer_idx}, held by stage {self.stage}"


def _returns_tuple(forward) -> bool:
    """Whether a layer's forward is annotated to return a tuple (Bamba's ``hidden, attn = layer(...)``)."""
    try:
        returns = typing.get_type_hints(forward).get("return")
    except Exception:  # noqa: BLE001 - an annotation naming what its module cannot resolve: read the text
        returns = inspect.signature(forward).return_annotation
        return isinstance(returns, str) and returns.lower().startswith(("tuple", "typing.tuple"))
    return typing.get_origin(returns) is tuple


def _counts_tokens(cache, layer_idx: int) -> bool:
    """Whether the cache's slot for ``layer_idx`` holds keys and values (an attention layer's, which
    transformers' mask sizing reads), not a recurrent layer's conv and state (hybrid models), which
    counts no tokens and has no ``update``."""
    layers = getattr(cache, "layers", None)
    return layers is None or layer_idx >= len(layers) or hasattr(layers[layer_idx], "update")


def zeros_like_output(width: int | None, dtype: torch.dtype):
    """The forward of a module another stage runs: zeros of an embedding's output shape (an expanded
    scalar), or, for anything else, its input as is."""

    def forward(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if width is None:
            return first
        return torch.zeros((), dtype=dtype, device=first.device).expand(*first.shape, width)

    return forward


class StandIn(nn.Module):
    """A module before or after the layers that another stage holds; zeros of its output's shape."""

    def __init__(self, original: nn.Module, stage: int):
        super().__init__()
        self.stage = stage
        weight = getattr(original, "weight", None)
        self.forward = zeros_like_output(
            getattr(original, "embedding_dim", None), weight.dtype if weight is not None else torch.float32
        )

    def extra_repr(self) -> str:
        return f"held by stage {self.stage}"


@dataclass(frozen=True)
class StageCut:
    """What cutting the model to one stage left in place of the others' modules (module paths)."""

    held_elsewhere: frozenset[str]  # replaced by MissingLayer / StandIn: no parameters here
    kept_for_tied_weights: frozenset[str]  # hold a weight tied to this stage's; forward replaced: compute nothing


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def cut_to_stage(model: nn.Module, split: StageSplit, stage: int) -> StageCut:
    """Replace every module another stage holds (on the meta device: nothing to free)."""
    layers = model.get_submodule(split.layer_list)
    own = split.layers_of(stage)
    elsewhere, kept_for_tied_weights = set(), set()
    for index in range(len(layers)):
        if index not in own:
            layers[index] = MissingLayer(index, split.stage_of_layer(index), layers[index])
            elsewhere.add(f"{split.layer_list}.{index}")
    others = [(p, 0) for p in split.head if stage != 0] + [(p, split.num_stages - 1) for p in split.tail]
    others = [(path, owner) for path, owner in others if owner != stage]
    kept = {id(p) for path in split.owned(stage) for p in model.get_submodule(path).parameters()}
    for path, owner in others:
        module = model.get_submodule(path)
        if any(id(p) in kept for p in module.parameters()):  # tied to a weight this stage holds
            module.forward = zeros_like_output(getattr(module, "embedding_dim", None), next(module.parameters()).dtype)
            kept_for_tied_weights.add(path)
        else:
            _set(model, path, StandIn(module, owner))
            elsewhere.add(path)
    return StageCut(frozenset(elsewhere), frozenset(kept_for_tied_weights))


def tied_across_stages(model: nn.Module, layout, cut: StageCut) -> tuple[str, ...]:
    """Parameters this stage holds only because they are tied to another stage's (first/last)."""
    names = {
        layout.params[f"{path}.{name}"].name
        for path in cut.kept_for_tied_weights
        for name, _ in model.get_submodule(path).named_parameters(recurse=False)
    }
    return tuple(sorted(names))


@dataclass(frozen=True)
class Stage:
    """A loaded model's pipeline stage: its split, its links to the others, what it holds."""

    split: StageSplit
    link: StageLink
    cut: StageCut
    tied: tuple[str, ...]  # parameters held by the first and the last stage (tied embeddings)
    micro_batches: int | None = None  # per forward (None: ``forward.default_micro_batches``)

    @property
    def index(self) -> int:
        return self.link.stage

    def layers(self) -> range:
        return self.split.layers_of(self.index)


def install_links(model: nn.Module, split: StageSplit, link: StageLink) -> None:
    """The receive before the stage's first layer, the send after its last, the stop at the next."""
    layers = model.get_submodule(split.layer_list)
    own = split.layers_of(link.stage)

    def receive(module, args, kwargs):
        call = current_call()
        hidden = link.recv(link.stage - 1, f"the hidden states of micro-batch {call.micro_batch}")
        if call.training is not None:
            hidden.requires_grad_(True)
            call.training.inputs[call.micro_batch] = hidden
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def send(module, args, output):
        call = current_call()
        hidden = output[0] if isinstance(output, tuple) else output
        link.send(hidden, link.stage + 1, f"the hidden states of micro-batch {call.micro_batch}")
        if call.training is not None:
            call.training.outputs[call.micro_batch] = hidden

    def stop(module, args):  # after the send and every other hook of the stage's last layer
        raise StageDone()

    if not link.is_first:
        layers[own[0]].register_forward_pre_hook(receive, with_kwargs=True)
    if not link.is_last:
        layers[own[-1]].register_forward_hook(send)
        layers[own[-1] + 1].register_forward_pre_hook(stop)


def install_stage(model: nn.Module, split: StageSplit, cut: StageCut, layout, mesh, micro_batches) -> Stage:
    """This rank's stage of the (already cut) model, linked to the others."""
    stage = Stage(split, StageLink(mesh), cut, tied_across_stages(model, layout, cut), micro_batches)
    install_links(model, split, stage.link)
    return stage
