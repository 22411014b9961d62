"""Run a function on N real gloo ranks (torch.multiprocessing, spawn) and collect JSON results."""

from __future__ import annotations

import json
import os
import socket
import sys

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        HF_PARALLEL_TIMEOUT=os.environ.get("HF_PARALLEL_TIMEOUT", "300"),  # a test may bound it tighter
    )
    import torch

    torch.set_num_threads(1)
    result = fn(rank, world_size, *args)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():  # tear down together: a rank exiting mid-teardown aborts gloo
        dist.barrier()
        dist.destroy_process_group()
    # Skip interpreter finalization: gloo threads that still hold tensors can abort there
    # ("terminate called without an active exception", pytorch#190489) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn, *args, out_dir: str) -> list:
    """fn(rank, world_size, *args) on every rank; returns each rank's JSON-able result."""
    os.makedirs(out_dir, exist_ok=True)
    mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size, join=True, start_method="spawn"
    )
    results = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results
