"""A training step at world 2: hf_parallel FSDP=2 and TP=2 beside transformers' own
``DistributedConfig(fsdp_size=2)`` and ``(tp_size=2)``, and one process, on the same cores.

    python benchmarks/training.py [--model llama-1gb] [--rows 4] [--seq 64] [--steps 2] [--lora R]

Every configuration trains the same model in fp32 (AdamW's master weights are the weights) on
the same global batch of ``rows`` x ``seq`` random tokens: each data-parallel rank takes its rows,
the ranks of one model replica (TP) the same ones. A step is forward, backward and
``optimizer.step()`` (no clipping: transformers' TP parameters live on several device meshes, which
``clip_grad_norm_`` cannot span outside its Trainer). One warm-up step, then ``--steps`` timed
ones. Per configuration: tokens/s of the global batch, per-rank peak RSS (the kernel's high-water
mark over load and training) and the losses, which must equal one process's.
Writes ``training.json``; prints ratios and the issue's targets.

``--lora R``: a LoRA fine-tuning step instead (peft's adapters of rank R on every attention and MLP
projection, the base frozen, AdamW on the adapters): one process, hf_parallel TP=2 and
transformers' TP=2 with peft (its error reported as such), each adapter made by
``peft.get_peft_model`` with the same seed. Writes ``training-lora.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 2**20
KINDS = {  # configuration -> ranks
    "one process": 1,
    "hf_parallel FSDP=2": 2,
    "hf_parallel TP=2": 2,
    "transformers FSDP=2": 2,
    "transformers TP=2": 2,
}
LORA_KINDS = {kind: KINDS[kind] for kind in ("one process", "hf_parallel TP=2", "transformers TP=2")}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load(kind: str, path: str):
    import torch
    import transformers

    import hf_parallel

    if kind == "one process":
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if kind.startswith("transformers"):
        from transformers.distributed import DistributedConfig

        sizes = dict(fsdp_size=2) if "FSDP" in kind else dict(tp_size=2)
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=DistributedConfig(**sizes)
        )
    sizes = dict(fsdp_size=2, tp_plan=None) if "FSDP" in kind else dict(tp_size=2)
    return hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)


def worker(kind: str, args) -> None:
    import torch
    from measure import peak_rss_bytes, timed_training_steps
    from pipeline import checkpoint

    model = load(kind, checkpoint(args.model))
    if args.lora:
        import peft

        torch.manual_seed(0)
        config = peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=LORA_TARGETS)
        model = peft.get_peft_model(model, config)
    model.train()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    data_parallel = world if "FSDP" in kind else 1  # TP ranks share a batch
    ids = torch.randint(3, model.config.vocab_size, (args.rows, args.seq), generator=torch.Generator().manual_seed(0))
    rows = args.rows // data_parallel
    mine = ids[(rank % data_parallel) * rows : (rank % data_parallel + 1) * rows]
    losses, seconds = timed_training_steps(model, mine, args.steps, data_parallel)
    result = {"step_s": sum(seconds) / len(seconds), "peak_rss": peak_rss_bytes(), "losses": losses}
    with open(os.path.join(args.out, f"training-{kind.replace(' ', '_')}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    from hf_parallel.distributed.mesh import shutdown

    shutdown()  # together, and letting gloo's threads finish first (an abort at exit otherwise)


def launch(kind: str, args) -> list[dict] | str:
    from measure import run_worker

    flags = ["--model", args.model, "--rows", str(args.rows), "--seq", str(args.seq), "--steps", str(args.steps)]
    flags += ["--lora", str(args.lora)] if args.lora else []
    return run_worker(__file__, kind, KINDS[kind], flags, args.out, HERE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1gb")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lora", type=int, help="LoRA rank: a LoRA fine-tuning step (peft) instead of full training")
    parser.add_argument("--only", nargs="+", choices=list(KINDS), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        return worker(args.worker, args)
    from pipeline import checkpoint

    checkpoint(args.model)  # build it once, before any timing
    runs = {kind: launch(kind, args) for kind in (args.only or (LORA_KINDS if args.lora else KINDS))}
    from measure import result_rows

    table = result_rows(runs, lambda ranks: {
        "tokens_per_s": args.rows * args.seq / max(r["step_s"] for r in ranks),
        "peak_rss_mib": max(r["peak_rss"] for r in ranks) / MiB,
        "losses": ranks[0]["losses"],
    })  # fmt: skip
    what = f"LoRA r={args.lora} step" if args.lora else "training step"
    print(f"\n{what}, {args.rows} x {args.seq} tokens, {args.model} in fp32 + AdamW, {os.cpu_count()} cores")
    print(f"{'configuration':<22} {'tokens/s':>9} {'peak RSS/rank MiB':>18} {'loss - 1 process':>17}")
    for kind, row in table.items():
        if "failed" in row:
            print(f"{kind:<22} failed: {row['failed']}")
            continue
        error = "-" if row["loss_error"] is None else f"{row['loss_error']:.1e}"
        print(f"{kind:<22} {row['tokens_per_s']:>9.1f} {row['peak_rss_mib']:>18.0f} {error:>17}")

    def ratio(a, b, key):
        if "failed" in table.get(a, {"failed": 1}) or "failed" in table.get(b, {"failed": 1}):
            return None
        return table[a][key] / table[b][key]

    checks = lora_checks(ratio) if args.lora else [
        ("per-rank peak RSS, hf_parallel FSDP=2 / one process <= 0.55",
         ratio("hf_parallel FSDP=2", "one process", "peak_rss_mib"), lambda r: r <= 0.55),
        ("step time, hf_parallel FSDP=2 / transformers FSDP=2 <= 1.0",
         ratio("transformers FSDP=2", "hf_parallel FSDP=2", "tokens_per_s"), lambda r: r <= 1.0),
        ("step time, hf_parallel TP=2 / transformers TP=2 <= 1.0",
         ratio("transformers TP=2", "hf_parallel TP=2", "tokens_per_s"), lambda r: r <= 1.0),
        ("step time, hf_parallel FSDP=2 / one process",
         ratio("one process", "hf_parallel FSDP=2", "tokens_per_s"), None),
        ("step time, hf_parallel TP=2 / one process",
         ratio("one process", "hf_parallel TP=2", "tokens_per_s"), None),
    ]  # fmt: skip
    print()
    for text, value, target in checks:
        if value is None:
            print(f"{text}: n/a (a configuration failed)")
        else:
            verdict = "" if target is None else (" met" if target(value) else " MISSED")
            print(f"{text}: {value:.2f}{verdict}")
    with open(os.path.join(args.out, "training-lora.json" if args.lora else "training.json"), "w") as f:
        json.dump({"args": vars(args), "table": table, "ratios": {t: v for t, v, _ in checks}}, f, indent=1)


def lora_checks(ratio) -> list:
    return [
        ("step time, hf_parallel TP=2 / transformers TP=2 with peft",
         ratio("transformers TP=2", "hf_parallel TP=2", "tokens_per_s"), lambda r: r <= 1.0),
        ("step time, hf_parallel TP=2 / one process", ratio("one process", "hf_parallel TP=2", "tokens_per_s"), None),
        ("per-rank peak RSS, hf_parallel TP=2 / one process",
         ratio("hf_parallel TP=2", "one process", "peak_rss_mib"), None),
        ("per-rank peak RSS, hf_parallel TP=2 / transformers TP=2 with peft",
         ratio("hf_parallel TP=2", "transformers TP=2", "peak_rss_mib"), None),
    ]  # fmt: skip


if __name__ == "__main__":
    main()
