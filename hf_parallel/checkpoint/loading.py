"""Read each rank's slice of every tensor straight from safetensors, into a meta-built model.

Only ``layout.index(rank)`` is ever requested from ``get_slice``, never a whole sharded tensor;
``BYTES_READ`` counts what was requested so tests can prove it.

safetensors hands out slices as views of a private mmap of the whole file, faulted in lazily.
Where this rank's shard is one contiguous run of the file in the wanted dtype (row splits,
replicated tensors) the parameter *is* that view, as transformers does for a single process: no
copy, and the pages become resident only when used. Anything else (column splits of rowwise
weights, packed blocks, a dtype change) is copied into memory the model owns (on transparent huge
pages where offered: ``hugepages.py``), through a short-lived handle whose mapping closes at once:
a view would stay non-contiguous for every matmul and pin every page of the full tensor in the
rank's RSS.

Under FSDP/HSDP the model is sharded while still empty (``shard_shapes_on_meta``, then ``fully_shard``)
and the load fills each parameter's FSDP shard in place (``into_shards``): a rank reads its TP slice of
one tensor at a time on the host and copies only the rows FSDP keeps to its device, so what it holds
on the device is its share of the weights, never its whole TP shard (a 70B model loads at FSDP=8).

Pickled ``pytorch_model.bin`` checkpoints can run code when unpickled, so they are refused unless
the caller passes ``allow_pickle=True``; even then they go through ``torch.load(weights_only=True)``
(memory-mapped, so a rank still only touches the pages of its own slices) and are always copied.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from contextlib import ExitStack

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from ..compat.torch import fsdp_rows, fsdp_shard_dim
from ..compat.transformers import unexpected_key_patterns
from ..distributed.devices import host_staging, pinned_ring
from ..quant.kept import KeptWeight, placeholder
from ..core.layout import as_slices, replicated
from ..tensor.parallelize import ModelLayout
from . import hugepages
from ..core.errors import CheckpointError
from .files import INDEX_FILE, MANIFEST_FILE, PICKLE_FILE, PICKLE_INDEX_FILE, SINGLE_FILE
from .keys import FusedSource, checkpoint_sources, expert_shape
from .manifest import DistributedCheckpoint
from .pickle_file import PickleFile
from .same_files import check_same_checkpoint
from ..quant.formats import (
    PARTS,
    Quantization,
    activation_scale,
    companion_keys,
    dequantized_sources,
    readable,
    with_stored_keys,
)
from ..quant.base import Dequantized
from ..quant.scaled_fp8 import DequantizedFP8
from ..core.tiles import Tile, TiledTensor
from ..core.dtypes import nbytes, torch_dtype

BYTES_READ: Counter = Counter()  # checkpoint key -> bytes requested by this process


def file_keys(file: str) -> list[str]:
    """The tensor names in one checkpoint file. safetensors validates its header (JSON, offsets
    inside the file, no overlaps); a pickle must unpickle under ``weights_only`` to a dict of tensors."""
    if file.endswith(".bin"):
        return list(PickleFile(file).tensors)
    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: not a valid safetensors file: {error}") from None


def _is_floating(dtype) -> bool:
    """For a torch dtype or a safetensors dtype code ("F32", "BF16", "F8_E4M3", "I64", "BOOL")."""
    return dtype.is_floating_point if isinstance(dtype, torch.dtype) else dtype.startswith(("F", "BF"))


def _index_files(path: str, index: str) -> dict[str, str]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index}: not a checkpoint index ({type(error).__name__}: {error})") from None
    root = os.path.realpath(path)
    files = {}
    for key, name in weight_map.items():
        valid = isinstance(name, str) and "\0" not in name
        file = os.path.realpath(os.path.join(root, name)) if valid else None
        if file is None or os.path.isabs(name) or os.path.dirname(file) != root:
            raise CheckpointError(f"{index}: {key!r} points to {name!r}, outside the checkpoint directory; refused")
        if not os.path.isfile(file):
            raise CheckpointError(f"{index}: {key!r} is in {name!r}, which does not exist")
        files[key] = file
    return files


def checkpoint_files(path: str, allow_pickle: bool = False) -> dict[str, str]:
    """Checkpoint key -> absolute file path, from the index or the single checkpoint file.

    Every file's header is checked up front: each key must live in exactly one file, the one the
    index names, so a corrupt or inconsistent checkpoint fails before any weight is read.
    safetensors is preferred; pickles are used only with ``allow_pickle`` (and refused by name without).
    A distributed save's manifest (its rank files checked on opening) maps every key to itself."""
    manifest = os.path.join(path, MANIFEST_FILE)
    if os.path.isfile(manifest):
        return dict.fromkeys(DistributedCheckpoint(manifest).keys(), manifest)
    for index_name, single_name in ((INDEX_FILE, SINGLE_FILE), (PICKLE_INDEX_FILE, PICKLE_FILE)):
        index, single = os.path.join(path, index_name), os.path.join(path, single_name)
        if os.path.isfile(index) or os.path.isfile(single):
            break
    else:
        raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (nor a {PICKLE_FILE})")
    if single_name == PICKLE_FILE and not allow_pickle:
        raise CheckpointError(
            f"{path}: only a pickle checkpoint ({os.path.basename(index if os.path.isfile(index) else single)}) is "
            "there, and unpickling can run arbitrary code. Pass allow_pickle=True to load it anyway (with "
            "torch.load(weights_only=True)), or convert it to safetensors"
        )
    if not os.path.isfile(index):
        return dict.fromkeys(file_keys(single), single)
    files = _index_files(path, index)
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

    def __init__(self, ranks: dict[str, int], device: torch.device):
        self.ranks, self.device = ranks, device  # this rank's index in each dimension a layout is written over
        self.rank = ranks["tp"]
        self._stack = ExitStack()
        self._handles = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()  # views handed out keep their mapping alive on their own

    def _shared(self, file: str):
        if file not in self._handles:
            if file.endswith(".bin"):
                opened = PickleFile(file)
            elif file.endswith(MANIFEST_FILE):
                opened = DistributedCheckpoint(file)
            else:
                opened = self._stack.enter_context(safe_open(file, framework="pt"))
            self._handles[file] = opened
        return self._handles[file]

    def check(self, file: str, key: str, name: str, shape: tuple, dtype: torch.dtype, tensor_slice=None) -> None:
        """The checkpoint's header agrees with the model's parameter ``name`` (reads no data)."""
        tensor_slice = tensor_slice if tensor_slice is not None else self._shared(file).get_slice(key)
        found = tuple(tensor_slice.get_shape())
        if found != tuple(shape):
            raise CheckpointError(
                f"{file}: tensor {key!r} has shape {found}, but the model's {name} expects {tuple(shape)}"
            )
        if _is_floating(tensor_slice.get_dtype()) != dtype.is_floating_point:
            raise CheckpointError(
                f"{file}: tensor {key!r} is {tensor_slice.get_dtype()}, but the model's {name} is {dtype}; "
                "refusing to cast between integer and floating point"
            )

    def read(self, file: str, key: str, layout, dtype=None) -> torch.Tensor:
        """This rank's shard of ``key``: its layout's slices, concatenated along the split dim."""
        handle = self._shared(file)
        tensor_slice = handle.get_slice(key)
        full_shape = tuple(tensor_slice.get_shape())
        index = layout.index(full_shape, self.ranks[layout.over])
        if isinstance(handle, PickleFile):  # always copied: a view would keep the whole pickle mapped
            return self._copy(key, layout, tensor_slice, full_shape, dtype)
        if isinstance(handle, DistributedCheckpoint):  # saved at this world size: the rank's own file
            own = tensor_slice.saved_as(layout, self.ranks[layout.over])
            return self.read_tiled(tensor_slice, key, layout, dtype, own=own)
        if len(index) == 1 and self.device.type == "cpu" and self._as_is(key, view := tensor_slice[index[0]], dtype):
            return view
        with safe_open(file, framework="pt") as handle:  # its own mapping: released on return
            return self._copy(key, layout, handle.get_slice(key), full_shape, dtype)

    def read_tiled(self, tiled: TiledTensor, key: str, layout, dtype=None, own=None) -> torch.Tensor:
        """This rank's shard of a tensor stored as tiles: a single contiguous piece as is (a view of
        its file), else the pieces copied into one owned tensor."""
        full_shape = tuple(tiled.get_shape())
        index = layout.index(full_shape, self.ranks[layout.over])
        if isinstance(tiled, Dequantized):
            tiled = tiled.on(self.device)
        piece = own if own is not None else tiled[index[0]] if len(index) == 1 else None
        if piece is not None and self._as_is(key, piece, dtype):
            return piece
        return self._copy(key, layout, tiled, full_shape, dtype, piece)

    def _as_is(self, key: str, piece: torch.Tensor, dtype) -> bool:
        """Whether ``piece`` can be the parameter itself (no copy): contiguous, in the wanted dtype, on
        CPU. If so it counts as read."""
        usable = self.device.type == "cpu" and piece.is_contiguous() and dtype in (None, piece.dtype)
        if usable:
            BYTES_READ[key] += piece.numel() * piece.element_size()
        return usable

    def fused(self, files: dict[str, str], name: str, headers: list, full_shape, quantization=None):
        """The fused expert parameter ``name`` (a ``TiledTensor``) as tiles of its per-expert keys
        (``headers``: (key, its box, its slice as ``readable`` gives it) each), each checked (quantized ones
        dequantized as read, ``quantization`` the config's). Tiles
        read through this parameter's own mappings, released with it once its shard is assembled
        (through the reader's shared ones, every expert page read would stay resident to the end)."""
        tiles, dtype, opened = [], None, {}

        def handle(file):
            if file.endswith(MANIFEST_FILE):  # per-expert keys of a per-rank save (a model kept quantized)
                return self._shared(file)
            if file not in opened:
                opened[file] = safe_open(file, framework="pt")
            return opened[file]

        for key, box, tensor_slice in headers:
            found, want = tuple(tensor_slice.get_shape()), expert_shape(box)
            found_dtype = torch_dtype(tensor_slice.get_dtype())
            if found != want or found_dtype != (dtype or found_dtype):
                raise CheckpointError(
                    f"{files[key]}: expert tensor {key!r} is {found_dtype} {found}, but {name} needs "
                    f"{dtype or found_dtype} {want} per expert block"
                )
            dtype = found_dtype

            def read(sub, key=key):
                return readable(handle, files, key, quantization)[as_slices(sub[1:])].unsqueeze(0)

            tiles.append(Tile(box, read))
        return TiledTensor(name, full_shape, dtype, tiles)

    def _copy(self, key: str, layout, source, full_shape, dtype, piece=None) -> torch.Tensor:
        """This rank's pieces of ``source`` (a safetensors slice, or tiles) copied into one owned
        tensor on this rank's device (``Layout.extract``); ``piece``: its one piece, already read. For
        an accelerator the pieces cross pinned host memory in the file's dtype (on CUDA a few reused
        chunks: ``devices.PinnedRing``), copied without waiting and cast there; a quantized weight's come
        dequantized on the device already."""
        shape = layout.local_shape(full_shape, self.ranks[layout.over])
        found = piece.dtype if piece is not None else torch_dtype(source.get_dtype())
        BYTES_READ[key] += nbytes(shape, found)
        out = hugepages.empty(shape, dtype or found, self.device)
        on_device = piece.device == self.device if piece is not None else isinstance(source, Dequantized)
        ring = None if on_device else pinned_ring(self.device)
        if ring is not None:
            if piece is not None:
                return ring.copy_(out, piece)
            rank = self.ranks[layout.over]
            return ring.load(out, found, lambda into: layout.extract(source, rank, shape=full_shape, out=into))
        staged = None if on_device else host_staging(shape, found, self.device)  # (dequantized there: no staging)
        into = out if staged is None else staged
        if piece is not None:
            into.copy_(piece)
        else:
            layout.extract(source, self.ranks[layout.over], shape=full_shape, out=into)
        return out if staged is None else out.copy_(staged, non_blocking=True)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    setattr(module, attr, value)  # a registered buffer's name stays a buffer


def _sources(model: nn.Module, path: str, layout: ModelLayout, files: dict, ignore_keys, quantization) -> tuple:
    """Every parameter's checkpoint key (or per-expert keys), and the buffers' found in the checkpoint;
    a parameter with none is an error, and so is a key nothing reads (but those transformers itself
    ignores for the model: ``unexpected_key_patterns``, and a task head's when a base model is loaded from
    its checkpoint, as transformers does), each named."""
    key_of, fused_of = checkpoint_sources(model, files)
    sources, missing, aliases = {}, [], set()
    for entry in layout.unique_params():
        found = [key_of.get(alias) or fused_of.get(alias) for alias in entry.aliases]
        sources[entry.name] = next((source for source in found if source is not None), None)
        aliases.update(key for source in found if source is not None for key in _keys_of(source))  # tied copies
        if sources[entry.name] is None:
            missing.append(entry.name)
    if missing:
        raise CheckpointError(
            f"{path}: checkpoint is missing {len(missing)} parameter(s) the model needs: {', '.join(missing[:20])}"
        )
    buffers = {name: key_of[name] for name, _ in model.named_buffers() if name in key_of}
    used = aliases | set(buffers.values())
    mine = {other for key in used for other in companion_keys(key, quantization)} & set(files)  # scales, ...
    elsewhere = {other for key in ignore_keys for other in companion_keys(key, quantization)}  # other stages'
    ignored, prefix = unexpected_key_patterns(model), getattr(model, "base_model_prefix", "")
    heads = prefix and not hasattr(model, prefix) and any(key.startswith(prefix + ".") for key in files)
    unexpected = sorted(  # heads: a base model from a task model's checkpoint ignores the head's keys
        key for key in set(files) - used - ignore_keys - mine - elsewhere
        if not (ignored and ignored.search(key)) and not (heads and not key.startswith(prefix + "."))
    )  # fmt: skip
    stray = [key for key in unexpected if key.endswith(PARTS)]
    if stray and quantization is None:
        raise CheckpointError(
            f"{path}: {stray[0]!r} (and {len(stray) - 1} more) are parts of quantized weights (scales, packed values), "
            "and its config has no quantization_config: those weights would load without them, wrong"
        )
    if unexpected:
        raise CheckpointError(
            f"{path}: {len(unexpected)} checkpoint key(s) match no parameter or buffer of {type(model).__name__} "
            f"(a tensor no model class reads would be dropped silently): {', '.join(unexpected[:20])}; load it with "
            "the class it was saved from, or remove the keys from the checkpoint"
        )
    return sources, buffers, mine


def shard_shapes_on_meta(model: nn.Module, layout: ModelLayout, dtype: torch.dtype) -> None:
    """Every parameter replaced by an empty (meta) one of this rank's TP shape, in the dtype the load
    reads: the model FSDP shards before any weight is read (``load_weights(into_shards=True)`` fills it).
    Tied names keep sharing one parameter. Returns None: no checkpoint key is read yet."""
    for entry in layout.unique_params():
        old = model.get_parameter(entry.name)
        shape = entry.layout.local_shape(entry.full_shape, layout.mesh[entry.layout.over].rank)
        held = dtype if old.is_floating_point() else old.dtype  # (as the load reads: floats in ``dtype``)
        param = nn.Parameter(torch.empty(shape, dtype=held, device="meta"), requires_grad=old.requires_grad)
        for alias in entry.aliases:
            _set_tensor(model, alias, param)


def materialise_shards(model: nn.Module, device: torch.device) -> None:
    """Storage on ``device`` for every parameter still on meta (FSDP's shards after ``fully_shard``; FSDP
    re-reads them at its lazy init): ``to_empty`` that leaves real tensors (buffers, RoPE tables) alone."""
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


def _fill_shard(param: nn.Parameter, local: torch.Tensor, fsdp) -> None:
    """Copy the rows of ``local`` (this rank's TP slice, on the host) that FSDP keeps on this rank into
    ``param``'s shard (its DTensor's local tensor, on the device; rows along the dim FSDP shards it on)."""
    shard = param.to_local() if hasattr(param, "to_local") else param
    if shard is not param:
        dim = fsdp_shard_dim(param)
        rows = fsdp_rows(local.shape[dim], shard.shape[dim], fsdp.rank, fsdp.size)
        local = local.narrow(dim, rows.start, rows.stop - rows.start)
    ring = pinned_ring(shard.device)  # (on CUDA: through the reused pinned chunks)
    if ring is not None:
        ring.copy_(shard, local)
    else:
        shard.copy_(local)


def load_weights(
    model: nn.Module,
    path: str,
    layout: ModelLayout,
    dtype: torch.dtype,
    allow_pickle: bool = False,
    ignore_keys: set[str] = frozenset(),
    files: dict[str, str] | None = None,
    quantization: Quantization | None = None,
    kept: dict | None = None,
    into_shards: bool = False,
) -> dict[str, str | FusedSource]:
    """Fill every parameter (and persistent buffer found in the checkpoint) with its local shard.

    Returns parameter name -> checkpoint key (or the per-expert keys of a fused expert parameter),
    and buffer name -> key for the buffers read, which saving uses to write the source's names and form.
    ``ignore_keys``: keys another pipeline stage reads (neither read here nor unexpected).
    ``files``: ``checkpoint_files(path, allow_pickle)``, when the caller has it already.
    ``quantization``: the config's (``quantized.read_quantization``): its weights dequantized as read, or,
    given ``kept`` (a dict filled here), each rank's slices of them kept as stored (``tensor/kept.py``).
    ``into_shards``: the parameters are FSDP's (sharded on meta, then ``materialise_shards``): each is filled
    in place with its rows, read on the host one tensor at a time."""
    if into_shards and kept is not None:
        raise ValueError("load_weights: weights kept quantized are never FSDP's (refused before the load)")
    files = with_stored_keys(files if files is not None else checkpoint_files(path, allow_pickle), quantization)
    check_same_checkpoint(path, files, layout.mesh)
    rank = layout.mesh.tp.rank
    sources, buffers, companions = _sources(model, path, layout, files, ignore_keys, quantization)
    ranks = {over: layout.mesh[over].rank for over in ("tp", "ep")}
    with ShardReader(ranks, torch.device("cpu") if into_shards else layout.mesh.device) as reader:
        saved_as, manifest = sources, os.path.join(path, MANIFEST_FILE)
        if os.path.isfile(manifest):  # a distributed save records the per-expert form it came from
            fused_from = reader._shared(manifest).fused
            saved_as = {name: fused_from.get(source, source) for name, source in sources.items()}
        tiled = dequantized_sources(files, sources, lambda file: reader._shared(file), quantization)
        quantized = _check_headers(model, path, layout, files, sources, tiled, reader, quantization, kept is not None)
        _check_claimed(path, companions, quantized.values())
        for entry in tqdm(layout.unique_params(), desc="Loading shards", disable=rank != 0, leave=False):
            source, old = sources[entry.name], model.get_parameter(entry.name)
            if kept is not None and entry.name in quantized:
                tiles, _ = quantized[entry.name], tiled.pop(entry.name)
                weight = KeptWeight.read(tiles, entry.layout, rank, entry.full_shape, dtype or old.dtype, reader.device)
                kept[entry.name] = weight
                for piece in weight.pieces:
                    BYTES_READ[piece.key] += piece.kept.nbytes
                local = placeholder(weight.shape, weight.dtype)
            elif entry.name in tiled:
                local = reader.read_tiled(tiled.pop(entry.name), entry.name, entry.layout, dtype)
            else:
                local = reader.read(files[source], source, entry.layout, dtype)
            if into_shards:
                with torch.no_grad():
                    _fill_shard(old, local, layout.mesh["ep_replicas" if entry.layout.over == "ep" else "fsdp"])
                continue
            param = local if entry.name in (kept or ()) else nn.Parameter(local, requires_grad=old.requires_grad)
            for alias in entry.aliases:
                _set_tensor(model, alias, param)
        for name, key in buffers.items():
            old = model.get_buffer(name)
            keep_dtype = old.dtype if old.is_floating_point() else None
            _set_tensor(model, name, reader.read(files[key], key, replicated(1), keep_dtype))
    return {**saved_as, **buffers}


def _check_headers(model, path, layout, files, sources, tiled, reader, quantization, keep: bool) -> dict[str, list]:
    """Check every parameter's header against the model before any data is read (``tiled`` gains the
    fused parameters' tiles); return parameter -> its tiles (key, box, Dequantized) where stored quantized."""
    quantized = {}
    for entry in layout.unique_params():
        source, param_dtype = sources[entry.name], model.get_parameter(entry.name).dtype
        if isinstance(source, FusedSource):
            tiles = [(key, box, readable(reader._shared, files, key, quantization))
                     for key, box in source.boxes(entry.full_shape)]  # fmt: skip
            if any(isinstance(dequantized, Dequantized) for _, _, dequantized in tiles):
                quantized[entry.name] = tiles  # (all of them: refused below otherwise)
            tiled[entry.name] = reader.fused(files, entry.name, tiles, entry.full_shape, quantization)
            reader.check(path, entry.name, entry.name, entry.full_shape, param_dtype, tiled[entry.name])
        elif entry.name in tiled:  # quantized, read dequantized
            reader.check(files[source], source, entry.name, entry.full_shape, param_dtype, tiled[entry.name])
        else:
            reader.check(files[source], source, entry.name, entry.full_shape, param_dtype)
        if isinstance(tiled.get(entry.name), Dequantized):
            quantized[entry.name] = [(source, tuple((0, n) for n in entry.full_shape), tiled[entry.name])]
        if entry.name in quantized:
            _check_quantized(entry, quantized[entry.name], files, keep)
    return quantized


def _check_quantized(entry, tiles: list, files: dict, keep: bool) -> None:
    """A parameter read from quantized keys: all of them quantized (a fused expert parameter with some
    experts stored otherwise is refused), and, to be kept as stored (dequantized in its own module's call,
    saved back from its stored parts), neither shared by several modules nor beside a static activation
    scale (which would not be written back)."""
    plain = [key for key, _, dequantized in tiles if not isinstance(dequantized, Dequantized)]
    if plain:
        raise CheckpointError(
            f"{entry.name}: its experts' keys are stored partly quantized and partly not ({plain[0]!r} is not); "
            "one format per parameter"
        )
    activation = next((activation_scale(k) for k, _, _ in tiles if activation_scale(k) in files), None)
    if keep and (len(entry.aliases) > 1 or activation):
        tied = len(entry.aliases) > 1
        why = f"is tied to {', '.join(entry.aliases[1:])}" if tied else f"has {activation!r} beside it"
        raise CheckpointError(
            f"keep_quantized=True: {entry.name} {why}, which a weight held quantized does not carry; load without "
            "keep_quantized (dequantized as read)"
        )


def _check_claimed(path: str, companions: set[str], quantized) -> None:
    """Every scale or quantized part beside a weight this rank reads belongs to a weight stored quantized: one
    beside a weight stored as floats (a stray ``_scale_inv`` next to a norm) is refused, never skipped."""
    claimed = set()
    for tiles in quantized:
        for key, _, dequantized in tiles:
            claimed |= {*dequantized.parts, *dequantized.constants}
            if isinstance(dequantized, DequantizedFP8):  # its module's static activation scale: moot once dequantized
                claimed.add(activation_scale(key))
    stray = sorted(companions - claimed)
    if stray:
        raise CheckpointError(
            f"{path}: {stray[0]!r} (and {len(stray) - 1} more) sit beside weights stored as floats, not quantized: "
            "a scale or quantized part nothing reads"
        )


def _keys_of(source: str | FusedSource) -> list[str]:
    return [key for keys in source.keys for key in keys] if isinstance(source, FusedSource) else [source]
