"""The names of a checkpoint's files on disk, in one place: what transformers writes, what a
distributed save adds, and what a save in progress stages."""

from __future__ import annotations

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILE = "pytorch_model.bin"
PICKLE_INDEX_FILE = "pytorch_model.bin.index.json"
MANIFEST_FILE = "hf_parallel_manifest.json"  # a distributed save's index of its per-rank files
MAX_SHARD_SIZE = "50GB"  # where a standard checkpoint's files are split: transformers 5's save_pretrained default
TEMP_SUFFIX = ".tmp"  # a staged file: ".<final name>.<random>.tmp" until the save commits


def rank_file_name(rank: int, world_size: int, save_id: str) -> str:
    """The save id keeps a new save from overwriting files an older manifest still points to."""
    return f"model-rank-{rank:05d}-of-{world_size:05d}-{save_id}.safetensors"


def is_weight_file(name: str) -> bool:
    """Files that belong to a checkpoint's weights, in either form (standard or per-rank)."""
    return (
        name.startswith("model") and name.endswith(".safetensors") or name in (INDEX_FILE, SINGLE_FILE, MANIFEST_FILE)
    )


TRAINING_STATE_PREFIX = "training-state-rank-"


def training_state_file(rank: int, world_size: int) -> str:
    """One rank's training state in a Trainer checkpoint: its pieces of the trainable parameters and
    of their optimizer state, with where each sits in the full tensor (``training/state_tiles.py``)."""
    return f"{TRAINING_STATE_PREFIX}{rank:05d}-of-{world_size:05d}.safetensors"
