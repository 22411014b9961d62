"""Save a sharded model as a standard checkpoint: gather block by block, write on rank 0.

Rank 0 asks for each tensor in row blocks of about ``BLOCK_BYTES`` and writes each block as soon as
it is complete, so whatever the split (row, column, packed, per-expert), its memory stays near its
own shard plus one block and one received part: no full tensor is ever assembled (for a 70B
Llama's ``down_proj``, 16 MiB instead of 470 MB). Files are written under temporary names in the
target directory and renamed only once every file is complete: an interrupted save never leaves a
half-written file with a final name, nor destroys a previous checkpoint's files.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from contextlib import nullcontext

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from tqdm.auto import tqdm

from ..compat.torch import is_persistent_buffer
from ..distributed import p2p
from ..distributed.devices import to_wire
from ..distributed.mesh import Dim
from ..quant.kept import KeptWeight
from .kept_saves import gathered_part
from ..core.layout import Box, Layout, as_slices, box_shape, replicated
from ..tensor.parallelize import ShardedParam
from ..distributed.fsdp import LayerwiseUnshard
from .files import INDEX_FILE, MAX_SHARD_SIZE
from .keys import FusedSource, expert_shape
from .staging import Staging, remove_stale
from ..core.dtypes import nbytes
from .writer import SafetensorsWriter, timed

BLOCK_BYTES = 16 << 20  # rank 0 holds at most one block of a tensor (and one received part) at a time


class Scratch:
    """One reusable buffer on ``device``, handed out as a tensor of any shape that fits. A save that
    allocated a block per tensor would leave glibc's freed heap in rank 0's RSS (several blocks'
    worth); reusing one is the same few pages every time. What it returned is
    overwritten by the next ``take``."""

    def __init__(self, device=torch.device("cpu")):
        self.device = torch.device(device)
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        size = nbytes(shape, dtype)
        if self.buffer.numel() < size:
            self.buffer = None  # free the old one before allocating its successor
            self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.buffer[:size].view(dtype).view(tuple(shape))


def receive_into(target: torch.Tensor, wire: Scratch, what: str, source: int, group) -> None:
    """Receive a message from global rank ``source`` into ``target``: straight into it where it is
    contiguous and on the wire (the device the groups' backend carries), else through ``wire`` and a copy."""
    direct = target.is_contiguous() and target.device == wire.device
    buffer = target if direct else wire.take(target.shape, target.dtype)
    p2p.recv(buffer, source, what, group)
    if not direct:
        target.copy_(buffer)


def gather_block(
    local: torch.Tensor, layout: Layout, box: Box, tp: Dim, name: str, scratch: tuple[Scratch, Scratch]
) -> torch.Tensor | None:
    """The ``box`` of the full tensor on the TP group's first rank (None elsewhere), in
    ``scratch[0]`` (host memory, where the writer reads it). Every rank sends only its runs of the
    box (``Layout.place``), one message at a time (each waited for: NCCL's watchdog times an operation
    from when it is queued, so a sender never queues a whole save); the first rank places each as it
    arrives (``receive_into``, with ``scratch[1]`` on the wire)."""
    first = tp.rank == 0
    if layout.is_replicated or tp.size == 1:
        return local.detach()[as_slices(box)].cpu() if first else None
    wire = scratch[1].device

    def fill(rank: int, target: torch.Tensor | None, local_box: Box) -> None:
        if rank == tp.rank:
            part = local.detach()[as_slices(local_box)]
            if first:
                target.copy_(part)
                return
            what = f"sending {name} from rank {tp.ranks[rank]} to rank {tp.ranks[0]}"
            p2p.send(to_wire(part, wire), tp.ranks[0], what, tp.group)
        elif first:
            what = f"receiving {name} from rank {tp.ranks[rank]} on rank {tp.ranks[0]}"
            receive_into(target, scratch[1], what, tp.ranks[rank], tp.group)

    with timed("gather"):
        return layout.place(scratch[0].take(box_shape(box), local.dtype) if first else None, box, fill)


def row_blocks(full_shape, box: Box | None, dtype: torch.dtype) -> list[Box]:
    """The boxes of the full tensor that a checkpoint key is written in, blocks of about BLOCK_BYTES
    (whole rows): of the whole tensor, or of the one expert at ``box`` of a fused parameter (its
    rows are along dim 1: dim 0 is the expert, dropped by ``as_written``). A 0-d tensor whole."""
    row_dim = 0 if box is None else 1
    box = box or tuple((0, n) for n in full_shape)
    if row_dim >= len(box):
        return [box]
    start, stop = box[row_dim]
    row = nbytes([b - a for a, b in box[row_dim + 1 :]], dtype)
    step = max(1, BLOCK_BYTES // max(row, 1))
    return [box[:row_dim] + ((a, min(a + step, stop)),) + box[row_dim + 1 :] for a in range(start, stop, step)]


def as_written(block: torch.Tensor, box: Box | None) -> torch.Tensor:
    """A block as its checkpoint key holds it: one expert's drops the fused tensor's expert dim."""
    return block if box is None else block.squeeze(0)


def plan_files(specs: dict, max_shard_size) -> tuple[dict[str, list[str]], dict | None]:
    """File name -> keys, and the index (None for a single file), as transformers names them."""
    split = split_state_dict_into_shards_factory(
        specs,
        get_storage_size=lambda spec: nbytes(*spec),
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    if not split.is_sharded:
        return split.filename_to_tensors, None
    index = {
        "metadata": {"total_size": sum(nbytes(*spec) for spec in specs.values())},
        "weight_map": split.tensor_to_filename,
    }
    return split.filename_to_tensors, index


def write_standard(staging: Staging, specs: dict, tensors, max_shard_size, progress=None) -> None:
    """Stage a standard checkpoint (files split at ``max_shard_size``, index when sharded) from
    ``tensors(keys)``, which yields each key's full tensor in order (None on ranks that don't write)."""
    files, index = plan_files(specs, max_shard_size)
    for file_name, keys in files.items():
        writer = SafetensorsWriter(staging.new_file(file_name), {key: specs[key] for key in keys}) if staging else None
        for key, full in zip(keys, tensors(keys)):
            if writer is not None:
                writer.write(key, full)
            if progress is not None:
                progress.update(nbytes(*specs[key]))
        if writer is not None:
            writer.close()
    if staging and index is not None:
        with open(staging.new_file(INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def save_config(model, out_dir: str, quantization_config=None) -> None:
    """The config (with the checkpoint's ``quantization_config`` when weights were kept quantized: they are
    written as stored) and the generation config."""
    config = model.config
    if quantization_config is not None:
        config = copy.copy(config)
        config.quantization_config = quantization_config
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out_dir)


def _is_persistent_buffer(model, name: str) -> bool:
    module, _, attr = name.rpartition(".")
    return is_persistent_buffer(model.get_submodule(module), attr)


def saved_entries(model, state) -> list[ShardedParam]:
    """Every parameter once, then the persistent buffers the checkpoint held (DeepSeek-V3's router
    ``e_score_correction_bias``): written back as read, whole, by rank 0. Legacy non-persistent ones
    (BERT's ``position_ids``) are dropped, as transformers' own save drops them."""
    buffers = [n for n in state.source_keys if n not in state.layout.params and _is_persistent_buffer(model, n)]
    return state.layout.unique_params() + [
        ShardedParam(name, (name,), replicated(state.mesh.tp.size), None, tuple(model.get_buffer(name).shape))
        for name in buffers
    ]


def tensor_of(model, name: str) -> torch.Tensor:
    """The parameter or buffer called ``name``."""
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr)


def checkpoint_tensors(model, state) -> dict[str, tuple]:
    """Checkpoint key -> (sharded parameter, box of it or None), in the source's form: a fused
    expert parameter loaded from per-expert keys is written back as those keys; a weight kept
    quantized, as its stored parts: key -> (its ``KeptWeight``, the key)."""
    out = {}
    for entry in saved_entries(model, state):
        source = state.source_keys[entry.name]
        if entry.name in state.kept:
            kept = state.kept[entry.name]
            out.update((key, (kept, key)) for key in [*kept.stored, *kept.constants])
        elif isinstance(source, FusedSource):
            out.update((key, (entry, box)) for key, box in source.boxes(entry.full_shape))
        else:
            out[source] = (entry, None)
    return out


def written_spec(model, entry, box) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of a checkpoint key as written, from its ``checkpoint_tensors`` target."""
    if isinstance(entry, KeptWeight):
        part = entry.constants.get(box)
        return (tuple(part.shape), part.dtype) if part is not None else entry.stored[box]
    return entry.full_shape if box is None else expert_shape(box), tensor_of(model, entry.name).dtype


def stage_owners(mesh, specs: dict) -> tuple[dict[str, int], dict]:
    """Under pipeline parallelism: every key's owning stage (the first that holds it: a tied
    weight is written once) and every stage's specs, in stage order, on every rank."""
    owners, merged = {}, {}
    for stage, theirs in enumerate(mesh.per_stage(specs, "listing every stage's tensors for the save")):
        for key, spec in theirs.items():
            owners.setdefault(key, stage)
            merged.setdefault(key, spec)
    return owners, merged


def on_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a collective carries it: float8 (a kept quantized part) as its bytes, which
    every backend sends (NCCL knows no e8m0)."""
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 and tensor.is_floating_point() else tensor


def received_blocks(spec, source: int, key: str, wire: Scratch, group):
    """On rank 0: a key another stage owns, block by block from that stage's first rank (received
    on the wire; the writer copies each to the host)."""
    shape, dtype = spec
    for block in row_blocks(shape, None, dtype):
        buffer = wire.take(box_shape(block), dtype)
        with timed("gather"):
            what = f"receiving {key} from rank {source} (its pipeline stage's first rank) on rank 0"
            p2p.recv(on_the_wire(buffer), source, what, group)
        yield buffer


def gathered(model, mesh, targets: dict, specs: dict, owners: dict, keys, unsharding=None, only_experts=False):
    """Per key, its row blocks as rank 0 gathers them (an iterator consumed block by block); the
    other ranks send their parts here, in the same order, and yield None. ``targets``: key ->
    (sharded parameter, box); ``owners``: key -> the pipeline stage that holds it; ``unsharding``: FSDP's
    modules made whole one at a time (``LayerwiseUnshard``), asked for each parameter before it is read.
    ``only_experts``: a data-parallel copy in rank 0's EP group sends its experts (written over ``ep``) alone."""
    scratch = (Scratch(), Scratch(mesh.wire))  # (the block, assembled on the host; what arrives)
    for key in keys:
        if only_experts and (isinstance(targets[key][0], KeptWeight) or targets[key][0].layout.over != "ep"):
            if unsharding is not None and not isinstance(targets[key][0], KeptWeight):
                unsharding.need(targets[key][0].name)
            yield None
            continue
        if owners[key] != mesh.stage:
            leader = mesh.stage_ranks(owners[key])[0]
            yield received_blocks(specs[key], leader, key, scratch[1], mesh.world.group) if mesh.is_main else None
            continue
        entry, box = targets[key]
        if isinstance(entry, KeptWeight):  # a part of a weight kept quantized: whole on the group's first rank,
            full, (shape, dtype) = gathered_part(entry, box, mesh.tp, mesh.wire), specs[key]  # then in row blocks
            blocks = (None if full is None else full[as_slices(b)] for b in row_blocks(shape, None, dtype))
            box = None
        else:
            if unsharding is not None:
                unsharding.need(entry.name)
            local = unsharding.tensor(entry.name) if unsharding is not None else tensor_of(model, entry.name)
            blocks = (
                gather_block(local, entry.layout, block, mesh[entry.layout.over], entry.name, scratch)
                for block in row_blocks(entry.full_shape, box, local.dtype)
            )
        if mesh.is_main:
            yield (as_written(block, box) for block in blocks)
            continue
        for block in blocks:
            if block is not None:  # this stage's first rank, not rank 0: on to rank 0, one block at a time
                data = on_the_wire(to_wire(as_written(block, box), mesh.wire))
                p2p.send(data, 0, f"sending {key} from rank {mesh.rank} to rank 0", mesh.world.group)
        yield None


def gathered_tensors(model, state, entries: list[ShardedParam]) -> dict[str, torch.Tensor] | None:
    """Each entry's whole tensor (small ones: adapters) on rank 0, by its name, gathered as the
    save gathers (every stage's, on every rank's call); None on the other ranks."""
    mesh = state.mesh
    targets = {entry.name: (entry, None) for entry in entries}
    specs = {entry.name: (entry.full_shape, tensor_of(model, entry.name).dtype) for entry in entries}
    owners = dict.fromkeys(specs, mesh.stage)
    if mesh.num_stages > 1:
        owners, specs = stage_owners(mesh, specs)
    if mesh.holds_copy:
        return None
    full = {}
    for key, blocks in zip(specs, gathered(model, mesh, targets, specs, owners, list(specs))):
        if blocks is not None:
            full[key] = torch.cat([block.clone() for block in blocks])
    return full if mesh.is_main else None


def save_sharded(model, state, out_dir: str, max_shard_size=MAX_SHARD_SIZE) -> None:
    """Gather every parameter of ``model`` (split as its parallel ``state`` says) under its
    checkpoint name and write a standard HF checkpoint. Each pipeline stage gathers its own tensors
    on its first rank, which sends them on to rank 0. Under FSDP each layer is whole only while its
    tensors are gathered: the copies that write nothing walk the same parameters in the same order."""
    with LayerwiseUnshard(model, masters=state.compute_dtype is not None) as unsharding:
        _save_sharded(model, state, out_dir, max_shard_size, unsharding)


def _save_sharded(model, state, out_dir: str, max_shard_size, unsharding) -> None:
    mesh = state.mesh
    targets = checkpoint_tensors(model, state)
    specs = {key: written_spec(model, entry, box) for key, (entry, box) in targets.items()}
    owners = dict.fromkeys(specs, mesh.stage)
    if mesh.num_stages > 1:  # collective over the world: before the sequence-parallel replicas leave
        owners, specs = stage_owners(mesh, specs)
    if mesh.holds_copy and mesh.holds_experts_of_main:  # a copy of the rest, but its own experts: sent to rank 0
        for keys in plan_files(specs, max_shard_size)[0].values():  # write_standard's order
            for _ in gathered(model, mesh, targets, specs, owners, keys, unsharding, only_experts=True):
                pass
        mesh.barrier()
        return
    if mesh.holds_copy:  # sequence-parallel and data-parallel copies of the shards the first replica saves
        for keys in plan_files(specs, max_shard_size)[0].values():  # write_standard's order
            for key in keys:
                if owners[key] == mesh.stage and not isinstance(targets[key][0], KeptWeight):  # as ``gathered``
                    unsharding.need(targets[key][0].name)
        mesh.barrier()
        return

    if mesh.is_main:
        os.makedirs(out_dir, exist_ok=True)
    progress = tqdm(total=sum(nbytes(*spec) for spec in specs.values()), desc="Saving", unit="B", unit_scale=True,
                    disable=not mesh.is_main, leave=False)  # fmt: skip
    with Staging(out_dir) if mesh.is_main else nullcontext() as staging:
        write_standard(staging, specs, functools.partial(gathered, model, mesh, targets, specs, owners,
                                                         unsharding=unsharding), max_shard_size, progress)  # fmt: skip
        if staging:
            with timed("rename"):
                remove_stale(out_dir, set(staging.commit()))
            save_config(model, out_dir, state.quantization_config if state.keep_quantized else None)
    progress.close()
    mesh.barrier()
