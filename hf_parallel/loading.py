"""Read each rank's slice of every tensor straight from safetensors, into a meta-built model.

Only ``layout.index(rank)`` is ever requested from ``get_slice``, never a whole sharded tensor;
``BYTES_READ`` counts what was requested so tests can prove it.

safetensors hands out slices as views of a private mmap of the whole file, faulted in lazily.
Where this rank's shard is one contiguous run of the file in the wanted dtype (row splits,
replicated tensors) the parameter *is* that view, as transformers does for a single process: no
copy, and the pages become resident only when used. Anything else (column splits of rowwise
weights, packed blocks, a dtype change) is copied into memory the model owns, through a
short-lived handle whose mapping closes at once: a view would stay non-contiguous for every matmul
and pin every page of the full tensor in the rank's RSS.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from contextlib import ExitStack

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from .keys import param_names_for_keys
from .layout import replicated
from .parallelize import ShardPlan

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BYTES_READ: Counter = Counter()  # checkpoint key -> bytes requested by this process


class CheckpointError(ValueError):
    """A checkpoint on disk is malformed; the message names the file (and key) at fault."""


def file_keys(file: str) -> list[str]:
    """The tensor names in one safetensors file, whose header safetensors validates (JSON, offsets
    inside the file, no overlaps)."""
    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: not a valid safetensors file: {error}") from None


def _index_files(path: str, index: str) -> dict[str, str]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index}: not a safetensors index ({type(error).__name__}: {error})") from None
    root = os.path.realpath(path)
    files = {}
    for key, name in weight_map.items():
        file = os.path.realpath(os.path.join(root, name)) if isinstance(name, str) else None
        if file is None or os.path.isabs(name) or os.path.dirname(file) != root:
            raise CheckpointError(f"{index}: {key!r} points to {name!r}, outside the checkpoint directory; refused")
        if not os.path.isfile(file):
            raise CheckpointError(f"{index}: {key!r} is in {name!r}, which does not exist")
        files[key] = file
    return files


def checkpoint_files(path: str) -> dict[str, str]:
    """Checkpoint key -> absolute file path, from the index or the single safetensors file.

    Every file's header is checked up front: each key must live in exactly one file, the one the
    index names, so a corrupt or inconsistent checkpoint fails before any weight is read."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        files = _index_files(path, index)
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        single = os.path.join(path, SINGLE_FILE)
        return dict.fromkeys(file_keys(single), single)
    else:
        raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (hf_parallel loads safetensors checkpoints)")
    found: dict[str, str] = {}
    for file in sorted(set(files.values())):
        for key in file_keys(file):
            if key in found:
                raise CheckpointError(f"{path}: tensor {key!r} is in both {found[key]} and {file}")
            found[key] = file
    for key, file in files.items():
        if found.get(key) != file:
            raise CheckpointError(f"{index}: {key!r} is said to be in {file}, but that file does not hold it")
    return files


class ShardReader:
    """Reads this rank's shard of each tensor; keeps one mapping per file for zero-copy views."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self._stack = ExitStack()
        self._handles = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()  # views handed out keep their mapping alive on their own

    def _shared(self, file: str):
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        return self._handles[file]

    def read(self, file: str, key: str, layout, dtype=None, expect: tuple[str, tuple] | None = None) -> torch.Tensor:
        """This rank's shard of ``key``: its layout's slices, concatenated along the split dim.
        ``expect`` is (parameter name, full shape) to check the checkpoint against."""
        tensor_slice = self._shared(file).get_slice(key)
        full_shape = tuple(tensor_slice.get_shape())
        if expect is not None and full_shape != tuple(expect[1]):
            raise ValueError(
                f"{file}: tensor {key!r} has shape {full_shape}, but the model's {expect[0]} expects {expect[1]}"
            )
        index = layout.index(full_shape, self.rank)
        if len(index) == 1 and self.device.type == "cpu":
            view = tensor_slice[index[0]]
            if view.is_contiguous() and dtype in (None, view.dtype):
                BYTES_READ[key] += view.numel() * view.element_size()
                return view
        with safe_open(file, framework="pt") as handle:  # its own mapping: released on return
            tensor_slice = handle.get_slice(key)
            pieces = [tensor_slice[i] for i in index]
            BYTES_READ[key] += sum(p.numel() * p.element_size() for p in pieces)
            shape = layout.local_shape(full_shape, self.rank)
            out = torch.empty(shape, dtype=dtype or pieces[0].dtype, device=self.device)
            if len(pieces) == 1:
                return out.copy_(pieces[0])
            offset = 0
            for piece in pieces:
                out.narrow(layout.dim, offset, piece.shape[layout.dim]).copy_(piece)
                offset += piece.shape[layout.dim]
            return out


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

    with ShardReader(rank, shard.mesh.device) as reader:
        for entry in tqdm(shard.unique_params(), desc="Loading shards", disable=rank != 0, leave=False):
            key = source_keys[entry.name]
            local = reader.read(files[key], key, entry.layout, dtype, expect=(entry.name, entry.full_shape))
            old = model.get_parameter(entry.name)
            param = nn.Parameter(local, requires_grad=old.requires_grad)
            for alias in entry.aliases:
                _set_tensor(model, alias, param)
        for name, key in buffers.items():
            old = model.get_buffer(name)
            keep_dtype = old.dtype if old.is_floating_point() else None
            _set_tensor(model, name, reader.read(files[key], key, replicated(1), keep_dtype))
    return source_keys
