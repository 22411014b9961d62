"""``train_step``: forward and backward of one batch over micro-batches, for every layout.

The loss of every micro-batch is its summed token loss over the whole batch's token count
(transformers' ``num_items_in_batch``), so the accumulated gradients are those of one process's
mean loss over the batch. Without pipeline stages the micro-batches run one after the other
(gradient accumulation, through the model's forward: TP and SP as in any forward); on pipeline
stages they run on the GPipe or 1F1B schedule (``pipeline/schedule.py``).
"""

from __future__ import annotations

import torch

from ..pipeline.forward import label_count, split_batch
from ..pipeline.schedule import run_schedule
from ..state import parallel_state


def train_step(
    model, input_ids, labels, attention_mask=None, *, micro_batches: int = 4, schedule: str = "1f1b", **kwargs
) -> torch.Tensor:
    """Forward and backward of one batch; gradients accumulate in ``.grad`` as ``loss.backward()``
    would leave them in one process. Returns the batch's mean loss on every rank. Works on any
    hf_parallel model (one stage: gradient accumulation over micro-batches)."""
    state = parallel_state(model)
    call = dict(input_ids=input_ids, labels=labels, attention_mask=attention_mask, use_cache=False, **kwargs)
    if state.stage is not None:  # the batch every rank of a sequence group computes, once for all micro-batches
        call = state.runtime.inputs((), call)
    parts = split_batch(call, micro_batches)
    total = label_count(call["labels"])
    for part in parts:
        part["num_items_in_batch"] = total
    if state.stage is not None:
        return run_schedule(model, state, parts, schedule)
    losses = []
    for part in parts:
        loss = model(**part).loss
        loss.backward()
        losses.append(loss.detach())
    return sum(losses)
