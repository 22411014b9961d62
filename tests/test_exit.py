"""A program that ends right after a collective ends cleanly: 30 back-to-back two-rank runs, no abort.

gloo's worker threads can release a finished all-gather's tensors just as the interpreter
finalizes, and the process aborts ("terminate called without an active exception"; about half of
such runs with torch 2.13 alone). hf_parallel destroys its process groups at exit, before
finalization (``distributed/mesh.py``)."""

import os
import subprocess
import sys

import pytest
from distributed import free_port

ENDS_WITH_AN_ALL_GATHER = """
import torch, torch.distributed as dist
from hf_parallel.distributed.mesh import get_mesh
get_mesh(tp_size=2)
out = [torch.empty(4) for _ in range(2)]
dist.all_gather(out, torch.full((4,), float(dist.get_rank())))  # the program's last collective
assert [t[0].item() for t in out] == [0.0, 1.0]
"""
RUNS = 30


@pytest.mark.distributed
def test_thirty_runs_that_end_after_a_collective_exit_cleanly():
    for run in range(RUNS):
        port = free_port()
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", ENDS_WITH_AN_ALL_GATHER], stderr=subprocess.PIPE, text=True,
                env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            for rank in range(2)
        ]
        for rank, process in enumerate(ranks):
            _, err = process.communicate(timeout=120)
            assert process.returncode == 0, f"run {run}, rank {rank}: exit code {process.returncode}\n{err[-2000:]}"
