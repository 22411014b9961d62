"""Training over micro-batches: GPipe (all forwards, then all backwards) and 1F1B (after a warm-up
of ``stages - stage - 1`` forwards, one forward then one backward, so at most that many
activations are held).

Written here rather than taken from ``torch.distributed.pipelining``: its stages exchange
activations between one rank per stage and its schedules pass positional tensors only. Here a
stage is a TP group whose size may differ from its neighbours' (VTP: its first rank receives and
broadcasts), and a stage is the whole transformers model with hooks, called with keyword
arguments (masks, positions, cache) that every stage computes itself.

The loss of every micro-batch is its summed token loss over the whole batch's token count
(transformers' ``num_items_in_batch``), so the accumulated gradients are those of one
process's mean loss over the batch. Backward of micro-batch m on stage i: the output it sent is
back-propagated with the gradient the next stage returned, then the gradient of the hidden states
it received goes back to stage i-1 (the same on every TP rank: TP's conjugate collectives have
already reduced it). Tied input/output embeddings on the first and last stage get their two
gradients summed (``tied.py``).
"""

from __future__ import annotations

import torch

from .forward import label_count, run_micro_batch, split_batch
from .p2p import BACKWARD
from .tied import sum_tied_gradients

SCHEDULES = ("gpipe", "1f1b")


def order(schedule: str, stage: int, num_stages: int, count: int) -> list[tuple[str, int]]:
    """The (``"F"``|``"B"``, micro-batch) steps of one stage."""
    if schedule == "gpipe":
        return [("F", m) for m in range(count)] + [("B", m) for m in range(count)]
    if schedule != "1f1b":
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    warmup = min(num_stages - stage - 1, count)
    steps = [("F", m) for m in range(warmup)]
    for m in range(count - warmup):
        steps += [("F", warmup + m), ("B", m)]
    return steps + [("B", m) for m in range(count - warmup, count)]


def train_step(
    model, input_ids, labels, attention_mask=None, *, micro_batches: int = 4, schedule: str = "1f1b", **kwargs
) -> torch.Tensor:
    """Forward and backward of one batch over the pipeline; gradients accumulate in ``.grad`` as
    ``loss.backward()`` would leave them in one process. Returns the batch's mean loss on every rank.
    Works on any hf_parallel model (one stage: gradient accumulation over micro-batches)."""
    state = model._hf_parallel
    runtime = state.pipeline
    call = dict(input_ids=input_ids, labels=labels, attention_mask=attention_mask, use_cache=False, **kwargs)
    parts = split_batch(call, micro_batches)
    total = label_count(labels)
    for part in parts:
        part["num_items_in_batch"] = total
    if runtime is None:  # no pipeline (TP, SP): gradient accumulation
        losses = []
        for part in parts:
            loss = model(**part).loss
            loss.backward()
            losses.append(loss.detach())
        return sum(losses)
    link = runtime.link
    losses = {}
    runtime.training, runtime.inputs, runtime.outputs = True, {}, {}
    try:
        for step, m in order(schedule, link.stage, link.num_stages, len(parts)):
            if step == "F":
                out = run_micro_batch(runtime, m, parts[m])
                if link.is_last:
                    losses[m] = out.loss
                continue
            if link.is_last:
                losses[m].backward()
                losses[m] = losses[m].detach()
            else:
                grad = link.recv(link.stage + 1, f"the gradient of micro-batch {m}'s output", tag=BACKWARD)
                torch.autograd.backward(runtime.outputs.pop(m), grad)
            if not link.is_first:
                received = runtime.inputs.pop(m)
                link.send(received.grad, link.stage - 1, f"the gradient of micro-batch {m}'s input", tag=BACKWARD)
        link.flush()
    finally:
        runtime.training, runtime.inputs, runtime.outputs = False, {}, {}
    sum_tied_gradients(model)
    return link.broadcast_from_last(sum(losses.values()) if link.is_last else None)
