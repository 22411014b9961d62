"""``train_step``: forward and backward of one batch over micro-batches, for every layout.

The loss of every micro-batch is its summed token loss over the whole batch's token count
(transformers' ``num_items_in_batch``), so the accumulated gradients are those of one process's
mean loss over the batch. Without pipeline stages the micro-batches run one after the other
(gradient accumulation, through the model's forward: TP and SP as in any forward); on pipeline
stages they run on the GPipe or 1F1B schedule (``pipeline/schedule.py``).

With data-parallel replicas (``fsdp_size``, ``dp_replicate_size``) every rank passes the same
global batch and each replica trains on its own contiguous rows; FSDP averages the replicas'
gradients, so each replica's loss is normalised by the global token count over the replicas
(``num_items_in_batch = tokens / dp``): the gradients are one process's on the whole batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..adapters.seams import place_and_check
from ..distributed.faults import collective
from ..pipeline.forward import label_count, split_batch
from ..pipeline.schedule import run_schedule
from ..state import parallel_state


def accumulate(model, state, parts: list[dict], reduce_once: bool, keep_gathered: bool) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn. The TP/SP sums run once, in the last backward
    (``GradientSums.deferring``: the local gradients accumulate meanwhile, at no cost in memory). Under FSDP,
    ``reduce_once`` reduce-scatters once too (``set_requires_gradient_sync``): fewer collectives, but each
    rank keeps its whole TP shard's gradients unsharded between micro-batches (float32 under mixed
    precision), so by default every micro-batch reduce-scatters (torchtitan's). ``keep_gathered``: FSDP's
    parameters stay whole from each backward to the next forward (no all-gather there, the unsharded layers'
    memory meanwhile)."""
    fsdp = model if hasattr(model, "set_requires_gradient_sync") else None
    losses = []
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            if fsdp is not None:
                fsdp.set_requires_gradient_sync(last or not reduce_once)
                fsdp.set_reshard_after_backward(last or not keep_gathered)
            with contextlib.nullcontext() if last else state.gradients.deferring():
                loss = model(**part).loss
                loss.backward()
            losses.append(loss.detach())
    finally:  # a later plain backward reduces as ever
        if fsdp is not None:
            fsdp.set_requires_gradient_sync(True)
            fsdp.set_reshard_after_backward(True)
    state.gradients.flush()  # what the last micro-batch did not reach
    return sum(losses)


def train_step(
    model, input_ids, labels, attention_mask=None, *, micro_batches: int = 4, schedule: str = "1f1b",
    reduce_once: bool = False, keep_gathered: bool = False, **kwargs
) -> torch.Tensor:  # fmt: skip
    """Forward and backward of one batch; gradients accumulate in ``.grad`` as ``loss.backward()``
    would leave them in one process. Returns the batch's mean loss on every rank. Works on any
    hf_parallel model (one stage: gradient accumulation over micro-batches, the TP/SP sums once, in
    the last; under FSDP ``reduce_once`` reduce-scatters once too, holding the unsharded gradients
    meanwhile, and ``keep_gathered`` keeps the parameters whole between micro-batches: ``accumulate``).
    With data-parallel replicas, every rank passes the whole batch (its rows a multiple of the
    replicas)."""
    state = parallel_state(model)
    place_and_check(model)  # adapters added since loading placed, any other new trainable parameter refused
    dp = state.mesh.dp
    call = dict(input_ids=input_ids, labels=labels, attention_mask=attention_mask, use_cache=False, **kwargs)
    total = label_count(call["labels"])
    if dp.size > 1:
        rows = call["labels"].shape[0]
        if rows % dp.size:
            raise ValueError(
                f"train_step: a batch of {rows} rows cannot be shared by the {dp.size} data-parallel replicas "
                f"({state.mesh.shape}); pass a multiple of {dp.size} rows (every rank the same batch)"
            )
        call = split_batch(call, dp.size)[dp.rank]
        total = total / dp.size  # FSDP averages the replicas' gradients
    if state.stage is not None:  # the batch every rank of a sequence group computes, once for all micro-batches
        call = state.runtime.inputs((), call)
    parts = split_batch(call, micro_batches)
    for part in parts:
        part["num_items_in_batch"] = total
    if state.stage is not None:
        loss = run_schedule(model, state, parts, schedule)
    else:
        loss = accumulate(model, state, parts, reduce_once, keep_gathered)
    if dp.size > 1:  # the replicas' mean: the loss over the whole batch
        with collective(f"averaging the loss over the data-parallel replicas (rank {state.mesh.rank})"):
            dist.all_reduce(loss, group=dp.group)
        loss = loss / dp.size
    return loss
