"""Training state as tiles of full tensors, so a checkpoint written at one layout resumes at any other.

Each rank holds pieces of every trainable parameter and of its optimizer state (TP and expert
shards, FSDP's rows of those, a pipeline stage's layers, whole copies on SP or replica ranks). A
piece is written with the box of the full tensor it is (``param_tiles``); a rank of any other
layout reads its own pieces back as the intersection of the boxes it needs with those saved
(``tiles.TiledTensor``), and one process can assemble whole tensors (``hf-parallel consolidate``
writes transformers' ``optimizer.pt`` from them). Optimizer state is matched to parameters by name,
the way weights are, so the order of ``param_groups`` may differ between layouts; only the groups'
membership must agree.

One safetensors file per rank (no pickle); its metadata says where every piece sits:

    {"params": {name: {"shape": [...], "group": 0, "tiles": [[[0, 64], [0, 96]], ...],
                       "states": {"param": "tiled", "exp_avg": "tiled", "step": "scalar"}}},
     "groups": [{"lr": ..., "betas": [...], ...}], "order": [name, ...]}     # optimizer order
"""

from __future__ import annotations

import functools
import itertools
import json

import torch

from ..adapters.seams import named_entries
from ..checkpoint.training_state import (
    ELEMENTWISE,
    LOCAL,
    PARAM,
    SCALAR,
    TILED,
    VALUE,
    SavedState,
    StateError,
    constant,
)
from ..core.tiles import Tile
from ..core.dtypes import SAFETENSORS_TO_TORCH
from ..compat.torch import fsdp_rows, fsdp_shard_dim
from ..state import parallel_model, parallel_state
from ..core.layout import Box, as_slices
from .clipping import local_tensor

def _segments(param, entry, mesh) -> list[list[tuple[int, int, int]]]:
    """Per dim of the rank's local tensor: (full start, local start, length) runs."""
    shape = tuple(param.shape)  # FSDP's DTensor: the TP shard's shape
    segments = [[(0, 0, n)] for n in shape]
    layout = entry.layout if entry is not None else None
    over = layout.over if layout is not None else "tp"  # (experts under ep_size: their EP rank's)
    if layout is not None and not layout.is_replicated:
        ranges = layout.ranges[mesh[over].rank]
        offsets = itertools.accumulate((stop - start for start, stop in ranges), initial=0)
        segments[layout.dim] = [(start, at, stop - start) for (start, stop), at in zip(ranges, offsets)]
    if hasattr(param, "to_local") and shape:  # FSDP's rows of the TP shard (of the EP shard over its replicas)
        fsdp, dim = mesh["ep_replicas" if over == "ep" else "fsdp"], fsdp_shard_dim(param)
        rows = fsdp_rows(shape[dim], local_tensor(param).shape[dim], fsdp.rank, fsdp.size)
        clipped = []
        for full, at, length in segments[dim]:
            low, high = max(at, rows.start), min(at + length, rows.stop)
            if low < high:
                clipped.append((full + low - at, low - rows.start, high - low))
        segments[dim] = clipped
    return segments


def param_tiles(model) -> dict[str, tuple[torch.nn.Parameter, tuple[int, ...], list[tuple[Box, Box]]]]:
    """Every trainable parameter this rank holds: name -> (parameter, full shape, [(box in the full
    tensor, box in this rank's local tensor)]). The name is the one the parameter was loaded under
    (the same at every layout; an adapter's, or the model's own for what hf_parallel did not place)."""
    model = parallel_model(model)  # under a peft wrapper: the names hf_parallel placed adapters by
    state = parallel_state(model)
    out = {}
    for name, param, entry in named_entries(model, state):
        if not param.requires_grad:
            continue
        key = entry.name if entry is not None else name
        full = tuple(entry.full_shape) if entry is not None else tuple(param.shape)
        tiles = [
            (tuple((f, f + n) for f, _, n in runs), tuple((at, at + n) for _, at, n in runs))
            for runs in itertools.product(*_segments(param, entry, state.mesh))
        ]
        out.setdefault(key, (param, full, tiles))  # a tied weight kept on two stages: one name
    return out


def optimizer_names(optimizer, tiles: dict) -> list[list[str]]:
    """The names of each group's parameters, in the optimizer's order (``tiles``: ``param_tiles``)."""
    names_of = {id(param): name for name, (param, _, _) in tiles.items()}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        unknown = [tuple(p.shape) for p in group["params"] if id(p) not in names_of]
        if unknown:
            raise StateError(
                f"the optimizer's group {index} holds {len(unknown)} tensor(s) that are no trainable parameter of the "
                f"model (shapes {unknown[:3]}): hf_parallel saves the state of the model's parameters"
            )
        groups.append([names_of[id(p)] for p in group["params"]])
    return groups


def optimizer_class(optimizer) -> str:
    """``torch.optim.AdamW``: the optimizer's class (inside accelerate's wrapper, which the Trainer uses)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    module = "torch.optim" if type(inner).__module__.startswith("torch.optim.") else type(inner).__module__
    return f"{module}.{type(inner).__name__}"


def _hyperparameters(group: dict) -> dict:
    """A group's settings (its parameters, and their names where the optimizer keeps them, are the reader's)."""
    values = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    try:
        json.dumps(values)
    except TypeError as error:
        raise StateError(f"an optimizer setting cannot be written as data (no pickle): {error}") from None
    return values


def state_file_contents(model, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's pieces: tensors under ``name::state::index`` and the metadata that places them."""
    tiles = param_tiles(model)
    groups = optimizer_names(optimizer, tiles) if optimizer is not None else []
    group_of = {name: index for index, names in enumerate(groups) for name in names}
    tensors, params = {}, {}
    for name, (param, full, boxes) in tiles.items():
        local = local_tensor(param.detach())
        values = {PARAM: local}
        if optimizer is not None:
            values.update(optimizer.state.get(param, {}))
        kinds, numbers = {}, {}
        for state_name, value in values.items():
            if isinstance(value, (bool, int, float)):  # transformers' Adafactor counts steps in Python
                kinds[state_name] = VALUE
                numbers[state_name] = value
                continue
            if not isinstance(value, torch.Tensor):
                raise StateError(f"{name}: optimizer state {state_name!r} is a {type(value).__name__}, not a tensor")
            value = local_tensor(value)
            if value.shape == local.shape:
                kinds[state_name] = TILED
                for index, (_, local_box) in enumerate(boxes):
                    tensors[f"{name}::{state_name}::{index}"] = value[as_slices(local_box)].contiguous()
            else:
                kinds[state_name] = SCALAR if value.dim() == 0 else LOCAL
                tensors[f"{name}::{state_name}::{kinds[state_name]}"] = value.contiguous()
        params[name] = {"shape": list(full), "group": group_of.get(name), "states": kinds, "values": numbers,
                        "tiles": [[list(r) for r in full_box] for full_box, _ in boxes]}  # fmt: skip
    metadata = {
        "params": params,
        "groups": [_hyperparameters(group) for group in optimizer.param_groups] if optimizer is not None else None,
        "order": [name for names in groups for name in names],
        "optimizer": optimizer_class(optimizer) if optimizer is not None else None,
    }
    return tensors, metadata


class PlainOptimizerState(SavedState):
    """transformers' ``optimizer.pt`` (one process's whole optimizer) and the checkpoint's weights,
    presented like a training-state save: every tensor one tile. Its state is by position, so
    positions are matched to this model's optimizer order, and every shape must agree. As written by
    one process, it is placed on this layout like any other layout's state."""

    def __init__(self, path: str | None, order: list[str], shapes: dict[str, tuple], weights: dict[str, object]):
        """``path``: the optimizer.pt (None: the weights only); ``weights``: name -> a safetensors slice
        of the parameter in the checkpoint."""
        self.layout, self.files, self.optimizer = "one process (optimizer.pt)", [path], None
        saved = {"state": {}, "param_groups": [{"params": list(range(len(order)))}]}
        if path is not None:
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        positions = [index for group in saved["param_groups"] for index in group["params"]]
        if len(positions) != len(order):
            raise StateError(
                f"{path} holds the state of {len(positions)} parameters and this model's optimizer has {len(order)}: "
                "written for another model, or another set of trainable parameters"
            )
        self.groups = [_hyperparameters(group) for group in saved["param_groups"]]
        group_of = {index: g for g, group in enumerate(saved["param_groups"]) for index in group["params"]}
        self.order, self.params, self._tiles, self._dtypes, self._single, self._boxes = list(order), {}, {}, {}, {}, {}
        for name, index in zip(order, positions):
            values = dict(saved["state"].get(index, {}))
            if name in weights:
                values[PARAM] = weights[name]
            states = {}
            for state_name, value in values.items():
                if not isinstance(value, torch.Tensor) and not hasattr(value, "get_shape"):  # a step count
                    states[state_name] = VALUE
                    self._single[(name, state_name)] = {0: functools.partial(constant, value)}
                    continue
                sliced = hasattr(value, "get_shape")
                value_shape = tuple(value.get_shape() if sliced else value.shape)
                if value_shape == tuple(shapes[name]):
                    states[state_name], box = TILED, tuple((0, n) for n in value_shape)
                    self._tiles[(name, state_name)] = {box: Tile(box, _slicer(value))}
                    dtype = SAFETENSORS_TO_TORCH[value.get_dtype()] if sliced else value.dtype
                    self._dtypes[(name, state_name)] = dtype
                elif not value_shape:
                    states[state_name] = SCALAR
                    self._single[(name, state_name)] = {0: functools.partial(constant, value)}
                else:
                    raise StateError(
                        f"{path}: parameter {index}'s {state_name!r} has shape {value_shape}, and this model's {name} "
                        f"at that position {tuple(shapes[name])}: another model or parameter order, or optimizer state "
                        "of a shape of its own (a factored moment), which cannot be resharded"
                    )
            self.params[name] = {"shape": list(shapes[name]), "group": group_of[index], "states": states}


def _slicer(value):
    return lambda box: value[as_slices(box)] if box else value[()]


def read_state(model, optimizer, saved: SavedState, here: str, on_stages: bool, weights: bool = True) -> None:
    """Fill the model's trainable parameters (``weights``) and ``optimizer`` (may be None) with this
    rank's pieces of ``saved``; every name and shape is checked before anything is written."""
    tiles = param_tiles(model)
    _check_params(tiles, saved, here, on_stages)
    groups = _check_optimizer(optimizer, tiles, saved, here) if optimizer is not None else None
    rank = parallel_state(parallel_model(model)).mesh.rank

    def local(name, state_name):
        param, _, boxes = tiles[name]
        return saved.read(name, state_name, boxes, tuple(local_tensor(param).shape), rank, here)

    loaded = None
    if optimizer is not None:  # read whole before anything is written: a refusal leaves both as they were
        loaded = _optimizer_state_dict(optimizer, groups, saved, local)
    if weights:
        with torch.no_grad():
            for name, (param, _, _) in tiles.items():
                local_tensor(param).copy_(local(name, PARAM))
    if loaded is None:
        return
    optimizer.load_state_dict(loaded)
    _moments_as_dtensors(optimizer)


def _check_params(tiles: dict, saved: SavedState, here: str, on_stages: bool) -> None:
    """Refuse a state of other trainable parameters, or of other full shapes, than this model's."""
    missing = sorted(tiles.keys() - saved.names())
    extra = sorted(saved.names() - tiles.keys()) if not on_stages else []  # a stage holds only its layers
    if missing or extra:
        raise StateError(
            f"the training state written at {saved.layout} is of other trainable parameters than this model's "
            f"({here}): "
            + "; ".join(f"{what}: {', '.join(names[:5])}" for what, names in (("not in it", missing),
                                                                              ("not in the model", extra)) if names)
        )  # fmt: skip
    for name, (_, full, _) in tiles.items():
        if tuple(saved.params[name]["shape"]) != full:
            raise StateError(
                f"{name}: {tuple(saved.params[name]['shape'])} in the training state written at {saved.layout}, {full} "
                f"in this model ({here})"
            )


def _check_optimizer(optimizer, tiles: dict, saved: SavedState, here: str) -> list[list[str]]:
    """Refuse saved optimizer state this optimizer cannot take (none, another class, one not resharded
    across layouts, other groups); return the optimizer's groups of parameter names."""
    groups = optimizer_names(optimizer, tiles)
    if saved.groups is None:
        raise StateError(f"the training state written at {saved.layout} holds no optimizer state")
    ours = optimizer_class(optimizer)
    if (saved.optimizer or ours) != ours:
        raise StateError(f"the state written at {saved.layout} is {saved.optimizer}'s, the optimizer is {ours}")
    if here != saved.layout and ours not in ELEMENTWISE:
        raise StateError(
            f"{ours}'s state written at {saved.layout} cannot be resharded to this model's {here}: hf_parallel "
            f"splits the state of torch.optim's elementwise optimizers ({', '.join(sorted(ELEMENTWISE))}) like "
            f"their parameters; resume at {saved.layout}"
        )
    if len(groups) != len(saved.groups):
        raise StateError(
            f"the optimizer has {len(groups)} parameter groups, the state written at {saved.layout} "
            f"{len(saved.groups)}"
        )
    for index, names in enumerate(groups):
        moved = [name for name in names if saved.params[name]["group"] != index]
        if moved:
            raise StateError(f"{', '.join(moved[:5])}: in group {index} here, another in the saved optimizer state")
    return groups


def _optimizer_state_dict(optimizer, groups: list[list[str]], saved: SavedState, local) -> dict:
    """The optimizer's ``state_dict`` with this rank's pieces of the saved state and the saved
    hyperparameters, read whole so that a refusal while reading leaves the optimizer as it was."""
    flat = [name for names in groups for name in names]
    loaded = optimizer.state_dict()
    states = {index: [s for s in saved.params[name]["states"] if s != PARAM] for index, name in enumerate(flat)}
    loaded["state"] = {i: {s: local(flat[i], s) for s in names} for i, names in states.items() if names}
    loaded["param_groups"] = [{**values, **{k: ours[k] for k in ("params", "param_names") if k in ours}}
                              for values, ours in zip(saved.groups, loaded["param_groups"])]  # fmt: skip
    return loaded


def _moments_as_dtensors(optimizer) -> None:
    """FSDP's parameters are DTensors, so must their moments be: wrap each state tensor shaped like
    its parameter's local slice (a state of a shape of its own stays as read)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if hasattr(param, "to_local") and param in optimizer.state:
                entry = optimizer.state[param]
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and not hasattr(value, "to_local") and (
                        value.shape == local_tensor(param).shape and value.dim()
                    ):
                        entry[key] = type(param).from_local(
                            value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                        )
