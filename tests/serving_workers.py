"""Workers of serving on split models (test_serving): each runs inside a rank of a spawned gloo group."""

from __future__ import annotations

import torch


def continuous_batching(rank: int, world_size: int, path: str) -> dict:
    """transformers' three entry points to continuous batching on a model loaded at TP=2: what each raises
    (None where one runs)."""
    import transformers

    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = transformers.GenerationConfig(max_new_tokens=2, do_sample=False)
    calls = {
        "generate_batch": lambda: model.generate_batch([[1, 2, 3]], config, progress_bar=False),
        "init_continuous_batching": lambda: model.init_continuous_batching(config),
        "continuous_batching_context_manager": lambda: model.continuous_batching_context_manager(config).__enter__(),
    }
    out = {}
    for name, call in calls.items():
        try:
            out[name] = f"ran: {call()!r}"
        except NotImplementedError as error:
            out[name] = str(error)
    return out
