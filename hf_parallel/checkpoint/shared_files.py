"""The gathered save without the gather, where every rank can write the checkpoint's files itself.

Gathering moves every byte to rank 0 and writes it there: one writer and the ranks' links bound the
save. When every saving rank runs on one host and sees the same staged file (same device and inode),
rank 0 stages the files with their safetensors headers, and each rank writes what it holds straight
to its offsets (``os.pwrite``): a shard split by rows is a contiguous run of the file, so no byte
crosses between ranks and each is written once. A block whose runs are strided in the file (a
column split) is gathered as the gathered save does, on one rank of the TP group, round robin over
the blocks so the writing is shared, and written by it. Rank 0 fsyncs and renames once every rank is
done, with the same staging (nothing final until every file is whole). ``HF_PARALLEL_SHARED_SAVE=0``
gathers to rank 0 instead, as ranks on several hosts always do.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from ..distributed.faults import collective
from ..distributed.shm import host_id
from ..tensor.layout import Box, as_slices, box_shape
from .files import TEMP_SUFFIX
from .saving import Scratch, gather_block, row_blocks, tensor_of
from .staging import Staging
from .writer import nbytes, pwrite_tensor, safetensors_header, timed


def files_shared(mesh, out_dir: str) -> bool:
    """Collective over the world: whether every saving rank sees rank 0's files in ``out_dir``
    (one host, the same inode). Ranks that save nothing (sequence and data-parallel copies) agree."""
    if mesh.world.group is None or os.environ.get("HF_PARALLEL_SHARED_SAVE", "1") == "0":
        return False
    probe = [None]
    if mesh.is_main:
        fd, path = tempfile.mkstemp(prefix=".hf_parallel-probe.", suffix=TEMP_SUFFIX, dir=out_dir)
        os.close(fd)
        stat = os.stat(path)
        probe = [(host_id(), path, stat.st_dev, stat.st_ino)]
    seen = [None] * mesh.world_size
    try:
        with collective(f"checking that every rank sees the save's files in {out_dir} (rank {mesh.rank})"):
            dist.broadcast_object_list(probe, src=0)
            host, path, device, inode = probe[0]
            try:
                stat = os.stat(path)
                mine = bool(host) and host == host_id() and (stat.st_dev, stat.st_ino) == (device, inode)
            except OSError:
                mine = False
            dist.all_gather_object(seen, mesh.holds_copy or mine)
    finally:
        if mesh.is_main:
            os.remove(probe[0][1])
    return all(seen)


def stage_files(mesh, staging: Staging | None, files: dict[str, list[str]], specs: dict) -> dict[str, tuple]:
    """Collective over the world: rank 0 stages each file with its header, at its full size; every
    rank gets file name -> (staged path, where each key's bytes start)."""
    staged = [None]
    if staging is not None:
        staged = [{}]
        for name, keys in files.items():
            lead, starts = safetensors_header({key: specs[key] for key in keys})
            path = staging.new_file(name)
            with open(path, "r+b") as f:
                f.write(lead)
                f.truncate(len(lead) + sum(nbytes(*specs[key]) for key in keys))
            staged[0][name] = (path, starts)
    with collective(f"receiving the save's staged file names from rank 0 (rank {mesh.rank})"):
        dist.broadcast_object_list(staged, src=0)
    return staged[0]


def block_offset(block: Box, box: Box | None, dtype: torch.dtype) -> int:
    """Where a row block (``saving.row_blocks``) starts in its key's bytes."""
    row_dim = 0 if box is None else 1
    if row_dim >= len(block):
        return 0
    rows = block[row_dim][0] - (0 if box is None else box[row_dim][0])
    return rows * nbytes(box_shape(block)[row_dim + 1 :], dtype)


def contiguous_runs(layout, block: Box, dtype: torch.dtype) -> list[tuple[int, int, Box]] | None:
    """``(rank, byte offset in the block, local box)`` of each rank's run of ``block``, when every
    run is contiguous in the file; None when some run is strided (a column split)."""
    runs = []

    def note(rank: int, target: torch.Tensor, local_box: Box) -> None:
        runs.append((rank, target, local_box))

    layout.place(torch.empty(box_shape(block), dtype=dtype, device="meta"), block, note)
    if not all(target.is_contiguous() for _, target, _ in runs):
        return None
    return [(rank, target.storage_offset() * target.element_size(), local_box) for rank, target, local_box in runs]


def write_own_runs(model, mesh, targets: dict, specs: dict, owners: dict, staged: dict, progress) -> None:
    """Write this rank's part of every staged file: its contiguous runs itself, strided blocks
    gathered on the TP rank whose turn it is (the same turns on every rank of a stage)."""
    tp, turn = mesh.tp, 0
    scratch = (Scratch(), Scratch(mesh.device))
    for path, starts in staged.values():
        fd = os.open(path, os.O_WRONLY)
        try:
            for key, start in starts.items():
                if owners[key] == mesh.stage:
                    entry, box = targets[key]
                    local = tensor_of(model, entry.name)
                    for block in row_blocks(entry.full_shape, box, local.dtype):
                        at = start + block_offset(block, box, local.dtype)
                        write_block(fd, at, local, entry.layout, block, tp, entry.name, scratch, turn % tp.size)
                        turn += 1
                if progress is not None:
                    progress.update(nbytes(*specs[key]))
        finally:
            os.close(fd)


def write_block(fd: int, at: int, local, layout, block: Box, tp, name: str, scratch, writer: int) -> None:
    """This rank's share of ``block`` (whose first byte is at ``at`` in the file)."""
    if layout.is_replicated or tp.size == 1:
        if tp.rank == writer:
            pwrite_tensor(fd, local[as_slices(block)], at)
        return
    runs = contiguous_runs(layout, block, local.dtype)
    if runs is not None:
        for rank, offset, local_box in runs:
            if rank == tp.rank:
                pwrite_tensor(fd, local[as_slices(local_box)], at + offset)
        return
    full = gather_block(local, layout, block, tp, name, scratch, dest=writer)
    if full is not None:
        pwrite_tensor(fd, full, at)


def sync_files(staged: dict) -> None:
    """Rank 0, once every rank has written: every staged file on disk before any is renamed."""
    with timed("fsync"):
        for path, _ in staged.values():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
