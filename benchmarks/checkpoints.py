"""The benchmark's checkpoints, built locally (no hub): the embedded SmolLM2-135M-Instruct, and a
random Llama of ~1 GB in bf16, big enough that load time is not noise."""

from __future__ import annotations

import os

import torch
import transformers

from hf_parallel.commands.default_model import cache_root, default_checkpoint

# ~0.5 B parameters: 16 layers of hidden 1536 / MLP 4096, 12 query and 4 KV heads, untied 32k vocab
LLAMA_1GB = dict(
    vocab_size=32000,
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


# a small Llama for long sequences: activations, not weights, fill memory (8 query / 4 KV heads)
LLAMA_LONG_CONTEXT = dict(
    vocab_size=8000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=65536,
    tie_word_embeddings=False,
)


def random_llama(name: str = "bench-llama-1gb", config: dict = LLAMA_1GB, dtype=torch.bfloat16) -> str:
    """Build (once) and return the path of a random Llama of this config."""
    path = os.path.join(cache_root(), name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config), dtype=dtype)
    model.save_pretrained(path + ".tmp")  # rename at the end: an interrupted build is not reused
    os.replace(path + ".tmp", path)
    return path


def random_llama_long_context() -> str:
    return random_llama("bench-llama-long-context", LLAMA_LONG_CONTEXT, torch.float32)


CHECKPOINTS = {"smollm2-135m": default_checkpoint, "llama-1gb": random_llama}
