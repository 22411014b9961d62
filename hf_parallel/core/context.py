"""The per-call context: what one forward of a parallel model needs beyond its arguments.

The runtime (``runtime.py``) builds one ``Call`` for each micro-batch it runs and sets it for the
duration of that forward; the hooks the sequence split and the pipeline stage installed read it with
``current_call()``. Nothing per call is kept in a shared object between calls: a hook sees the call
it runs in, and only that one. Tensor parallelism's hooks need no context.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SequenceCall:
    """The token split of this call's sequences over the sequence group (Ulysses, and the ring of CP)."""

    split: object  # the model's SequenceSplit (sequence/shard.py): its groups, and the attention it wraps
    layout: object  # the sequence/tokens.py TokenLayout: tokens per rank, the zigzag order under CP
    keep_split: bool  # a loss follows: logits stay split (else the final hidden states are gathered)
    order: torch.Tensor | None = None  # the zigzag permutation on the device (None: the sequence in its own order)
    inverse: torch.Tensor | None = None  # the order's inverse: gathered tokens put back
    checked_masks: dict = field(default_factory=dict, compare=False)  # id -> the model's masks ring.py checked
    cache: object = None  # the rank's KV cache (sequence/decode.py), when the forward keeps one
    decoding: bool = False  # a decode step: the new tokens run whole on every rank (no layout, no split)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Tokens per rank of the sequence group (sequence/tokens.py)."""
        return self.layout.sizes

    @property
    def tokens(self) -> int:
        """The batch's sequence length (below sum(sizes) when padded)."""
        return self.layout.tokens


@dataclass
class StepRecord:
    """What ``train_step`` keeps across the micro-batches of one step on a pipeline stage."""

    inputs: dict = field(default_factory=dict)  # micro-batch -> received hidden states (leaves needing grad)
    outputs: dict = field(default_factory=dict)  # micro-batch -> hidden states sent on (their graphs kept)


@dataclass(frozen=True)
class Call:
    """One forward of one micro-batch."""

    rows: int
    tokens: int
    micro_batch: int = 0
    sequence: SequenceCall | None = None
    training: StepRecord | None = None  # set by train_step on a pipeline stage


_CALLS: list[Call | None] = []  # the calls in progress, innermost last: a list, which torch.compile traces
# (a ContextVar's set is a graph break); one thread runs a process's parallel forwards, as its collectives need


def current_call() -> Call | None:
    """The call in progress (None outside a forward the runtime runs)."""
    return _CALLS[-1] if _CALLS else None


def keeping_the_call(checkpoint):
    """An activation-checkpointing function whose recompute (in backward, where no call is in
    progress) runs under the call of the forward it recomputes, as that forward did."""

    def run(function, *args, **kwargs):
        call = current_call()

        def under_the_call(*inner_args, **inner_kwargs):
            with calling(call):
                return function(*inner_args, **inner_kwargs)

        return checkpoint(under_the_call, *args, **kwargs)

    return run


@contextmanager
def calling(call: Call):
    _CALLS.append(call)
    try:
        yield call
    finally:
        if _CALLS.pop() is not call:
            raise RuntimeError("hf_parallel: parallel forwards ended out of order (run them from one thread)")


def batch_inputs(kwargs: dict) -> torch.Tensor:
    """The batch's input_ids, or its inputs_embeds: [rows, tokens, ...]."""
    for key in ("input_ids", "inputs_embeds"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    raise ValueError("a parallel forward needs input_ids or inputs_embeds")
