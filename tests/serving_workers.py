"""Workers of serving on split models (test_serving): each runs inside a rank of a spawned gloo group."""

from __future__ import annotations

import os

import torch

PROMPTS = [[1, 5, 9], [2, 4, 6, 8, 10], [3, 7, 11, 13, 17, 19, 23]]  # three lengths, batched together
NEW_TOKENS = 5


def greedy_tokens(model, prompts=PROMPTS) -> list[list[int]]:
    """``model.generate``'s greedy tokens for each prompt alone (a dynamic cache, no batching)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, min_new_tokens=NEW_TOKENS)  # fmt: skip
        out.append(generated[0, len(prompt):].tolist())
    return out


def _config(**overrides):
    import transformers

    return transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=-1, **{"do_sample": False,
                                                                                          **overrides})


def _small():
    """A paged cache of a few blocks and a small batch: no sizing from the host's memory (gigabytes)."""
    import transformers

    return transformers.ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256)


def batched(model, config=None, cb_config=None) -> list[list[int]]:
    """``generate_batch``'s tokens, in the prompts' order."""
    results = model.generate_batch(PROMPTS, config or _config(), cb_config or _small(), progress_bar=False)
    return [out.generated_tokens for out in results.values()]


def batched_and_kv_heads(model) -> tuple[list[list[int]], list[int]]:
    """``generate_batch``'s tokens (twice, the second through the manager the first kept: the same tokens or
    None), and the KV heads of its paged cache's pages on this rank."""
    runs = [model.generate_batch(PROMPTS, _config(), _small(), progress_bar=False, persistent_manager=True)
            for _ in range(2)]  # fmt: skip
    cache = model._cached_continuous_batching_manager.batch_processor.cache
    kv_heads = sorted({a.num_key_value_heads for a in cache.cache_allocators.values()})
    model.destroy_cached_continuous_batching_manager()
    first, second = ([out.generated_tokens for out in results.values()] for results in runs)
    return (first if first == second else None), kv_heads


def continuous_batching(rank: int, world_size: int, cases: dict) -> dict:
    """Each case ``name -> (path, from_pretrained keywords)`` loaded at TP=world_size: ``generate_batch``'s
    greedy tokens, its cache's KV heads on this rank, and ``generate``'s; for the first case also streamed
    tokens, a sampled batch (the same on every rank) and the share of memory the cache was sized from."""
    import hf_parallel

    out = {}
    for index, (name, (path, kwargs)) in enumerate(cases.items()):
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        tokens, kv_heads = batched_and_kv_heads(model)
        out[name] = {"batched": tokens, "kv_heads": kv_heads, "generate": greedy_tokens(model)}
        if index == 0:
            out[name] |= _first_case_extras(model)
        del model
    return out


def _first_case_extras(model) -> dict:
    probe = model.init_continuous_batching(_config(), None)  # sized from the host's memory (not started: no cache)
    fraction = probe.continuous_batching_config.max_memory_percent
    probe.destroy()
    manager = model.init_continuous_batching(_config(), _small())
    manager.start()
    try:
        manager.add_request(PROMPTS[1], request_id="streamed", max_new_tokens=NEW_TOKENS, streaming=True)
        streamed = [list(out.generated_tokens) for out in manager.request_id_iter("streamed")]
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    sampled = batched(model, _config(do_sample=True, temperature=0.9, top_k=20))
    return {"streamed": streamed, "memory_fraction": fraction, "sampled": sampled}


def refused(rank: int, world_size: int, cases: dict) -> dict:
    """What ``generate_batch`` raises on each layout ``name -> (path, keywords)``."""
    import hf_parallel

    out = {}
    for name, (path, kwargs) in cases.items():
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        try:
            out[name] = f"ran: {batched(model)}"
        except NotImplementedError as error:
            out[name] = str(error)
    return out


def failing_rank(rank: int, world_size: int, path: str) -> dict:
    """The paged cache's bytes under budgets of 8 and 16 MiB; then rank 1's forward fails at its third call:
    every rank's ``generate_batch`` raises (the others after the collective they wait in times out), none
    hangs."""
    os.environ["HF_PARALLEL_TIMEOUT"] = "5"
    import transformers

    import hf_parallel

    small = transformers.ContinuousBatchingConfig(max_batch_tokens=256)  # (8192 batch tokens need more memory)
    cache_bytes = {}
    for mib in (8, 16):
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                 kv_cache_memory_bytes=mib * 1024**2)  # fmt: skip
        manager = model.init_continuous_batching(_config(), small)
        manager.start()
        try:
            manager.add_request(PROMPTS[0], request_id="sized", max_new_tokens=1)
            list(manager.request_id_iter("sized"))
            cache_bytes[mib] = manager.batch_processor.cache.cache_tensor.numel()
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()
    calls = []

    def fail(module, args):
        calls.append(1)
        if rank == 1 and len(calls) == 3:
            raise RuntimeError("injected failure on rank 1")

    model.model.register_forward_pre_hook(fail)
    try:
        batched(model, cb_config=small)
        error = None
    except RuntimeError as raised:
        error = str(raised)
    return {"error": error, "cache_bytes": cache_bytes}
