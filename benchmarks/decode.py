"""Decode speed, eager and compiled: hf_parallel at TP=N against one process (and transformers' own TP
where it can split the model), side by side in one run, greedy, through ``generate`` itself.

    python benchmarks/decode.py [--models smollm2-135m llama-1gb] [--tp 2] [--new-tokens 32] [--rounds 3]

Per implementation, up to three modes: ``eager`` (generate's default dynamic cache), ``compiled`` (a
static cache and ``torch.compile(model.forward, fullgraph=True)``, gpt-fast's recipe; one warm-up generate
compiles) and ``reduce-overhead`` (the same, captured as CUDA graphs: ``--modes eager compiled
reduce-overhead`` on a GPU; it needs NCCL, one rank a GPU, since gloo cannot be captured). A token's
time is the gap between two consecutive tokens reaching generate's streamer, so prefill is left out;
each mode reports the median gap. One process gets every core, N ranks cores/N threads each. Prints
ratios (tokens/s against one process eager, and compiled against compiled) and writes ``decode.json``;
every run's tokens must agree with one process's. ``--impls`` picks the implementations (the first is the
baseline): a quantized checkpoint's ``hf_parallel`` (dequantized as read) against ``hf_parallel_kept``
(``keep_quantized=True``: the package's FP8 kernel on a card that runs it, else dequantized per module),
``hf_parallel_kept_fp8`` (``keep_quantized="fp8"``: FP8 products where the card has them) and
``hf_parallel_kept_int4`` (``keep_quantized="int4"``: torch's int4 kernel for GPTQ / AWQ); with the weights each
rank holds (MB). ``hf_parallel_fsdp`` is FSDP2 at ``--tp`` ranks instead (eager): each rank generates the prompt,
gathering each layer once per ``generate`` (``distributed/fsdp.py``), and ``hf_parallel_fsdp_per_token`` the same
with FSDP's own hooks alone, which gather each layer at every token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KEPT = {"hf_parallel": False, "hf_parallel_kept": True, "hf_parallel_kept_fp8": "fp8", "hf_parallel_kept_int4": "int4"}
FSDP = "hf_parallel_fsdp"  # FSDP=N in place of TP=N: every rank generates the prompt, each layer gathered once a call
FSDP_PER_TOKEN = "hf_parallel_fsdp_per_token"  # the same with FSDP's own hooks alone: each layer gathered per token



def worker(args) -> None:
    import torch
    import transformers

    rank = int(os.environ.get("RANK", 0))
    dtype = getattr(torch, args.dtype)
    if args.impl in (FSDP, FSDP_PER_TOKEN):
        import hf_parallel

        world = int(os.environ["WORLD_SIZE"])
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(args.model, tp_plan=None, fsdp_size=world, dtype=dtype)
        if args.impl == FSDP_PER_TOKEN:
            del model.generate  # transformers' own again, without the gather once per call
    elif args.impl.startswith("hf_parallel"):
        import hf_parallel

        kept = KEPT[args.impl]
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", dtype=dtype,
                                                                 **({"keep_quantized": kept} if kept else {}))
    else:
        tp = dict(tp_plan="auto") if args.impl == "transformers" else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **tp)
        if not tp and torch.cuda.is_available():  # one process on the card the ranks share
            model.to("cuda")
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(model.device)
    result = {"impl": args.impl, "mode": args.mode, "rank": rank, "threads": torch.get_num_threads()}
    kinds = {type(m.kernel).__name__ for m in model.modules() if hasattr(m, "kept_weight")}  # kept linears' kernels
    result["fp8_products"], result["fp8_weight_only"] = "FP8ScaledMMKernel" in kinds, "FP8WeightOnlyKernel" in kinds
    result["int4_torch"] = "Int4TorchKernel" in kinds
    experts = [rows for m in model.modules() if getattr(m, "kernel_products", False) is True  # kept_experts
               for rows in m.kept_rows.values()]  # fmt: skip
    result["fp8_experts"] = any(rows.int4_stacks is None for rows in experts)
    result["int4_experts"] = any(rows.int4_stacks is not None for rows in experts)
    if args.impl.startswith("hf_parallel"):
        from worker import local_param_bytes  # this directory: run.py's measure of the weights a rank holds

        result["held_mb"] = local_param_bytes(model) / 1e6
    result["device"] = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if args.mode in ("compiled", "reduce-overhead"):
        options["cache_implementation"] = "static"
        how = dict(mode="reduce-overhead") if args.mode == "reduce-overhead" else {}
        model.forward = torch.compile(model.forward, fullgraph=True, **how)
    stamps = []

    class Clock(transformers.generation.streamers.BaseStreamer):
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(prompt, **options)  # warm-up (compiles)
        result["warm_up_s"] = time.perf_counter() - start
        gaps = []
        for _ in range(args.repeats):
            stamps.clear()
            out = model.generate(prompt, streamer=Clock(), **options)
            gaps += [b - a for a, b in zip(stamps[2:], stamps[3:])]  # stamps[0]: the prompt, [1]: prefill's token
    result["s_per_token"] = statistics.median(gaps)
    result["tokens"] = out[0, args.prompt_len :].tolist()
    with open(os.path.join(args.out, f"{args.impl}-{args.mode}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if "hf_parallel" in sys.modules:
        sys.modules["hf_parallel"].distributed.mesh.shutdown()
    elif torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def launch(impl: str, mode: str, nproc: int, model: str, args) -> dict:
    threads = max(1, (os.cpu_count() or 1) // nproc)
    pythonpath = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": pythonpath}
    command = [os.path.abspath(__file__), "--worker", "--impl", impl, "--mode", mode, "--model", model]
    command += ["--out", args.out, "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len)]
    command += ["--repeats", str(args.repeats), "--dtype", args.dtype]
    if nproc == 1:
        command = [sys.executable, *command]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *command]
    path = os.path.join(args.out, f"{impl}-{mode}-rank0.json")
    if os.path.exists(path):
        os.remove(path)
    log = os.path.join(args.out, f"{impl}-{mode}.log")
    print(f"  {impl} {mode} x{nproc} ({threads} thread(s) each) ...", flush=True)
    with open(log, "w") as f:
        try:
            subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"over --timeout {args.timeout} s (log: {log})"}
    if not os.path.exists(path):
        return {"error": f"no result (log: {log})"}
    with open(path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--impl", default="single")
    parser.add_argument("--mode", default="eager")
    parser.add_argument("--model")
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"], help="names in checkpoints.py, or paths")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"],
                        choices=["eager", "compiled", "reduce-overhead"])
    parser.add_argument("--impls", nargs="+", default=["single", "hf_parallel"],
                        choices=["single", *KEPT, FSDP, FSDP_PER_TOKEN],
                        help="hf_parallel_kept: keep_quantized=True (FP8 kernel on a GPU, else dequantized per "
                        "module); hf_parallel_kept_fp8: keep_quantized='fp8' (FP8 products where the card has them); "
                        "hf_parallel_kept_int4: keep_quantized='int4' (torch's int4 kernel); hf_parallel_fsdp: "
                        "fsdp_size=--tp instead of TP (eager only), hf_parallel_fsdp_per_token: the same gathering "
                        "each layer per token (FSDP's hooks alone); the first is the baseline")
    parser.add_argument("--transformers-tp", action="store_true", help="also transformers' own TP (where it splits)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--timeout", type=int, default=1800)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        return worker(args)
    sys.path.insert(0, HERE)
    from checkpoints import CHECKPOINTS

    report = {}
    for name in args.models:
        path = CHECKPOINTS[name]() if name in CHECKPOINTS else name
        runs = [(impl, 1 if impl == "single" else args.tp) for impl in args.impls]
        runs += [("transformers", args.tp)] * args.transformers_tp
        rows: dict = {}
        for _ in range(args.rounds):  # rounds interleave the implementations: a noisy spell hits all of them
            for impl, nproc in runs:
                for mode in args.modes if "fsdp" not in impl else [m for m in args.modes if m == "eager"]:
                    rows.setdefault(f"{impl} {mode}", []).append(launch(impl, mode, nproc, path, args))
        report[name] = {key: summarize(results) for key, results in rows.items()}
        print(table(name, report[name], args.tp, args.dtype))
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(report, f, indent=1)


def summarize(results: list[dict]) -> dict:
    failed = next((r for r in results if "error" in r), None)
    if failed is not None:
        return failed
    return {**results[0], "s_per_token": statistics.median(r["s_per_token"] for r in results)}


def table(name: str, rows: dict, tp: int, dtype: str) -> str:
    first = next(iter(rows)).split()[0]  # the baseline: the first implementation run
    base = rows[f"{first} eager"]
    where = base.get("device", "cpu")
    lines = [f"\n## {name}: decode, {dtype}, TP={tp}, on {where}\n",
             f"| run | ms/token | tokens/s | x {first} eager |"
             f" x {first} compiled | tokens as {first} eager | weights held per rank (MB) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, row in rows.items():
        if "error" in row:
            lines.append(f"| {key} | failed: {row['error']} | | | | | |")
            continue
        def speed(other: dict) -> str:  # how many times faster than ``other``
            return "-" if "error" in other else f"{other['s_per_token'] / row['s_per_token']:.2f}x"

        agree = sum(a == b for a, b in zip(row["tokens"], base.get("tokens", [])))
        same = "-" if "error" in base else f"{agree}/{len(base['tokens'])}"
        compiled = rows.get(f"{first} compiled", {"error": "-"})
        label = f"{key} (FP8 products)" if row.get("fp8_products") else key
        label = f"{label} (FP8 kernel)" if row.get("fp8_weight_only") else label
        label = f"{label} (int4 kernel)" if row.get("int4_torch") else label
        label = f"{label} (FP8 experts kernel)" if row.get("fp8_experts") else label
        label = f"{label} (int4 experts kernel)" if row.get("int4_experts") else label
        held = f"{row['held_mb']:.0f}" if "held_mb" in row else "-"
        lines.append(f"| {label} | {row['s_per_token'] * 1e3:.1f} | {1 / row['s_per_token']:.1f} | {speed(base)} | "
                     f"{speed(compiled)} | {same} | {held} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
