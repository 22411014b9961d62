"""The pipelined forward that ``model(...)`` and ``model.generate(...)`` run on every rank.

The batch is cut into micro-batches along its rows; each stage runs them one after the other, its
sends asynchronous, so stage i computes micro-batch m while stage i+1 computes m-1 (GPipe's fill
and drain). Each micro-batch runs on its rows of the KV cache ``generate`` passes in (its own
layers' keys and values, one-element markers for the other stages' layers), joined back after.
The last stage's logits (and loss) are broadcast to every rank at the end: ``generate`` picks the
same next token everywhere.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..compat.transformers import join_cache, split_cache
from ..core.context import batch_inputs
from .stage import Stage

BATCH_KEYS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "token_type_ids")


def batch_size_of(kwargs: dict) -> int:
    return batch_inputs(kwargs).shape[0]


def split_batch(kwargs: dict, count: int) -> list[dict]:
    """``count`` dicts of keyword arguments, each with a contiguous run of the batch's rows
    (the first ``rows % count`` one row more); everything not per row is shared."""
    rows = batch_size_of(kwargs)
    count = max(1, min(count, rows))
    sizes = [rows // count + (i < rows % count) for i in range(count)]
    parts, start = [], 0
    for size in sizes:
        part = dict(kwargs)
        for key in BATCH_KEYS:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows and rows > 1:
                part[key] = value[start : start + size]
        parts.append(part)
        start += size
    return parts


def label_count(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The tokens a causal LM loss averages over: labels shifted by one, ignored ones left out."""
    return (labels[..., 1:] != ignore_index).sum()


def default_micro_batches(rows: int, tokens: int, stages: int) -> int:
    """One micro-batch per stage for a forward over several tokens per row (a prefill, a training
    step: compute-bound, splitting rows costs nothing); one for a decode step (one token per row:
    bound by reading the weights, which every micro-batch does again, so more micro-batches only add
    reads)."""
    return 1 if tokens == 1 else min(rows, stages)


def pipelined(kwargs: dict, stage: Stage, run) -> CausalLMOutputWithPast:
    """One forward over the stages: ``run(part, micro_batch)`` runs the model's own forward on one
    micro-batch (its output on the last stage, else None)."""
    link, labels = stage.link, kwargs.get("labels")
    if labels is not None and torch.is_grad_enabled():
        raise RuntimeError(
            "a pipeline-parallel model's loss cannot be back-propagated from a plain forward (the stages "
            "hold different layers): train with hf_parallel.train_step(model, input_ids, labels, ...), "
            "or compute the loss under torch.no_grad()"
        )
    tokens = batch_inputs(kwargs).shape[1]
    count = stage.micro_batches or default_micro_batches(batch_size_of(kwargs), tokens, link.num_stages)
    parts = split_batch(kwargs, count)
    cache = kwargs.get("past_key_values")
    if cache is not None and len(parts) > 1:
        for part, micro in zip(parts, split_cache(cache, [batch_size_of(part) for part in parts])):
            part["past_key_values"] = micro
    if labels is not None:
        total = label_count(labels)
        for part in parts:
            part["num_items_in_batch"] = total
    outputs = [run(part, micro_batch=i) for i, part in enumerate(parts)]
    link.flush()
    logits = torch.cat([out.logits for out in outputs]) if link.is_last else None
    logits = link.broadcast_from_last(logits)
    loss = None
    if labels is not None:
        loss = link.broadcast_from_last(sum(out.loss for out in outputs) if link.is_last else None)
    if cache is not None and len(parts) > 1:
        join_cache(cache, [part["past_key_values"] for part in parts])
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
