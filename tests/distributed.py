"""Run a function on N real gloo ranks and collect JSON results.

The ranks are forked from one fork server per test session (``multiprocessing``'s ``forkserver``) that has
already imported torch, transformers and the package (``rank_preload``): a fresh interpreter per rank paid
those imports again, seconds of CPU each, for every group the suite starts. A case still gets processes of
its own: each group is forked new from the server's pristine import state, so nothing one case sets (a
module's attribute, a seam, a process group, an RNG draw) reaches the next, and a rank that crashes or hangs
ends its case alone (the server survives it; ``multiprocessing`` starts a new one if the server itself dies).
Collectives are real: every rank builds its own gloo group, as under torchrun.

The environment a case runs under is the parent's at the call (``monkeypatch.setenv`` reaches the ranks as
with spawn). A variable read at import time (``IMPORT_TIME``) that differs from the server's own cannot be
honoured by a fork of already imported modules: such a case spawns fresh interpreters, as everything did
before. ``HF_PARALLEL_TEST_SPAWN=1`` spawns every case.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import socket
import sys
import time
import warnings

import torch.multiprocessing as mp

# variables torch, triton, transformers/huggingface_hub or the package read when a module is imported
IMPORT_TIME = ("TRITON_", "TORCH", "PYTORCH_", "CUDA_", "OMP_", "MKL_", "HF_HUB_", "HF_HOME", "TRANSFORMERS_",
               "XDG_CACHE_HOME", "HF_PARALLEL_SHM_SLOT_MB")  # fmt: skip
# ... but not these, which torch writes into os.environ itself as it runs (inductor's first compile in the
# parent sets its cache folder) and reads at each use: a case's ranks get them from its environment
RUN_TIME = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHELASTIC_")
TESTS = os.path.dirname(os.path.abspath(__file__))
CASE_TIMEOUT_S = float(os.environ.get("HF_PARALLEL_TEST_CASE_TIMEOUT", "1200"))  # beyond any case's own waits

GROUPS = []  # the world size of every group run_ranks started (read by suite_costs.py)
_server = {"pid": None, "env": None}  # the fork server's pid and the import-time variables it started under


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environment(**values):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _import_time_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME) and not k.startswith(RUN_TIME)}


def _start_method() -> str:
    """``forkserver`` when the server's imports match this case's environment, else ``spawn``."""
    if os.environ.get("HF_PARALLEL_TEST_SPAWN") == "1":
        return "spawn"
    forkserver = multiprocessing.forkserver._forkserver
    if _server["pid"] is None:
        forkserver.set_forkserver_preload(["rank_preload"])
    # The server imports its preload from sys.path as a new interpreter builds it (Python 3.11 drops the sys.path
    # it is handed) and passes over an ImportError in silence: the tests' folder goes on its PYTHONPATH.
    server_path = os.pathsep.join(filter(None, (TESTS, os.environ.get("PYTHONPATH"))))
    with _environment(PYTHONPATH=server_path):
        forkserver.ensure_running()
    if forkserver._forkserver_pid != _server["pid"]:  # started now (first case, or the last server died)
        _server.update(pid=forkserver._forkserver_pid, env=_import_time_env())
    now, then = _import_time_env(), _server["env"]
    if now == then:
        return "forkserver"
    changed = sorted(name for name in {*now, *then} if now.get(name) != then.get(name))
    warnings.warn(f"a case's ranks are spawned (seconds of imports each): {', '.join(changed)} differ from the "
                  "fork server's, and are read when a module is imported", stacklevel=3)  # fmt: skip
    return "spawn"


def _entry(rank: int, world_size: int, port: int, fn, args, out_dir: str, env: dict, start: str) -> None:
    if start == "forkserver" and "rank_preload" not in sys.modules:  # else every case pays the imports unseen
        raise RuntimeError("the tests' fork server did not import rank_preload: run it (python tests/rank_preload.py)"
                           " to see why")
    os.environ.clear()
    os.environ.update(env)  # the caller's, as at this call (a forked rank would otherwise see the server's)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        HF_PARALLEL_TIMEOUT=env.get("HF_PARALLEL_TIMEOUT", "300"),  # a test may bound it tighter
    )
    import torch

    torch.set_num_threads(1)
    torch.seed()  # a seed of its own from fresh entropy, as a new interpreter draws one (a fork copies the server's)
    if "numpy" in sys.modules:  # numpy's global generator likewise (Python's random reseeds itself at a fork)
        sys.modules["numpy"].random.seed()
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


def _join(context, fn, world_size: int) -> None:
    """Wait for every rank; a rank's error is raised as torch raises it (naming the rank), and a group past
    ``CASE_TIMEOUT_S`` is killed and named, so one hung case cannot stall the session."""
    deadline = time.monotonic() + CASE_TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)  # (reaped: no zombie left for the rest of the session)
            raise TimeoutError(
                f"{fn.__module__}.{fn.__qualname__} on {world_size} ranks ran past {CASE_TIMEOUT_S:.0f} s "
                "(HF_PARALLEL_TEST_CASE_TIMEOUT); its ranks were killed"
            )


def run_ranks(world_size: int, fn, *args, out_dir: str) -> list:
    """fn(rank, world_size, *args) on every rank; returns each rank's JSON-able result."""
    os.makedirs(out_dir, exist_ok=True)
    for rank in range(world_size):  # a result left by an earlier run in the same folder is not this one's
        if os.path.exists(path := os.path.join(out_dir, f"rank{rank}.json")):
            os.remove(path)
    start = _start_method()
    GROUPS.append(world_size)
    context = mp.start_processes(
        _entry,
        args=(world_size, free_port(), fn, args, out_dir, dict(os.environ), start),
        nprocs=world_size,
        join=False,
        start_method=start,
    )
    _join(context, fn, world_size)
    results = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results
