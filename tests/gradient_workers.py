"""Workers of the gradient sums (test_gradient_sums): each runs inside a rank of a spawned gloo group
(``distributed.run_ranks``) and measures its gradients against every rank's, summed in the worker itself."""

from __future__ import annotations

import contextlib
import copy
import os

import torch


def _sums_over_the_world(model, bucket_bytes: int):
    from hf_parallel.distributed.buckets import BUCKET_MB_ENV
    from hf_parallel.distributed.mesh import get_mesh
    from hf_parallel.tensor.gradients import GradientSums

    os.environ[BUCKET_MB_ENV] = str(bucket_bytes / 2**20)
    group = get_mesh().tp.group
    sums = GradientSums()
    for param in model.parameters():
        sums.sum_over(param, group)
    sums.register(model)
    return sums


def bucketed_gradient_sums(rank: int, world_size: int) -> dict:
    """``GradientSums`` with 64-byte buckets (many launched during each backward, several in flight) on a
    small model whose every weight is summed over the world: the gradients after a plain backward, after
    micro-batches under ``deferring``, with an optimizer-style hook registered after the sums, after a
    backward that raised (gradients zeroed to None, and in place), under reentrant checkpointing and through
    ``torch.autograd.grad``, each against the sum of every rank's local gradients (computed here from every
    rank's input, which each rank can make, on a copy without hooks)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    alone = copy.deepcopy(model)  # the reference, without hooks
    sums = _sums_over_the_world(model, 64)

    def inputs(r: int, step: int) -> torch.Tensor:
        return torch.linspace(-1, 1, 8).reshape(2, 4) * (r + 1) + step

    def want(steps) -> dict:  # one process's gradients of every rank's losses, summed
        reference = {name: torch.zeros_like(p) for name, p in alone.named_parameters()}
        for r in range(world_size):
            loss = sum(alone(inputs(r, s)).square().sum() for s in steps)
            for name, g in zip(reference, torch.autograd.grad(loss, list(alone.parameters()))):
                reference[name] += g
        return reference

    def gap(reference: dict, grads=None) -> float:
        grads = grads or [p.grad for p in model.parameters()]
        return max((g - reference[name]).abs().max().item() for (name, _), g in zip(model.named_parameters(), grads))

    def backward(step: int, **kwargs):
        model(inputs(rank, step)).square().sum().backward(**kwargs)

    out = {}
    model.zero_grad()
    backward(0)
    out["plain"] = gap(want([0]))
    model.zero_grad()
    for step in range(3):  # the micro-batches of one step: summed once, in the last backward
        with sums.deferring() if step < 2 else contextlib.nullcontext():
            backward(step)
    sums.flush()
    out["deferred"] = gap(want(range(3)))
    seen = {}
    handle = model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.update(grad=p.grad.clone()))
    model.zero_grad()
    backward(0)
    handle.remove()
    out["hook_saw_the_sum"] = (seen["grad"] - want([0])["0.weight"]).abs().max().item()
    for set_to_none in (True, False):  # the last layer's sums launched, then the first layer's hook raises
        model.zero_grad()

        def fail(grad):
            raise RuntimeError("a backward that raised")

        failing = model[0].bias.register_hook(fail)
        try:
            backward(0)
        except RuntimeError:
            pass
        failing.remove()
        model.zero_grad(set_to_none=set_to_none)
        backward(1)
        out[f"after_a_raise_zeroed_{'to_none' if set_to_none else 'in_place'}"] = gap(want([1]))
    model.zero_grad()
    first = checkpoint(lambda x: model[1](model[0](x)), inputs(rank, 2).requires_grad_(), use_reentrant=True)
    model[2](first).square().sum().backward()  # the first layer's sums in the nested backward, the last's outside
    out["reentrant"] = gap(want([2]))
    model.zero_grad()
    grads = torch.autograd.grad(model(inputs(rank, 3)).square().sum(), list(model.parameters()))
    out["autograd_grad"] = gap(want([3]), grads)
    return out


def crosswise_buckets(rank: int, world_size: int) -> dict:
    """Two layers of the same shape run in a different order on each rank (as routing may), each weight a
    bucket of its own: the ranks' buckets pair different parameters of equal size, which must be refused by
    name, not summed crosswise."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
    model = torch.nn.ModuleList([first, second])
    _sums_over_the_world(model, 64)
    order = (first, second) if rank == 0 else (second, first)
    x = torch.ones(2, 4)
    try:
        order[1](torch.tanh(order[0](x))).sum().backward()
        return {"error": None}
    except RuntimeError as error:
        return {"error": str(error)}


def fsdp_step_variants(rank: int, world_size: int, path: str) -> dict:
    """``train_step`` under FSDP with 2 micro-batches, reduce-scattered per micro-batch (the default) and once
    (``reduce_once``, with ``keep_gathered``): every gradient slice this rank holds against one process's."""
    from compare import gaps
    from training_workers import first_gradients, training_batch

    import hf_parallel

    out = {}
    for name, options in {"default": {}, "once": dict(reduce_once=True, keep_gathered=True)}.items():
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, fsdp_size=2, tp_plan=None)
        model.train()
        state = hf_parallel.parallel_state(model)
        hf_parallel.train_step(model, **training_batch(model.config.vocab_size, 0), micro_batches=2, **options)
        out[name] = gaps(model, state, first_gradients(path), state.mesh.tp.rank)
    return out
