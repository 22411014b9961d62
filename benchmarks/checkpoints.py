"""The benchmark's checkpoints, built locally (no hub): the embedded SmolLM2-135M-Instruct, and a
random Llama of ~1 GB in bf16, big enough that load time is not noise."""

from __future__ import annotations

import os

import torch
import transformers

from hf_parallel.default_model import cache_root, default_checkpoint

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


def random_llama_1gb() -> str:
    """Build (once) and return the path of the random bf16 Llama."""
    path = os.path.join(cache_root(), "bench-llama-1gb")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_1GB)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path + ".tmp")  # rename at the end: an interrupted build is not reused
    os.replace(path + ".tmp", path)
    return path


CHECKPOINTS = {"smollm2-135m": default_checkpoint, "llama-1gb": random_llama_1gb}
