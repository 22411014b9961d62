"""The pipelined forward that ``model(...)`` and ``model.generate(...)`` call on every rank.

The batch is cut into micro-batches along its rows; each stage runs them one after the other, its
sends asynchronous, so stage i computes micro-batch m while stage i+1 computes m-1 (GPipe's fill
and drain). Each micro-batch has its own KV cache on every stage (its own layers' keys and values,
markers for the others'); the cache ``generate`` passes in gets markers only, so its length is
right. The last stage's logits (and loss) are broadcast to every rank at the end: ``generate``
picks the same next token everywhere.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .stage import StageDone, StageRuntime

BATCH_KEYS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "token_type_ids")


def batch_size_of(kwargs: dict) -> int:
    for key in ("input_ids", "inputs_embeds"):
        if kwargs.get(key) is not None:
            return kwargs[key].shape[0]
    raise ValueError("a pipelined forward needs input_ids or inputs_embeds")


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


def run_micro_batch(forward, runtime: StageRuntime, index: int, kwargs: dict):
    """The stage's part of one micro-batch: the model's output on the last stage, else None."""
    runtime.micro_batch = index
    try:
        return forward(**kwargs)
    except StageDone:
        return None


def _micro_caches(cache, count: int, config) -> list:
    if count == 1:
        return [cache]
    caches = getattr(cache, "_hf_parallel_micro", None)
    if caches is None or len(caches) != count:
        caches = cache._hf_parallel_micro = [DynamicCache(config=config) for _ in range(count)]
    return caches


def _mark(cache, rows: int, new_tokens: int, num_layers: int) -> None:
    """Record ``new_tokens`` more in every layer slot of the cache ``generate`` holds (markers)."""
    marker = torch.zeros(rows, 1, new_tokens, 1)
    for layer in range(num_layers):
        cache.update(marker, marker, layer)


def pipelined_forward(model, forward, runtime: StageRuntime, default_micro_batches):
    """``model.forward`` for a pipeline stage (``forward``: the model's own)."""
    signature = inspect.signature(forward)
    link = runtime.link

    def run(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        call = dict(bound.arguments)
        call.update(call.pop("kwargs", {}))
        if call.get("labels") is not None and torch.is_grad_enabled():
            raise RuntimeError(
                "a pipeline-parallel model's loss cannot be back-propagated from a plain forward (the stages "
                "hold different layers): train with hf_parallel.pipeline.train_step(model, input_ids, labels, ...), "
                "or compute the loss under torch.no_grad()"
            )
        count = model._hf_parallel.micro_batches or default_micro_batches(batch_size_of(call))
        parts = split_batch(call, count)
        cache = call.get("past_key_values")
        if cache is not None:
            for part, micro in zip(parts, _micro_caches(cache, len(parts), model.config)):
                part["past_key_values"] = micro
        if call.get("labels") is not None:
            total = label_count(call["labels"])
            for part in parts:
                part["num_items_in_batch"] = total
        outputs = [run_micro_batch(forward, runtime, i, part) for i, part in enumerate(parts)]
        link.flush()
        logits = torch.cat([out.logits for out in outputs]) if link.is_last else None
        logits = link.broadcast_from_last(logits)
        loss = None
        if call.get("labels") is not None:
            loss = link.broadcast_from_last(sum(out.loss for out in outputs) if link.is_last else None)
        if cache is not None and len(parts) > 1:
            new = (call.get("input_ids") if call.get("input_ids") is not None else call["inputs_embeds"]).shape[1]
            _mark(cache, batch_size_of(call), new, len(model.get_submodule(runtime.split.layer_list)))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    return run
