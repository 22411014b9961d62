"""Read each rank's slice of every tensor straight from safetensors, into a meta-built model.

Only ``layout.index(rank)`` is ever requested from ``get_slice``, never a whole sharded tensor;
``BYTES_READ`` counts what was requested so tests can prove it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from contextlib import ExitStack

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from .keys import param_names_for_keys
from .parallelize import ShardPlan

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BYTES_READ: Counter = Counter()  # checkpoint key -> bytes requested by this process


def checkpoint_files(path: str) -> dict[str, str]:
    """Checkpoint key -> absolute file path, from the index or the single safetensors file."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {key: os.path.join(path, name) for key, name in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return {key: single for key in f.keys()}
    raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (hf_parallel loads safetensors checkpoints)")


def read_local(handle, key: str, layout, rank: int) -> torch.Tensor:
    """This rank's shard of ``key``: the slices of its layout, concatenated along the split dim."""
    tensor_slice = handle.get_slice(key)
    full_shape = tuple(tensor_slice.get_shape())
    pieces = [tensor_slice[index] for index in layout.index(full_shape, rank)]
    BYTES_READ[key] += sum(p.numel() * p.element_size() for p in pieces)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=layout.dim)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    if isinstance(getattr(module, attr), nn.Parameter) or attr in module._parameters:
        setattr(module, attr, value)
    else:
        module._buffers[attr] = value


def load_weights(model: nn.Module, path: str, shard: ShardPlan, dtype: torch.dtype) -> dict[str, str]:
    """Fill every parameter (and persistent buffer found in the checkpoint) with its local shard.

    Returns parameter name -> checkpoint key, which saving uses to write the source's names."""
    files = checkpoint_files(path)
    rank = shard.mesh.rank
    key_of = param_names_for_keys(model, files)
    source_keys, missing = {}, []
    for entry in shard.unique_params():
        key = next((key_of[alias] for alias in entry.aliases if alias in key_of), None)
        if key is None:
            missing.append(entry.name)
        source_keys[entry.name] = key
    if missing:
        raise ValueError(
            f"{path}: checkpoint is missing {len(missing)} parameter(s) the model needs: {', '.join(missing[:20])}"
        )
    buffers = {name: key_of[name] for name, _ in model.named_buffers() if name in key_of}
    unexpected = sorted(set(files) - set(source_keys.values()) - set(buffers.values()))
    if unexpected:
        warnings.warn(
            f"{path}: {len(unexpected)} checkpoint key(s) match no parameter and are ignored: {', '.join(unexpected[:20])}",
            stacklevel=3,
        )

    with ExitStack() as stack:
        handles = {}

        def handle(file):
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            return handles[file]

        entries = shard.unique_params()
        for entry in tqdm(entries, desc="Loading shards", disable=rank != 0, leave=False):
            key = source_keys[entry.name]
            file = files[key]
            shape = tuple(handle(file).get_slice(key).get_shape())
            if shape != entry.full_shape:
                raise ValueError(
                    f"{file}: tensor {key!r} has shape {shape}, but the model's {entry.name} expects {entry.full_shape}"
                )
            local = read_local(handle(file), key, entry.layout, rank).to(device=shard.mesh.device, dtype=dtype)
            old = model.get_parameter(entry.name)
            param = nn.Parameter(local, requires_grad=old.requires_grad)
            for alias in entry.aliases:
                _set_tensor(model, alias, param)
        for name, key in buffers.items():
            old = model.get_buffer(name)
            value = handle(files[key]).get_tensor(key)
            _set_tensor(
                model,
                name,
                value.to(device=shard.mesh.device, dtype=old.dtype if old.is_floating_point() else value.dtype),
            )
    return source_keys
