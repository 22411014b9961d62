"""The parallel runtime of a loaded model: what runs around its forward, composed in one order.

``compose`` installs, once the local weights are in place, innermost first:

1. tensor (and expert) parallelism: each module's style wraps that module's forward with its
   collectives (``tensor/parallelize.install``); modules another pipeline stage runs are skipped;
2. the sequence split (``sp_size``): hooks on the decoder layers (each gets its tokens' slice of the
   positions, the first splits the hidden states), the gather before the LM head, Ulysses attention
   through transformers' registry, every gradient summed over SP (``sequence/shard.py``);
3. the pipeline stage: the receive before the stage's first layer, the send after its last, the
   stop on entering the next stage's (``pipeline/stage.py``).

Each call of ``model.forward`` (so ``generate``) then goes through ``Runtime.forward``: the batch is
broadcast over SP (every rank of a sequence group computes the same batch), cut into micro-batches
for the pipeline (``pipeline/forward.py``), and each micro-batch runs the model's own forward under
a ``Call`` (``context.py``) that the hooks of steps 2 and 3 read: its rows and tokens, the SP token
split, its micro-batch index, train_step's record. The SP loss is computed per micro-batch; the
last stage's logits and loss are broadcast to every rank. A model with neither SP nor pipeline
stages keeps its own forward: tensor parallelism needs no per-call context.
"""

from __future__ import annotations

import functools
import inspect
import weakref

from torch import nn

from .context import Call, StepRecord, batch_inputs, calling
from .pipeline.forward import pipelined
from .pipeline.p2p import StageLink
from .pipeline.stage import Stage, StageDone, install_links, tied_across_stages
from .sequence.shard import SequenceSplit, decoder_layers, install_sequence, sequence_inputs, sequence_loss
from .tensor.parallelize import install


class Runtime:
    """Runs the model's own forward on a sequence split and a pipeline stage (either may be None)."""

    def __init__(self, model: nn.Module, sequence: SequenceSplit | None, stage: Stage | None):
        self.sequence, self.stage = sequence, stage
        self.own = model.forward
        self._signature = inspect.signature(model.forward)
        self._warned: list = []

    @property
    def own(self):
        """The model's own forward, which ``run`` calls once per micro-batch."""
        return self._own()

    @own.setter
    def own(self, forward) -> None:
        # weakly: the state keeps the runtime, and must not keep the model alive
        self._own = weakref.WeakMethod(forward) if inspect.ismethod(forward) else (lambda: forward)

    def inputs(self, args: tuple, kwargs: dict) -> dict:
        """A forward's arguments by name, as every rank of a sequence group computes them."""
        bound = self._signature.bind_partial(*args, **kwargs)
        inputs = dict(bound.arguments)
        inputs.update(inputs.pop("kwargs", {}))
        if self.sequence is not None:
            inputs = sequence_inputs(self.sequence, inputs, self._warned)
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
        if self.sequence is not None:
            kwargs = dict(kwargs)
            labels, count = kwargs.pop("labels", None), kwargs.pop("num_items_in_batch", None)
            sequence = self.sequence.call(tokens, keep_split=labels is not None)
        with calling(Call(rows, tokens, micro_batch, sequence, training)):
            try:
                out = self.own(**kwargs)
            except StageDone:
                return None
        if labels is not None:
            out.loss = sequence_loss(out.logits, labels, sequence, count)
        return out


def compose(model: nn.Module, mesh, built, micro_batches: int | None = None) -> Runtime:
    """Install, in the order above, what runs around the forward of ``built`` (a ``RankModel``
    whose weights are loaded); the runtime holds the stage and the sequence split it made."""
    install(model, built.plan, built.cut.stand_ins if built.cut is not None else frozenset())
    sequence = stage = None
    if mesh.sp.size > 1:
        layer_list = built.split.layer_list if built.split is not None else None
        sequence = install_sequence(model, mesh, decoder_layers(model, layer_list), built.plan.gradients)
    if built.split is not None:
        stage = Stage(
            built.split, StageLink(mesh), built.cut, tied_across_stages(model, built.plan, built.cut), micro_batches
        )
        install_links(model, stage.split, stage.link)
    runtime = Runtime(model, sequence, stage)
    if sequence is not None or stage is not None:

        def forward(*args, **kwargs):
            return runtime.forward(*args, **kwargs)

        model.forward = functools.wraps(model.forward)(forward)  # its signature: generate inspects it
    return runtime
