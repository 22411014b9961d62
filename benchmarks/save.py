"""The gathered save against one process's: ``save_pretrained`` of the same checkpoint, into a fresh
directory, timed A/B in one run.

    python benchmarks/save.py [--model llama-1gb] [--rounds 3] [--dir DIR]

Configurations: transformers in one process (all cores), hf_parallel at TP=2 and at VTP [2,1]
(3 ranks), each with its default save (rank 0 writes straight to the disk, ``O_DIRECT``) and with
``HF_PARALLEL_DIRECT_IO=0`` (through the page cache: this benchmark's "before"). Each configuration
loads once and reads every weight, then saves ``--rounds`` times, each into a new directory after
``sync`` (no dirty pages of the last round throttle the next). Reported per configuration: the
median save seconds, its ratio to one process's, and rank 0's profile (seconds in gather, write,
fsync, rename). Writes ``save.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CONFIGS = {  # name -> (ranks, from_pretrained keywords, environment)
    "transformers, one process": (1, None, {}),
    "hf_parallel TP=2, through the page cache": (2, {"tp_plan": "auto"}, {"HF_PARALLEL_DIRECT_IO": "0"}),
    "hf_parallel TP=2": (2, {"tp_plan": "auto"}, {}),
    "hf_parallel VTP [2,1], through the page cache": (3, {"stage_tp_sizes": [2, 1]}, {"HF_PARALLEL_DIRECT_IO": "0"}),
    "hf_parallel VTP [2,1]": (3, {"stage_tp_sizes": [2, 1]}, {}),
}


def worker(name: str, args) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from pipeline import checkpoint

    import hf_parallel
    from hf_parallel.checkpoint.writer import TIMES

    path = checkpoint(args.model)
    keywords = CONFIGS[name][1]
    if keywords is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **keywords)
    with torch.no_grad():  # every weight resident, as after a run: the save reads memory, not the source file
        for param in model.parameters():
            param.float().sum()
    rank = int(os.environ.get("RANK", 0))
    seconds, profiles = [], []
    for round_ in range(args.rounds):
        out = os.path.join(args.dir, f"round{round_}")
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
        os.sync()
        if dist.is_initialized():
            dist.barrier()
        TIMES.clear()
        start = time.perf_counter()
        model.save_pretrained(out)
        seconds.append(time.perf_counter() - start)
        profiles.append(dict(TIMES))
    if rank == 0:
        for round_ in range(args.rounds):
            shutil.rmtree(os.path.join(args.dir, f"round{round_}"), ignore_errors=True)
        with open(os.path.join(args.out, "save-result.json"), "w") as f:
            json.dump({"seconds": seconds, "profiles": profiles}, f)
    from hf_parallel.distributed.mesh import shutdown

    shutdown()  # together, and letting gloo's threads finish first (an abort at exit otherwise)


def launch(name: str, args) -> dict | None:
    ranks, _, extra = CONFIGS[name]
    env = {**os.environ, **extra, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)), "PYTHONPATH": HERE}
    command = [os.path.abspath(__file__), "--worker", name, "--model", args.model, "--rounds", str(args.rounds)]
    command += ["--dir", args.dir, "--out", args.out]
    if ranks > 1:
        command = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *command]
    print(f"  {name} ...", flush=True)
    done = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"    failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        return None
    return json.load(open(os.path.join(args.out, "save-result.json")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1gb")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=os.path.join(HERE, "results", "saves"), help="where the saves go")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.dir, exist_ok=True)
    if args.worker:
        return worker(args.worker, args)
    from pipeline import checkpoint

    checkpoint(args.model)  # build it once, before any timing
    table = {name: launch(name, args) for name in CONFIGS}
    single = table["transformers, one process"]
    reference = statistics.median(single["seconds"]) if single else None
    print(f"\nsave_pretrained of {args.model} (bf16) into {args.dir}, median of {args.rounds}, {os.cpu_count()} cores")
    print(f"{'configuration':<46} {'seconds':>8} {'x one process':>14}   rank 0: gather / write / fsync / rename s")
    for name, result in table.items():
        if result is None:
            print(f"{name:<46} failed")
            continue
        median = statistics.median(result["seconds"])
        middle = sorted(range(args.rounds), key=lambda i: result["seconds"][i])[args.rounds // 2]
        phases = result["profiles"][middle]
        profile = " / ".join(f"{phases.get(p, 0.0):.2f}" for p in ("gather", "write", "fsync", "rename"))
        ratio = f"{median / reference:.2f}x" if reference else "-"
        print(f"{name:<46} {median:>8.2f} {ratio:>14}   {profile if name.startswith('hf_parallel') else ''}")
        result["median"] = median
    for name in ("hf_parallel TP=2", "hf_parallel VTP [2,1]"):
        if table.get(name) and reference:
            ratio = table[name]["median"] / reference
            print(f"target {name} <= 1.2x one process: {ratio:.2f}x, {'met' if ratio <= 1.2 else 'missed'}")
    with open(os.path.join(args.out, "save.json"), "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
