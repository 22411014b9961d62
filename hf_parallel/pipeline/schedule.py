"""Training over micro-batches on pipeline stages: GPipe (all forwards, then all backwards) and 1F1B
(after a warm-up of ``stages - stage - 1`` forwards, one forward then one backward, so at most that
many activations are held).

Written here rather than taken from ``torch.distributed.pipelining``: its stages exchange
activations between one rank per stage and its schedules pass positional tensors only. Here a
stage is a TP group whose size may differ from its neighbours' (VTP: its first rank receives and
broadcasts), and a stage is the whole transformers model with hooks, called with keyword
arguments (masks, positions, cache) that every stage computes itself.

Backward of micro-batch m on stage i: the output it sent is back-propagated with the gradient the
next stage returned, then the gradient of the hidden states it received goes back to stage i-1
(the same on every TP rank: TP's conjugate collectives have already reduced it). Tied input/output
embeddings on the first and last stage get their two gradients summed (``tied.py``).

Where two neighbouring stages would each send the other something before receiving (1F1B's steady
state: stage i's forward output of micro-batch k and its receive of micro-batch j's gradient; stage
i+1's gradient of j and its receive of k), each holds its send and posts it with that receive in one
batch (Megatron's ``send_forward_recv_backward`` / ``send_backward_recv_forward``); sent on their own,
each would wait on NCCL for a receive queued behind the other's. ``paired`` finds those steps from both
stages' orders, so a pairing is never one-sided (GPipe's turn is not a swap: there stage i+1 receives
all of its inputs before it sends).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..core.context import StepRecord
from ..distributed.tags import Tag
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


def paired(schedule: str, stage: int, num_stages: int, count: int) -> set[int]:
    """The indices of ``stage``'s steps whose send goes out with the next step's receive: a forward of
    micro-batch k followed by the backward of j, where the next stage runs the backward of j followed by
    the forward of k (and the mirror image towards the stage before)."""
    steps = order(schedule, stage, num_stages, count)
    held = set()
    for i, (step, m) in enumerate(steps[:-1]):
        following = steps[i + 1]
        if step == following[0]:
            continue
        neighbour = stage + 1 if step == "F" else stage - 1
        if not 0 <= neighbour < num_stages:
            continue
        theirs = order(schedule, neighbour, num_stages, count)
        mirrored = [following, (step, m)]  # the neighbour's two steps, the other way round
        if any(theirs[j : j + 2] == mirrored for j in range(len(theirs) - 1)):
            held.add(i)
    return held


def run_schedule(model, state, parts: list[dict], schedule: str) -> torch.Tensor:
    """Forward and backward of ``parts`` (micro-batches whose losses already sum to the batch's mean)
    on this rank's stage of ``model`` (whose parallel state is ``state``); returns the summed loss of
    the last stage on every rank."""
    stage, run = state.stage, state.runtime.run
    link = stage.link
    record, losses = StepRecord(), {}
    steps = order(schedule, link.stage, link.num_stages, len(parts))
    held = paired(schedule, link.stage, link.num_stages, len(parts))
    for i, (step, m) in enumerate(steps):
        with link.hold_sends() if i in held else nullcontext():
            _run_step(step, m, parts, run, link, record, losses)
    link.flush()
    sum_tied_gradients(model, state)
    return link.broadcast_from_last(sum(losses.values()) if link.is_last else None)


def _run_step(step: str, m: int, parts: list[dict], run, link, record: StepRecord, losses: dict) -> None:
    if step == "F":
        out = run(parts[m], micro_batch=m, training=record)
        if link.is_last:
            losses[m] = out.loss
        return
    if link.is_last:
        losses[m].backward()
        losses[m] = losses[m].detach()
    else:
        grad = link.recv(link.stage + 1, f"the gradient of micro-batch {m}'s output", tag=Tag.BACKWARD)
        torch.autograd.backward(record.outputs.pop(m), grad)
    if not link.is_first:
        received = record.inputs.pop(m)
        link.send(received.grad, link.stage - 1, f"the gradient of micro-batch {m}'s input", tag=Tag.BACKWARD)
