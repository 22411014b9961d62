"""Batched generation: hf_parallel's pipeline (PP=2, micro-batches) against its TP=2, one process,
and transformers' own pipeline (``DistributedConfig(pp_size=2)``: no micro-batching), one run.

    python benchmarks/pipeline.py [--model llama-1gb] [--batch 8] [--prompt-len 32] [--new-tokens 16]
                                  [--micro-batches 2 4] [--pp 2]

Every configuration generates the same batch of random prompts, half of them left-padded (greedy,
``min_new_tokens`` so every row runs to the end) with the same cores: one process with all of them, or N ranks with
cores/N threads each. One short warm-up generate, then the timed one. Per configuration: tokens/s
of the batch, per-rank peak RSS (the kernel's high-water mark over load and generation), whether
the tokens equal one process's, and for hf_parallel's pipeline the measured bubble (the share of
the generate each rank spent blocked on another stage) next to the theoretical (P-1)/(M+P-1).
Writes ``pipeline.json``; prints ratios and the issue's targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 2**20


def load(kind: str, path: str, dtype, micro_batches: int, pp: int):
    import torch.distributed as dist
    import transformers

    import hf_parallel

    if kind == "single":
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if kind == "transformers_pp":
        from transformers.distributed import DistributedConfig

        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=DistributedConfig(pp_size=pp)
        )
    if kind == "hf_parallel_tp":
        return hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    assert dist.is_initialized() or pp == 1
    return hf_parallel.AutoModelForCausalLM.from_pretrained(
        path, pp_size=pp, tp_plan=None, dtype=dtype, micro_batches=micro_batches or None
    )


def padded_prompts(rows: int, length: int, vocab: int) -> dict:
    """Random prompts of different lengths, as a real batch is: the second half left-padded by up
    to a quarter of ``length`` (padding is where transformers' own pipeline goes wrong)."""
    import torch

    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for row in range(rows // 2, rows):
        mask[row, : (row - rows // 2 + 1) * max(1, length // (2 * rows))] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def worker(kind: str, args) -> None:
    import torch
    import torch.distributed as dist
    from measure import peak_rss_bytes

    from hf_parallel import parallel_state
    from hf_parallel.distributed.mesh import get_mesh

    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and kind != "transformers_pp":
        get_mesh(pp_size=args.pp if kind == "hf_parallel_pp" else 1)  # joins the process group
    path = checkpoint(args.model)
    model = load(kind, path, getattr(torch, args.dtype), args.micro, args.pp)
    vocab = model.config.vocab_size
    prompts = padded_prompts(args.batch, args.prompt_len, vocab)
    options = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(**prompts, max_new_tokens=2, min_new_tokens=2, **options)  # warm-up
        state = parallel_state(model) if kind.startswith("hf_parallel") else None
        link = state.stage.link if state is not None and state.stage is not None else None
        if link is not None:
            link.waited = 0.0
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        out = model.generate(**prompts, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **options)
        seconds = time.perf_counter() - start
    rank = int(os.environ.get("RANK", 0))
    result = {
        "seconds": seconds,
        "tokens_per_s": args.batch * args.new_tokens / seconds,
        "peak_rss": peak_rss_bytes(),
        "tokens": out[:, args.prompt_len :].tolist(),
        "bubble": None if link is None else link.waited / seconds,
    }
    with open(os.path.join(args.out, f"{kind}-{args.micro}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    from hf_parallel.distributed.mesh import shutdown

    shutdown()  # together, and letting gloo's threads finish first (an abort at exit otherwise)


def checkpoint(name: str) -> str:
    """A checkpoint directory as is, or one of checkpoints.py's by name (built once)."""
    if os.path.isdir(name):
        return name
    from checkpoints import CHECKPOINTS

    return CHECKPOINTS[name]()


def launch(kind: str, nproc: int, args, micro: int = 0, gloo: bool = False) -> list[dict]:
    """``gloo``: stages exchange over gloo instead of shared memory (HF_PARALLEL_SHM=0, the A/B)."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": HERE, "HF_PARALLEL_SHM": "0" if gloo else "1"}
    worker_args = [os.path.abspath(__file__), "--worker", kind, "--micro", str(micro), "--out", args.out]
    worker_args += ["--model", args.model, "--batch", str(args.batch), "--prompt-len", str(args.prompt_len)]
    worker_args += ["--new-tokens", str(args.new_tokens), "--pp", str(args.pp), "--dtype", args.dtype]
    command = [sys.executable, *worker_args]
    if nproc > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *worker_args,
        ]
    label = f"{kind}" + (f" M={micro or 'auto'}" if kind == "hf_parallel_pp" else "")
    print(f"  {label} x{nproc} ({threads} thread(s) each) ...", flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"    failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        return []
    return [json.load(open(os.path.join(args.out, f"{kind}-{micro}-rank{r}.json"))) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1gb")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", help="float32: tokens comparable bit for bit with one process")
    parser.add_argument(
        "--micro-batches",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="0: hf_parallel's default (prefill split per stage, decode whole)",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        return worker(args.worker, args)
    checkpoint(args.model)  # build it once, before any timing
    runs = {
        "one process": launch("single", 1, args),
        f"hf_parallel TP={args.pp}": launch("hf_parallel_tp", args.pp, args),
    }
    runs[f"transformers PP={args.pp}"] = launch("transformers_pp", args.pp, args)
    for micro in args.micro_batches:
        runs[f"hf_parallel PP={args.pp} M={micro or 'auto'}"] = launch("hf_parallel_pp", args.pp, args, micro)
    runs[f"hf_parallel PP={args.pp} M=auto over gloo"] = launch("hf_parallel_pp", args.pp, args, 0, gloo=True)
    reference = runs["one process"][0]["tokens"] if runs["one process"] else None
    table = {}
    for name, ranks in runs.items():
        if not ranks:
            table[name] = None
            continue
        table[name] = {
            "tokens_per_s": min(r["tokens_per_s"] for r in ranks),
            "peak_rss_mib": max(r["peak_rss"] for r in ranks) / MiB,
            "same_tokens": all(r["tokens"] == reference for r in ranks),
            "rows_same": min(sum(a == b for a, b in zip(r["tokens"], reference)) for r in ranks),
            "bubble_measured": max(r["bubble"] for r in ranks) if ranks[0]["bubble"] is not None else None,
        }
        if name.startswith("hf_parallel PP"):
            micro = name.rsplit("M=", 1)[1].split()[0]
            micro = int(micro) if micro != "auto" else None
            table[name]["bubble_theory"] = None if micro is None else (args.pp - 1) / (micro + args.pp - 1)
    print(
        f"\nbatched generation, {args.batch} prompts x {args.new_tokens} new tokens, {args.model} ({args.dtype}), "
        f"{os.cpu_count()} cores"
    )
    print(
        f"{'configuration':<36} {'tokens/s':>9} {'peak RSS/rank MiB':>18} {'rows = 1 process':>17} {'bubble (measured / theory)':>28}"
    )
    for name, row in table.items():
        if row is None:
            print(f"{name:<36} failed")
            continue
        bubble = ""
        if row["bubble_measured"] is not None:
            theory = row["bubble_theory"]
            bubble = f"{row['bubble_measured']:.2f} / " + ("-" if theory is None else f"{theory:.2f}")
        rows = f"{row['rows_same']}/{args.batch}"
        print(f"{name:<36} {row['tokens_per_s']:>9.1f} {row['peak_rss_mib']:>18.0f} {rows:>17} {bubble:>28}")
    tp, theirs = table.get(f"hf_parallel TP={args.pp}"), table.get(f"transformers PP={args.pp}")
    best = max(
        (row for name, row in table.items() if name.startswith("hf_parallel PP") and "gloo" not in name and row),
        key=lambda r: r["tokens_per_s"],
        default=None,
    )
    if best and tp:
        print(
            f"\nbest PP vs TP: throughput {best['tokens_per_s'] / tp['tokens_per_s']:.2f}x (target >= 0.8), "
            f"peak RSS {best['peak_rss_mib'] / tp['peak_rss_mib']:.2f}x (target <= 1.1)"
        )
    piped, gloo = table.get(f"hf_parallel PP={args.pp} M=auto"), table.get(f"hf_parallel PP={args.pp} M=auto over gloo")
    if piped and gloo:
        ratio = piped["tokens_per_s"] / gloo["tokens_per_s"]
        print(f"PP M=auto, shared-memory pipes over gloo: throughput {ratio:.2f}x (target >= 1.1 on a prefill)")
    if best and theirs:
        print(
            f"best PP vs transformers' PP: throughput {best['tokens_per_s'] / theirs['tokens_per_s']:.2f}x (target >= 1.5)"
        )
    with open(os.path.join(args.out, "pipeline.json"), "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
