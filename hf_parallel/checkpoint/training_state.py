"""Training state on disk, as files: each rank's pieces of every trainable parameter and its optimizer
state with the boxes of the full tensors they are (written by ``training/state_tiles.py``), read back as any
box at any layout, or assembled whole into transformers' one-process ``optimizer.pt`` (``hf-parallel
consolidate``). Nothing here needs a model or a process group.

One safetensors file per rank (no pickle); its metadata says where every piece sits:

    {"params": {name: {"shape": [...], "group": 0, "tiles": [[[0, 64], [0, 96]], ...],
                       "states": {"param": "tiled", "exp_avg": "tiled", "step": "scalar"}}},
     "groups": [{"lr": ..., "betas": [...], ...}], "order": [name, ...]}     # optimizer order
"""

from __future__ import annotations

import functools
import json
import os
from typing import Callable

import torch
from safetensors import safe_open

from ..core.dtypes import SAFETENSORS_TO_TORCH
from ..core.layout import Box, as_slices
from ..core.tiles import Tile, TiledTensor
from .files import TRAINING_STATE_PREFIX, training_state_file

# how a state value is stored: pieces of the full tensor; a 0-dim tensor or a Python number (a step
# count) each rank keeps; a tensor shaped otherwise than its parameter (only the rank that wrote it reads it)
TILED, SCALAR, VALUE, LOCAL = "tiled", "scalar", "value", "local"
PARAM = "param"  # the parameter's own value, beside its optimizer state
METADATA_KEY = "hf_parallel.training_state"
LAYOUT_KEY = "layout"  # in each rank's file: the layout whose ranks wrote it
# optimizers whose every state tensor shaped like its parameter is elementwise, so it splits like the
# parameter (a preconditioner of a square matrix is shaped like it too, and must not be resharded)
ELEMENTWISE = frozenset(f"torch.optim.{name}" for name in (
    "Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adafactor",
))  # fmt: skip


class StateError(ValueError):
    """Training state that cannot be read into this model and optimizer: what and why, by name."""



OPTIMIZER_FILE = "optimizer.pt"  # transformers' one-process optimizer state (torch.save)


def state_files(directory: str) -> list[str]:
    """The per-rank files in ``directory``, in rank order (empty: there are none)."""
    found = sorted(name for name in os.listdir(directory) if name.startswith(TRAINING_STATE_PREFIX))
    if not found:
        return []
    world = int(found[0].rpartition("-of-")[2].split(".")[0])
    files = [os.path.join(directory, training_state_file(rank, world)) for rank in range(world)]
    absent = [os.path.basename(file) for file in files if not os.path.isfile(file)]
    if absent:
        raise StateError(f"{directory}: the training state of {world} ranks lacks {', '.join(absent[:4])}")
    return files


def written_layout(directory: str) -> str | None:
    """The layout whose ranks wrote the training state in ``directory`` (None: hf_parallel wrote none)."""
    files = state_files(directory) if os.path.isdir(directory) else []
    if not files:
        return None
    with safe_open(files[0], "pt") as saved:
        return (saved.metadata() or {}).get(LAYOUT_KEY, f"{len(files)} ranks")


class SavedState:
    """Every rank file of a training-state save: each name's pieces, readable as any box of the full
    tensor at any layout; ``layout``: the layout that wrote it."""

    def __init__(self, files: list[str]):
        self.layout, self.files = None, files
        self.params: dict[str, dict] = {}
        self.order: list[str] = []
        self.groups = None
        self._tiles: dict[tuple[str, str], dict[Box, Tile]] = {}
        self._dtypes: dict[tuple[str, str], torch.dtype] = {}
        self._single: dict[tuple[str, str], dict[int, Callable[[], object]]] = {}  # SCALAR, VALUE, LOCAL by rank
        self._boxes: dict[tuple[str, int], list] = {}  # (name, rank) -> the full-tensor boxes that rank wrote
        for rank, file in enumerate(files):
            handle = safe_open(file, "pt")
            metadata = handle.metadata() or {}
            self.layout = self.layout or metadata.get(LAYOUT_KEY, f"{len(files)} ranks")
            found = metadata.get(METADATA_KEY)
            if found is None:
                raise StateError(
                    f"{file}: training state of an earlier hf_parallel (its optimizer state in optimizer-rank-*.pt), "
                    "which only the version that wrote it resumes, at the layout that wrote it"
                )
            metadata = json.loads(found)
            self.optimizer = metadata["optimizer"]
            if self.groups is None and metadata["groups"] is not None:  # JSON has no tuples (betas)
                self.groups = [{k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}
                               for group in metadata["groups"]]  # fmt: skip
            self.order += [name for name in metadata["order"] if name not in self.order]
            for name, saved in metadata["params"].items():
                known = self.params.setdefault(name, saved)
                if known["shape"] != saved["shape"] or known["states"] != saved["states"]:
                    raise StateError(f"{file}: {name!r} disagrees with another rank's file about its shape or state")
                self._boxes[(name, rank)] = saved["tiles"]
                for state_name, kind in saved["states"].items():
                    if kind == TILED:
                        pieces = self._tiles.setdefault((name, state_name), {})
                        for index, box in enumerate(saved["tiles"]):
                            key, box = f"{name}::{state_name}::{index}", tuple(tuple(r) for r in box)
                            self._dtypes[(name, state_name)] = SAFETENSORS_TO_TORCH[handle.get_slice(key).get_dtype()]
                            if box not in pieces:  # a piece held by several ranks is read from the first
                                pieces[box] = Tile(box, _reader(handle, key))
                    elif kind == VALUE:
                        read = functools.partial(constant, saved["values"][state_name])
                        self._single.setdefault((name, state_name), {})[rank] = read
                    else:
                        read = functools.partial(handle.get_tensor, f"{name}::{state_name}::{kind}")
                        self._single.setdefault((name, state_name), {})[rank] = read

    def names(self) -> set[str]:
        return set(self.params)

    def read(self, name: str, state_name: str, boxes: list[tuple[Box, Box]], local_shape, rank: int, here: str):
        """``name``'s ``state_name`` as rank ``rank`` of layout ``here`` holds it: its local tensor
        (``local_shape``), the saved pieces placed at ``boxes`` (full-tensor box, local box)."""
        kind = self.params[name]["states"][state_name]
        placed_alike = here == self.layout and self._boxes.get((name, rank)) == [
            [list(r) for r in full_box] for full_box, _ in boxes
        ]  # this rank holds what the same rank wrote
        if kind == LOCAL and not placed_alike:
            raise StateError(
                f"{name}: optimizer state {state_name!r} has a shape of the optimizer's own, not the parameter's "
                f"(a factored second moment?), so the state written at {self.layout} cannot be resharded to this "
                f"model's {here}: resume at {self.layout} with the same plan"
            )
        if kind in (SCALAR, VALUE, LOCAL):
            if placed_alike:
                return self._single[(name, state_name)][rank]()
            kept = [read() for read in self._single[(name, state_name)].values()]
            if any(not _equal(value, kept[0]) for value in kept[1:]):
                raise StateError(
                    f"{name}: optimizer state {state_name!r} differs between the ranks that wrote it at {self.layout}, "
                    f"so it cannot be placed on this model's {here}: resume at {self.layout} with the same plan"
                )
            return kept[0]
        dtype = self._dtypes[(name, state_name)]
        full = TiledTensor(f"{name} {state_name}", self.params[name]["shape"], dtype,
                           list(self._tiles[(name, state_name)].values()))  # fmt: skip
        out = torch.empty(local_shape, dtype=dtype)
        for full_box, local_box in boxes:
            out[as_slices(local_box)] = full.read(full_box)
        return out


def constant(value):
    return value


def _equal(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def _reader(handle, key: str):
    def read(box: Box) -> torch.Tensor:
        return handle.get_slice(key)[as_slices(box)] if box else handle.get_tensor(key)

    return read


def full_optimizer_state(saved: SavedState) -> dict:
    """The whole optimizer state as one process's ``optimizer.state_dict()`` (for transformers'
    ``optimizer.pt``): parameters in the saved optimizer's order, groups as saved."""
    if saved.groups is None:
        raise StateError(f"the training state written at {saved.layout} holds no optimizer state")
    if saved.optimizer not in ELEMENTWISE:
        raise StateError(
            f"{saved.optimizer}'s state written at {saved.layout} cannot be assembled whole: hf_parallel does that "
            f"for torch.optim's elementwise optimizers ({', '.join(sorted(ELEMENTWISE))})"
        )
    by_group = [[name for name in saved.order if saved.params[name]["group"] == g] for g in range(len(saved.groups))]
    flat = [name for names in by_group for name in names]
    state = {}
    for index, name in enumerate(flat):
        full = tuple(saved.params[name]["shape"])
        box = tuple((0, n) for n in full)
        entry = {s: saved.read(name, s, [(box, box)], full, 0, "one process") for s in saved.params[name]["states"]
                 if s != PARAM}  # fmt: skip
        if entry:
            state[index] = entry
    groups, at = [], 0
    for values, names in zip(saved.groups, by_group):
        groups.append({**values, "params": list(range(at, at + len(names)))})
        at += len(names)
    return {"state": state, "param_groups": groups}


def write_full_optimizer(src: str, out_file: str) -> bool:
    """transformers' ``optimizer.pt`` (whole tensors, one process) from the training state in ``src``,
    written to ``out_file``; False when ``src`` has none."""
    files = state_files(src)
    if not files:
        return False
    torch.save(full_optimizer_state(SavedState(files)), out_file)
    return True
