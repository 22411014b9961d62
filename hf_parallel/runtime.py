"""The parallel runtime of a loaded model: what runs around its forward, once every step of
``api.from_pretrained`` (tensor parallelism, the sequence split, the pipeline stage, FSDP) is in place.

Each call of ``model.forward`` (so ``generate``) goes through ``Runtime.forward``: the batch is
broadcast over SP (every rank of a sequence group computes the same batch), cut into micro-batches
for the pipeline (``pipeline/forward.py``), and each micro-batch runs the model's own forward under
a ``Call`` (``context.py``) that the sequence split's and the stage's hooks read: its rows and
tokens, the SP token split, its micro-batch index, train_step's record. The SP loss is computed per
micro-batch; the last stage's logits and loss are broadcast to every rank. With ``tiled_loss`` the loss is
computed from the final hidden states a chunk of tokens at a time (``sequence/tiled_loss.py``); with
``offload_checkpoints`` what a training forward keeps for the backward waits in host memory. A model with none
of these keeps its own forward: tensor parallelism needs no per-call context.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

import torch
from torch import nn

from .compat.transformers import checkpoints_activations
from .core.context import Call, StepRecord, batch_inputs, calling
from .pipeline.forward import pipelined
from .pipeline.stage import Stage, StageDone
from .sequence.shard import SequenceSplit, sequence_inputs, sequence_loss
from .sequence.tiled_loss import TiledLoss


class Runtime:
    """Runs the model's own forward on a sequence split and a pipeline stage (either may be None)."""

    def __init__(self, model: nn.Module, sequence: SequenceSplit | None, stage: Stage | None, own=None,
                 tiled_loss: TiledLoss | None = None, offload_checkpoints: bool = False):  # fmt: skip
        """``own``: the forward ``run`` calls once per micro-batch (default the model's; under FSDP on a
        pipeline stage, the one FSDP's root hooks are on). With a sequence split, a stage, a tiled loss or
        offloaded checkpoints, ``model.forward`` becomes ``self.forward``."""
        self.sequence, self.stage = sequence, stage
        self.tiled_loss, self.offload_checkpoints = tiled_loss, offload_checkpoints
        self._model = weakref.ref(model)
        own = own or model.forward
        # weakly: the state keeps the runtime, and must not keep the model alive (a function and a
        # weak reference to its object, not a WeakMethod: torch.compile traces these)
        if inspect.ismethod(own):
            self._function, self._owner = own.__func__, weakref.ref(own.__self__)
        else:
            self._function, self._owner = own, None
        self._signature = inspect.signature(model.forward)
        self._warned: list = []
        self.autocast: tuple[str, torch.dtype] | None = None  # mixed precision without FSDP: (device type, dtype)
        if sequence is not None or stage is not None or tiled_loss is not None or offload_checkpoints:

            def forward(*args, **kwargs):
                return self.forward(*args, **kwargs)

            model.forward = functools.wraps(model.forward)(forward)  # its signature: generate inspects it

    @property
    def own(self):
        """The model's own forward, which ``run`` calls once per micro-batch."""
        if self._owner is None:
            return self._function
        owner = self._owner()
        if owner is None:
            raise RuntimeError("hf_parallel: the model this runtime ran has been freed")
        return functools.partial(self._function, owner)

    def bound(self, args: tuple, kwargs: dict) -> dict:
        """A forward's arguments by name, as this rank was called with them."""
        bound = self._signature.bind_partial(*args, **kwargs)
        inputs = dict(bound.arguments)
        inputs.update(inputs.pop("kwargs", {}))
        return inputs

    def inputs(self, args: tuple, kwargs: dict) -> dict:
        """A forward's arguments by name, as every rank of a sequence group computes them."""
        inputs = self.bound(args, kwargs)
        if self.sequence is not None:
            inputs = sequence_inputs(self.sequence, inputs, self._warned, can_cache=self.stage is None)
        return inputs

    def forward(self, *args, **kwargs):
        """``model.forward``: the whole batch, over the sequence split and the stages."""
        inputs = self.inputs(args, kwargs)
        if self.stage is None:
            return self.run(inputs)
        return pipelined(inputs, self.stage, self.run)

    def run(self, kwargs: dict, micro_batch: int = 0, training: StepRecord | None = None):
        """The model's own forward on one micro-batch, under its ``Call``: its output (with the SP
        loss when labels are given), or None on a stage that hands its output on."""
        rows, tokens = batch_inputs(kwargs).shape[:2]
        sequence = labels = count = None
        wants_loss = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        tiled = self.tiled_loss if wants_loss else None
        if self.sequence is not None or tiled is not None:
            kwargs = dict(kwargs)
            labels, count = kwargs.pop("labels", None), kwargs.pop("num_items_in_batch", None)
        shifted = tiled is not None and kwargs.get("shift_labels") is not None
        if shifted:  # transformers' shift_labels (each token's next one already), used over labels as its loss does
            labels = kwargs.pop("shift_labels")
        if self.sequence is not None:
            cache = kwargs.get("past_key_values")
            sequence = self.sequence.call(tokens, keep_split=labels is not None, cache=cache)
        autocast = torch.autocast(*self.autocast) if self.autocast else contextlib.nullcontext()
        masks = self.sequence.masks(sequence) if sequence is not None else contextlib.nullcontext()
        keeps = sequence is not None and sequence.cache is not None
        caching = sequence.cache.forward(sequence, tokens) if keeps else contextlib.nullcontext()
        head = tiled.first_tokens_only() if tiled is not None else contextlib.nullcontext()
        call = Call(rows, tokens, micro_batch, sequence, training)
        with calling(call), autocast, masks, caching, self._offloaded():  # (a stage's schedule calls run directly)
            try:
                with head as kept:
                    out = self.own(**kwargs)
            except StageDone:
                return None
            if labels is not None and getattr(out, "aux_loss", None) is not None:
                raise ValueError(
                    "the model returned a router auxiliary loss, which hf_parallel's loss (sequence parallelism, "
                    "tiled_loss) would leave out of the loss it returns: load with output_router_logits=False"
                )
            if tiled is not None:  # under the forward's autocast, as the head's own call would be
                out.loss = tiled.loss(kept[0], labels, sequence, count, out.logits, shifted)
                out.logits = None  # (one token's of each row: nothing should read them as the batch's)
        if labels is not None and tiled is None:
            out.loss = sequence_loss(out.logits, labels, sequence, count)
        return out

    def _offloaded(self):
        """With ``offload_checkpoints``, every tensor a training forward saves for its backward outside the
        checkpointed layers (each layer's input; the embeddings', the final norm's and the loss's: the model's
        own loss saves its logits, which ``tiled_loss`` does not) moved to host memory until the backward needs
        it (torch's ``save_on_cpu``, pinned on an accelerator). Refused without gradient checkpointing, without
        which it would move every activation."""
        model = self._model()
        if not self.offload_checkpoints or not torch.is_grad_enabled() or not getattr(model, "training", True):
            return contextlib.nullcontext()
        if not checkpoints_activations(model):
            raise ValueError(
                "offload_checkpoints=True moves activation checkpoints to host memory: call "
                "model.gradient_checkpointing_enable() (or TrainingArguments(gradient_checkpointing=True)) first"
            )
        device = next(model.parameters()).device
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type != "cpu")


def forward_under_autocast(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Mixed precision without FSDP: ``model.forward`` (so ``generate``, the Trainer's and ``train_step``'s
    forwards) runs under ``torch.autocast(dtype)``: matmuls in ``dtype``, the float32 parameters the masters
    the optimizer steps, their gradients float32 (so the TP/SP sums are too)."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device.type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
