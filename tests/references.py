"""One process's results, computed once a test session and read from disk by every rank that compares with them.

A worker that checks a parallel model against one process used to run that process's model itself, on every
rank of every group: four ranks of the real SmolLM2 paid its load, five forward and backward passes and a
generate four times over on two cores, and again for each layout. ``one_process(key, compute)`` runs
``compute()`` in the first process that asks (the others wait on a file lock, idle) and writes its tensors as
safetensors under ``$HF_PARALLEL_TEST_REFERENCES`` (a session folder tests/conftest.py makes); every process
then reads them lazily, a tensor at a time, so a rank holds only the one it compares. The numbers are the
ones each rank computed before: the same code, on one thread, in a process started the same way. Outside
the suite (the variable unset) ``compute()`` just runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT_ENV = "HF_PARALLEL_TEST_REFERENCES"
NONE = "names_without_a_tensor"  # metadata: the keys whose value is None (a parameter without a gradient)


class Stored(Mapping):
    """A reference's tensors by key, each read from its file when asked for; ``under(prefix)``: the keys under
    ``prefix``, without it."""

    def __init__(self, tensors: dict | None = None, path: str | None = None, prefix: str = "", file=None):
        self.tensors, self.path, self.prefix = tensors, path, prefix
        self.file = file if file is not None or path is None else safe_open(path, framework="pt")  # one mapping
        self.stored = set(tensors) if path is None else set(self.file.keys())
        names = self.stored if path is None else self.stored | set(json.loads(self.file.metadata()[NONE]))
        self.names = {name for name in names if name.startswith(prefix)}

    def under(self, prefix: str) -> Stored:
        return Stored(self.tensors, self.path, self.prefix + prefix, self.file)

    def __getitem__(self, key: str) -> torch.Tensor | None:
        key = self.prefix + key
        if self.path is None:
            return self.tensors[key]
        if key not in self.names:
            raise KeyError(key)
        return self.file.get_tensor(key) if key in self.stored else None

    def __iter__(self):
        return (name[len(self.prefix) :] for name in self.names)

    def __len__(self) -> int:
        return len(self.names)


def _write(path: str, tensors: dict) -> None:
    """Every tensor as its own storage (safetensors refuses shared ones: a tied weight's gradient is one
    tensor under two names), None values named in the metadata; written aside, then moved into place."""
    seen, own = set(), {}
    for key, value in tensors.items():
        if value is None:
            continue
        value = value.detach()
        own[key] = value.clone() if value.data_ptr() in seen else value.contiguous()
        seen.add(value.data_ptr())
    nones = [key for key, value in tensors.items() if value is None]
    save_file(own, path + ".partial", metadata={NONE: json.dumps(nones)})
    os.replace(path + ".partial", path)


def one_process(key: str, compute) -> Mapping:
    """``compute()`` (a dict of tensors or None, by key) once a session for ``key``, read from disk after."""
    root = os.environ.get(ROOT_ENV)
    if not root:
        return Stored(compute())
    path = os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:20] + ".safetensors")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one computes; the others wait here, then read what it wrote
        if not os.path.exists(path):
            _write(path, compute())
    return Stored(path=path)
