"""A hub id as a local checkpoint directory, the way transformers finds it: ``huggingface_hub``'s cache,
downloading what is missing unless the hub is offline (``HF_HUB_OFFLINE=1``), with huggingface_hub's own
error when the id is neither cached nor reachable. Every rank asks at once: the cache's file locks make one
download of each file. Only what a load reads is fetched: configs, safetensors (and ``.bin`` weights when
pickles are allowed), tokenizer files."""

from __future__ import annotations

import os

WANTED = ["*.json", "model*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]  # (not consolidated.*)
WEIGHTS = (".safetensors", ".bin")


def local_checkpoint(name: str, allow_pickle: bool = False) -> str:
    """``name`` itself when it is a directory; else the hub id's snapshot in huggingface_hub's cache."""
    name = os.path.expanduser(os.fspath(name))
    if os.path.isdir(name):
        return name
    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"{name!r}: no such checkpoint directory (and not a hub id: 'org/name')")
    from huggingface_hub import snapshot_download

    patterns = WANTED + ["pytorch_model*.bin"] * allow_pickle
    try:
        folder = snapshot_download(name, allow_patterns=patterns)
    except Exception as error:  # huggingface_hub's words (not found, offline and not cached, gated), with the id
        raise OSError(f"{name!r} is neither a local checkpoint directory nor a hub id that can be loaded: "
                      f"{type(error).__name__}: {error}") from error  # fmt: skip
    if not any(file.endswith(WEIGHTS) for file in os.listdir(folder)):  # an offline cache holding configs only
        raise OSError(f"{name!r}: huggingface_hub's cache holds its configs but no weights (offline: "
                      "HF_HUB_OFFLINE=1?); download them, or pass a local checkpoint directory")  # fmt: skip
    return folder
