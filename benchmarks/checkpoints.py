"""The benchmark's checkpoints, built locally (no hub): the embedded SmolLM2-135M-Instruct, and a
random Llama of ~1 GB in bf16, big enough that load time is not noise."""

from __future__ import annotations

import os
import shutil
import sys

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


def _llama_tensors() -> tuple[str, dict]:
    """The 1 GB Llama's path and every tensor of it, to be written in another format."""
    from safetensors.torch import load_file

    source, tensors = random_llama(), {}
    for name in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(source, name)))
    return source, tensors


def fp8_llama(block: int = 128) -> str:
    """The 1 GB Llama as the FP8 releases store it (DeepSeek-V3 / Qwen3-FP8): every decoder matrix
    float8_e4m3fn with a float32 ``weight_scale_inv`` per 128 x 128 block, embeddings and head in bf16."""
    import json

    from safetensors.torch import save_file

    path = os.path.join(cache_root(), "bench-llama-1gb-fp8")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    source, tensors = _llama_tensors()
    for key in [k for k, w in tensors.items() if w.dim() == 2 and ".layers." in k]:
        weight = tensors[key].float()
        rows, cols = weight.shape  # whole blocks in this config
        blocks = weight.reshape(rows // block, block, cols // block, block)
        scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
        tensors[key] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        tensors[key + "_scale_inv"] = scale.contiguous()
    os.makedirs(path + ".tmp", exist_ok=True)
    save_file(tensors, os.path.join(path + ".tmp", "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block],
                                     "activation_scheme": "dynamic"}  # fmt: skip
    with open(os.path.join(path + ".tmp", "config.json"), "w") as f:
        json.dump(config, f)
    os.replace(path + ".tmp", path)
    return path


DEQUANTIZED = "-dequantized"  # beside a checkpoint transformers reads only through GPU kernels: its floats


def gptq_llama(group: int = 128) -> str:
    """The 1 GB Llama as GPTQ int4 releases store it (act-order, groups of 128, symmetric, the v1 format; the
    tests' packer, ``tests/tiny_models.py``), and beside it (``DEQUANTIZED``) the same weights dequantized as
    floats in bf16: what one process and transformers run on, as they cannot read GPTQ on a CPU."""
    path = os.path.join(cache_root(), "bench-llama-1gb-gptq")
    if not os.path.isfile(os.path.join(path, "config.json")):
        _write_gptq(path, *_llama_tensors(), ("gptq", 4, "gptq", group, True, True))
    return path


def _write_gptq(path: str, source: str, tensors: dict, form: tuple) -> None:
    """``tensors`` (of the checkpoint at ``source``) quantized in GPTQ ``form`` (``quantize_grouped_checkpoint``'s
    arguments) at ``path``, and their dequantized floats in bf16 at ``path + DEQUANTIZED``."""
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tiny_models import grouped_config, quantize_grouped_checkpoint

    torch.manual_seed(0)
    quantized, dequantized = quantize_grouped_checkpoint(tensors, *form)
    for target, written in ((path + DEQUANTIZED, dequantized), (path, quantized)):  # the quantized one last
        shutil.copytree(source, target + ".tmp", ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
        if target != path:  # bf16, as the weights are read at --dtype bfloat16: the same rounding of the same floats
            written = {key: tensor.to(torch.bfloat16) for key, tensor in written.items()}
        save_file(written, os.path.join(target + ".tmp", "model.safetensors"), metadata={"format": "pt"})
        if target == path:
            grouped_config(target + ".tmp", *form)
        os.replace(target + ".tmp", target)


# ~0.4 B parameters, 0.1 B of them active a token: 8 layers of 32 experts (MLP 512), 4 of them a token
QWEN3_MOE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_experts=32,
                 num_experts_per_tok=4, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                 max_position_embeddings=2048, tie_word_embeddings=False)  # fmt: skip


def qwen3_moe() -> str:
    """A random Qwen3-MoE (``QWEN3_MOE``) in bf16, one key per expert as transformers saves it."""
    path = os.path.join(cache_root(), "bench-qwen3-moe")
    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**QWEN3_MOE),
                                                              dtype=torch.bfloat16)  # fmt: skip
        model.save_pretrained(path + ".tmp", max_shard_size="100GB")
        os.replace(path + ".tmp", path)
    return path


def fp8_qwen3_moe() -> str:
    """A random Qwen3-MoE as its FP8 release stores it (one key per expert, 128 x 128 blocks; the tests'
    ``quantize_fp8``): a decode step routes each token to 4 of each layer's 32 experts."""
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tiny_models import fp8_config, quantize_fp8

    path = os.path.join(cache_root(), "bench-qwen3-moe-fp8")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    shutil.copytree(qwen3_moe(), path + ".tmp", dirs_exist_ok=True)
    file = os.path.join(path + ".tmp", "model.safetensors")
    quantized = quantize_fp8({k: v.float() for k, v in load_file(file).items()}, block=(128, 128))[0]
    save_file({k: v if v.dtype != torch.float32 or k.endswith("_scale_inv") else v.to(torch.bfloat16)
               for k, v in quantized.items()}, file, metadata={"format": "pt"})  # fmt: skip
    fp8_config(path + ".tmp", block=(128, 128))
    os.replace(path + ".tmp", path)
    return path


def gptq_qwen3_moe(group: int = 128) -> str:
    """The random Qwen3-MoE as its GPTQ int4 releases store it (groups of 128 in order, symmetric, the v1 format;
    one key per expert), and beside it (``DEQUANTIZED``) the same weights dequantized in bf16."""
    from safetensors.torch import load_file

    path = os.path.join(cache_root(), "bench-qwen3-moe-gptq")
    if not os.path.isfile(os.path.join(path, "config.json")):
        source = qwen3_moe()
        tensors = load_file(os.path.join(source, "model.safetensors"))
        _write_gptq(path, source, tensors, ("gptq", 4, "gptq", group, False, True))
    return path


CHECKPOINTS = {"smollm2-135m": default_checkpoint, "llama-1gb": random_llama, "llama-1gb-fp8": fp8_llama,
               "llama-1gb-gptq": gptq_llama, "qwen3-moe-fp8": fp8_qwen3_moe,
               "qwen3-moe-gptq": gptq_qwen3_moe}  # fmt: skip
