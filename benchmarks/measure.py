"""What the benchmark measures, the same way for every implementation: RSS peaks from the kernel's
high-water mark, CPU time from the kernel's accounting, and collectives counted at the dispatcher
(both c10d ops and DTensor's functional ones)."""

from __future__ import annotations

import resource

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_WAITS = {"wait_tensor", "_wrap_tensor_autograd"}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def cpu_seconds() -> tuple[float, float]:
    """This process's (user, system) CPU seconds so far. Steadier than wall time on a noisy VM:
    time spent descheduled is not counted, and page faults show up as system time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _payload(op: str, args) -> int:
    """Bytes this rank contributes: the input tensors (for all-gathers, the second argument)."""
    source = args[1] if op.startswith("allgather") else args[0]
    tensors = source if isinstance(source, (list, tuple)) else [source]
    flat = []
    for t in tensors:
        flat.extend(t if isinstance(t, (list, tuple)) else [t])
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


class CountCollectives(TorchDispatchMode):
    """Counts every collective dispatched inside the context, with the bytes each rank sends."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.bytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("c10d", "_c10d_functional") and name not in _WAITS:
            self.calls += 1
            self.bytes += _payload(name, args)
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def timed_training_steps(model, rows: torch.Tensor, steps: int, data_parallel: int) -> tuple[list[float], list[float]]:
    """One warm-up and ``steps`` timed training steps of ``model`` on this rank's ``rows`` (forward, backward,
    AdamW's step), every rank starting and ending each together: the global batch's losses (the data-parallel
    replicas' mean) of every step, and the seconds of each timed one."""
    import time

    import torch.distributed as dist

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    losses, seconds = [], []
    for step in range(1 + steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.is_initialized():
            dist.barrier()
        if step:  # the first step is the warm-up
            seconds.append(time.perf_counter() - start)
        loss = loss.detach()
        if data_parallel > 1:  # the global batch's loss: the replicas' mean
            dist.all_reduce(loss)
            loss /= data_parallel
        losses.append(loss.item())
    return losses, seconds


def run_worker(script: str, kind: str, ranks: int, flags: list[str], out: str, pythonpath: str) -> list[dict] | str:
    """``script --worker KIND --out OUT FLAGS`` run as ``ranks`` ranks under torchrun (one process without), the
    cores shared among them: every rank's results (``{script's stem}-{kind}-rank{r}.json`` in ``out``), or what
    failed (the last error line of its output)."""
    import json
    import os
    import subprocess
    import sys

    threads = max(1, (os.cpu_count() or 1) // ranks)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": pythonpath}
    command = [sys.executable, os.path.abspath(script), "--worker", kind, "--out", out, *flags]
    if ranks > 1:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    print(f"  {kind} x{ranks} ({threads} thread(s) each) ...", flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error:" in line and "ChildFailedError" not in line]
        return (errors[-1] if errors else f"exit {done.returncode}").strip()[:300]
    stem, name = os.path.splitext(os.path.basename(script))[0], kind.replace(" ", "_")
    return [json.load(open(os.path.join(out, f"{stem}-{name}-rank{r}.json"))) for r in range(ranks)]


def result_rows(runs: dict, row_of) -> dict:
    """Each configuration's row of a results table: ``row_of(ranks)`` and ``loss_error`` (the largest difference
    from the one-process run's losses, None without one) where it ran, ``{"failed": why}`` where it did not."""
    single = runs.get("one process")
    table = {}
    for kind, ranks in runs.items():
        if isinstance(ranks, str):
            table[kind] = {"failed": ranks}
            continue
        error = None if not isinstance(single, list) else max(
            abs(a - b) for r in ranks for a, b in zip(r["losses"], single[0]["losses"])
        )  # fmt: skip
        table[kind] = {**row_of(ranks), "loss_error": error}
    return table
