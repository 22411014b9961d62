"""Memory per rank, measured against ``hf_parallel.memory``'s formulas, and the step time of overlapped
against blocking gradient sums, in one run.

    python benchmarks/memory.py [--size 1024] [--batch 1] [--seq 512] [--steps 3] [--out benchmarks/results]

A random Llama of ``--size`` MB in bfloat16 (1024: ``checkpoints.LLAMA_1GB``; smaller: the same shape
at a narrower hidden size) is built once into the cache (``HF_PARALLEL_CACHE``), then loaded in float32
at FSDP=2, FSDP=4 and TP=2 x FSDP=2 (2, 4 and 4 gloo ranks spawned here, ``--threads`` each).
Per rank:

- the load: the parameter bytes held (``memory.held_bytes``) at each ``fully_shard`` call and after
  the load, against the layout's share (``memory.footprint``); its peak, as the parameters held plus
  the TP slice being copied into its FSDP rows at each fill, and as ``MemTracker`` saw the whole load
  (which also counts the views of the mapped checkpoint a slice is read from, file pages rather than
  allocations), against ``Footprint.load_peak`` (share + the largest TP slice);
- one training step (``train_step`` with one micro-batch of ``--batch`` rows per data-parallel rank
  x ``--seq`` tokens, then AdamW's step and ``zero_grad()``), after one warm-up step: its peak tensor
  memory by torch's ``MemTracker`` (CPU tensors too) against ``memory.step_memory``, in total and by
  MemTracker's categories. Under FSDP those are not the formula's terms one for one: the layers FSDP
  gathers are all-gather outputs ('Activation' / 'Temp', besides 'Parameter' while a module runs), and
  the sharded gradients come out of the reduce-scatter ('Temp'), only once the backward reaches them.

Then TP=2 without FSDP on 2 ranks: ``train_step`` time with the gradient sums bucketed and
overlapped with the backward (``HF_PARALLEL_GRADIENT_BUCKET_MB`` unset) against blocking, one per
parameter (``=0``); the variable is read at the load, so both models are loaded in the same ranks,
and their steps alternate (``--steps`` timed each, after a warm-up; the median).

Prints one markdown table (per rank: the largest over the ranks, measured and formula each) and writes
``memory.json`` (every rank's figures) in ``--out``. The machine is named by its CPU model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this checkout's hf_parallel, not an installed copy

MiB = 2**20
LAYOUTS = {  # name -> (ranks, from_pretrained's sizes)
    "FSDP=2": (2, dict(fsdp_size=2, tp_plan=None)),
    "FSDP=4": (4, dict(fsdp_size=4, tp_plan=None)),
    "TP=2 x FSDP=2": (4, dict(tp_size=2, fsdp_size=2)),
}
BUCKET_ENV = "HF_PARALLEL_GRADIENT_BUCKET_MB"
SUMS = {"bucketed, overlapped": None, "blocking, per parameter": "0"}  # mode -> the variable's value


# ---- the checkpoint ----


def llama_config(size_mb: float) -> dict:
    """``LLAMA_1GB``'s shape (16 layers, 32k untied vocabulary, MLP 8/3 of the hidden size, heads of
    128) at the hidden size (a multiple of 256) whose bfloat16 checkpoint is nearest ``size_mb``."""
    from checkpoints import LLAMA_1GB

    def shaped(hidden: int) -> dict:
        heads = hidden // 128
        return dict(LLAMA_1GB, hidden_size=hidden, intermediate_size=round(8 * hidden / 3 / 64) * 64,
                    num_attention_heads=heads, num_key_value_heads=4 if heads % 4 == 0 else 2)  # fmt: skip

    def megabytes(config: dict) -> float:
        h, i, v, kv = (config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_key_value_heads"))
        layer = 2 * h * h + 2 * h * kv * 128 + 3 * h * i + 2 * h
        return 2 * (2 * v * h + config["num_hidden_layers"] * layer + h) / 1e6 * (1e6 / MiB)

    return min((shaped(h) for h in range(256, 8193, 256)), key=lambda c: abs(megabytes(c) - size_mb))


def checkpoint(size_mb: float) -> str:
    """The random Llama (built once, bfloat16): the benchmarks' own 1 GB one at its size."""
    import torch
    from checkpoints import LLAMA_1GB, random_llama

    config = llama_config(size_mb)
    name = "bench-llama-1gb" if config == LLAMA_1GB else f"bench-llama-hidden{config['hidden_size']}"
    return random_llama(name, config, torch.bfloat16)


# ---- inside a rank ----


@contextlib.contextmanager
def observed_load():
    """What the load holds, seen from inside it: the parameter bytes at each ``fully_shard`` call (as
    ``tests/training_workers.parameter_bytes_at_each_fully_shard``), at each fill of a parameter's FSDP
    rows the parameters held plus the TP slice being copied, and ``MemTracker``'s peak over the load
    into the shards (the model's shards, allocated before it, tracked as external)."""
    import torch.distributed.fsdp as fsdp
    from torch.distributed._tools.mem_tracker import MemTracker

    import hf_parallel.api as api
    import hf_parallel.checkpoint.loading as loading
    from hf_parallel.memory import held_bytes

    real = (fsdp.fully_shard, api.shard_data_parallel, loading._fill_shard, api.load_weights)
    seen = {"at_fully_shard": [], "at_fills": [], "tracked_peak": None}
    root = []

    def shard(module, *args, **kwargs):
        seen["at_fully_shard"].append(held_bytes(root[0].parameters()))
        return real[0](module, *args, **kwargs)

    def data_parallel(model, *args, **kwargs):
        root.append(model)
        return real[1](model, *args, **kwargs)

    def fill(param, local, group):
        held = held_bytes(root[0].parameters()) if root else 0
        seen["at_fills"].append(held + local.numel() * local.element_size())
        return real[2](param, local, group)

    def load(model, *args, **kwargs):
        if not kwargs.get("into_shards"):
            return real[3](model, *args, **kwargs)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            result = real[3](model, *args, **kwargs)
        seen["tracked_peak"] = categories(tracker.get_tracker_snapshot("peak"))
        return result

    fsdp.fully_shard, api.shard_data_parallel, loading._fill_shard, api.load_weights = shard, data_parallel, fill, load
    try:
        yield seen
    finally:
        fsdp.fully_shard, api.shard_data_parallel, loading._fill_shard, api.load_weights = real


def peak_tracker():
    """torch's ``MemTracker``, also noting where its peak was reached: the modules running, forward or
    backward (its private state, read only)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        where = None

        def _update_peak_stats(self, peak_state) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            if self._peak_mem != before:
                running = sorted(self._mod_tracker.parents - {"Global"}, key=len)
                phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
                self.where = f"{phase} of {running[-1] if running else '-'}"

    return PeakTracker()


def categories(snapshot: dict) -> dict:
    """``MemTracker``'s snapshot of the CPU as {category: bytes} (its ``Total`` included)."""
    import torch

    cpu = snapshot.get(torch.device("cpu"), {})
    return {getattr(key, "value", key): value for key, value in cpu.items()}


def batch_of(model, rows: int, seq: int):
    import torch

    return torch.randint(3, model.config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))


def measure_layout(rank: int, world: int, path: str, sizes: dict, batch: int, seq: int) -> dict:
    """One layout on this rank: the load as ``observed_load`` sees it, one training step's peak by
    ``MemTracker`` (after a warm-up step: AdamW's states exist, FSDP is initialised), and the formulas
    for this rank (``footprint``, ``step_memory``)."""
    import torch

    import hf_parallel
    from hf_parallel.memory import footprint, held_bytes, step_memory

    with observed_load() as load:
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
    model.train()
    state = hf_parallel.parallel_state(model)
    held = held_bytes(model.parameters())
    predicted = footprint(state.layout, torch.float32)
    formula = step_memory(model, state.layout, torch.float32, batch, seq)
    ids = batch_of(model, batch * state.mesh.dp.size, seq)  # every rank the global batch, each replica its rows
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        hf_parallel.train_step(model, ids, ids, micro_batches=1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = peak_tracker()
    tracker.track_external(model, optimizer, ids)
    with tracker:
        step()
    measured = categories(tracker.get_tracker_snapshot("peak"))
    return {
        "load": {**load, "after_load": held, "share": predicted.share, "largest_slice": predicted.largest_slice,
                 "load_peak": predicted.load_peak},  # fmt: skip
        "step": {"measured": measured, "peak_at": tracker.where,
                 "formula": {**dataclasses.asdict(formula), "total": formula.total}},
    }


def set_bucket_env(value: str | None) -> None:
    if value is None:
        os.environ.pop(BUCKET_ENV, None)
    else:
        os.environ[BUCKET_ENV] = value


def time_gradient_sums(rank: int, world: int, path: str, batch: int, seq: int, steps: int) -> dict:
    """TP=2 without FSDP: the same ``train_step`` on a model loaded with the gradient sums bucketed and one
    loaded with them blocking (``HF_PARALLEL_GRADIENT_BUCKET_MB``, read at the load), steps alternating."""
    import torch
    import torch.distributed as dist

    import hf_parallel

    before, models = os.environ.get(BUCKET_ENV), {}
    for mode, value in SUMS.items():
        set_bucket_env(value)
        models[mode] = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_size=2)
        models[mode].train()
    set_bucket_env(before)
    ids = batch_of(models[next(iter(SUMS))], batch, seq)
    seconds = {mode: [] for mode in SUMS}
    for index in range(steps + 1):  # the first: warm-up
        for mode, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            hf_parallel.train_step(model, ids, ids, micro_batches=1)
            dist.barrier()
            if index:
                seconds[mode].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    bucketed = {mode: getattr(hf_parallel.parallel_state(m).gradients, "_buckets", None) is not None
                for mode, m in models.items()}  # fmt: skip
    return {"seconds": seconds, "median_s": {m: statistics.median(s) for m, s in seconds.items()}, "bucketed": bucketed}


def _entry(rank: int, world: int, port: int, threads: int, out: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS=str(threads))  # fmt: skip
    import torch

    import hf_parallel.checkpoint.loading as loading

    torch.set_num_threads(threads)
    loading.tqdm = lambda iterable, *args, **kwargs: iterable  # no progress bars from every rank's load
    result = fn(rank, world, *args)
    with open(os.path.join(out, f"memory-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    from hf_parallel.distributed.mesh import shutdown

    shutdown()  # together, and letting gloo's threads finish first (an abort at exit otherwise)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, threads: int, out: str, fn, *args) -> list[dict]:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; each rank's result."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for rank in range(world):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, f"memory-rank{rank}.json"))
    mp.start_processes(_entry, args=(world, port, threads, out, fn, args), nprocs=world, join=True,
                       start_method="spawn")  # fmt: skip
    results = []
    for rank in range(world):
        with open(os.path.join(out, f"memory-rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


# ---- the table ----


def layout_rows(name: str, ranks: list[dict]) -> list[tuple]:
    """(layout, figure, measured, formula) rows, each figure the largest over the ranks."""

    def top(values) -> int:
        return max(values, default=0)

    load, step = [r["load"] for r in ranks], [r["step"] for r in ranks]
    measured = [s["measured"] for s in step]
    formula = [s["formula"] for s in step]
    rest = ("Activation", "Temp", "Other", "Buffer")  # MemTracker's categories besides the model states
    load_peak = top(x["load_peak"] for x in load)
    rows = [
        ("params held at each fully_shard call (max)", top(top(x["at_fully_shard"]) for x in load), 0),
        ("params held after the load / share", top(x["after_load"] for x in load), top(x["share"] for x in load)),
        ("load peak: params + the TP slice being filled", top(top(x["at_fills"]) for x in load), load_peak),
        ("load peak, MemTracker (mapped file views too)", top((x["tracked_peak"] or {}).get("Total", 0) for x in load),
         load_peak),
        (f"step peak, MemTracker (rank 0's: {step[0]['peak_at']})", top(m.get("Total", 0) for m in measured),
         top(f["total"] for f in formula)),
        ("  'Parameter' / params", top(m.get("Parameter", 0) for m in measured), top(f["params"] for f in formula)),
        ("  'Gradient' / grads", top(m.get("Gradient", 0) for m in measured), top(f["grads"] for f in formula)),
        ("  'Optstate' / AdamW", top(m.get("Optstate", 0) for m in measured), top(f["optimizer"] for f in formula)),
        ("  the rest / gathered unit + activations", top(sum(m.get(k, 0) for k in rest) for m in measured),
         top(f["gathered"] + f["activations"] for f in formula)),
    ]  # fmt: skip
    return [(name, *row) for row in rows]


def markdown(rows: list[tuple], timing: dict | None) -> str:
    lines = ["| layout | figure (per rank, the largest) | measured MiB | formula MiB | measured / formula |",
             "|---|---|---:|---:|---:|"]  # fmt: skip
    for layout, figure, measured, formula in rows:
        ratio = f"{measured / formula:.2f}" if formula else "-"
        lines.append(f"| {layout} | {figure} | {measured / MiB:,.1f} | {formula / MiB:,.1f} | {ratio} |")
    if timing is not None:  # the step times in the same columns: bucketed as measured, blocking as the baseline
        (bucketed, fast), (blocking, slow) = timing["median_s"].items()
        missing = "" if timing["bucketed"][bucketed] else " (this checkout buckets nothing: the same code twice)"
        lines.append(f"| TP=2 | train_step median s: gradient sums {bucketed} / {blocking} in the formula column"
                     f"{missing} | {fast:.3f} | {slow:.3f} | {fast / slow:.2f} |")  # fmt: skip
    return "\n".join(lines)


def machine() -> str:
    """The CPU model (``/proc/cpuinfo``) and the cores this process may use."""
    name = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), name)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1024, help="checkpoint size in MB (bfloat16); default ~1 GB")
    parser.add_argument("--batch", type=int, default=1, help="rows per data-parallel rank in the step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per row in the step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode of the gradient sums")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--no-timing", action="store_true", help="leave out the gradient sums' step times")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = checkpoint(args.size)  # built once, before anything is measured
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    where = machine()
    print(f"{where}; {path}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers; float32 step of "
          f"{args.batch} x {args.seq} tokens per data-parallel rank; {args.threads} thread(s) per rank", flush=True)
    runs, rows = {}, []
    for name in args.layouts:
        world, sizes = LAYOUTS[name]
        print(f"  {name} on {world} ranks ...", flush=True)
        runs[name] = spawn(world, args.threads, args.out, measure_layout, path, sizes, args.batch, args.seq)
        rows += layout_rows(name, runs[name])
    timing = None
    if not args.no_timing:
        print("  TP=2, gradient sums bucketed / blocking ...", flush=True)
        timing = spawn(2, args.threads, args.out, time_gradient_sums, path, args.batch, args.seq, args.steps)[0]
    table = markdown(rows, timing)
    print(f"\n{where}\n\n{table}")
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump({"machine": where, "args": vars(args), "checkpoint": path, "config": config, "ranks": runs,
                   "table": [dict(zip(("layout", "figure", "measured", "formula"), row)) for row in rows],
                   "timing": timing}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
