"""Workers of the loader and the saves: bytes read, round trips, a save killed midway, memory (test_loading, test_distributed_checkpoint). Each runs inside a rank of a spawned gloo group (``distributed.run_ranks``)."""

from __future__ import annotations

import math
import os

import torch


def _mapped_safetensors() -> list[tuple[int, int]]:
    """Address ranges where this process has a .safetensors file memory-mapped."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def count_bytes_read(rank: int, world_size: int, path: str) -> dict:
    """Bytes the loader requested per checkpoint key vs the bytes of this rank's shard."""
    import hf_parallel
    from hf_parallel.checkpoint.loading import BYTES_READ

    BYTES_READ.clear()
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    state = hf_parallel.parallel_state(model)
    rows = {}
    for entry in state.layout.unique_params():
        key = state.source_keys[entry.name]
        param = model.get_parameter(entry.name)
        full = 1
        for n in entry.full_shape:
            full *= n
        rows[key] = {
            "read": BYTES_READ[key],
            "local": param.numel() * param.element_size(),
            "full": full * param.element_size(),
            "sharded": not entry.layout.is_replicated,
            "contiguous": param.is_contiguous(),
            "file_view": any(lo <= param.data_ptr() < hi for lo, hi in _mapped_safetensors()),
        }
    return rows


def save_as_loaded(rank: int, world_size: int, path: str, out: str, distributed: bool) -> dict:
    """Load in the checkpoint's own dtype and save: the round trip must be bit-exact."""
    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    model.save_pretrained(out, distributed=distributed)
    return {"local_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def save_killed_midway(rank: int, world_size: int, path: str, out: str) -> dict:
    """A distributed save in which rank 1 is SIGKILLed after writing its first tensor."""
    import signal

    import hf_parallel
    from hf_parallel.checkpoint import writer

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    if rank == 1:
        write = writer.SafetensorsWriter.write

        def write_then_die(self, key, tensor):
            write(self, key, tensor)
            os.kill(os.getpid(), signal.SIGKILL)

        writer.SafetensorsWriter.write = write_then_die
    model.save_pretrained(out, distributed=True)
    return {}


BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def benchmark_rss_readings():
    """benchmarks/measure.py's (rss_bytes, peak_rss_bytes, reset_peak_rss): tests read RSS as the benchmark does."""
    import sys

    sys.path.insert(0, BENCHMARKS)
    import measure

    return measure.rss_bytes, measure.peak_rss_bytes, measure.reset_peak_rss


def consolidate_in_fresh_process(src: str, out: str) -> dict:
    """``hf_parallel.consolidate`` run as the benchmark runs it (its own script, a fresh process):
    its result plus RSS after imports and the peak."""
    import json
    import subprocess
    import sys

    sys.path.insert(0, BENCHMARKS)
    from worker import CONSOLIDATE

    env = {**os.environ, "PYTHONPATH": BENCHMARKS}
    run = subprocess.run(
        [sys.executable, "-c", CONSOLIDATE, src, out], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def save_memory(rank: int, world_size: int, path: str, out: str) -> dict:
    """Rank 0's peak RSS added by a gathered save, above its RSS before it. Every local shard is
    paged in first and a first save warms the code, so what is measured is the save's own buffers.
    Then a distributed save, for the test to consolidate."""
    import hf_parallel

    rss_bytes, peak_rss_bytes, reset_peak_rss = benchmark_rss_readings()

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.sum()
    model.save_pretrained(os.path.join(out, "warm"))
    before = rss_bytes()
    reset_peak_rss()
    model.save_pretrained(os.path.join(out, "saved"))
    added = peak_rss_bytes() - before
    model.save_pretrained(os.path.join(out, "distributed"), distributed=True)  # for consolidation
    largest = max(math.prod(entry.full_shape) * 4 for entry in hf_parallel.parallel_state(model).layout.unique_params())
    return {"added": added, "largest_full_tensor": largest}
