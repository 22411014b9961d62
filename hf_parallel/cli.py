"""hf-parallel generate | plan | consolidate  (run ``generate`` under torchrun; the others need no processes)."""

from __future__ import annotations

import argparse
import sys
import time


def cmd_generate(args) -> None:
    import torch
    import transformers

    from .api import AutoModelForCausalLM
    from .default_model import default_checkpoint
    from .mesh import shutdown

    path = args.model or default_checkpoint()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=args.dtype)
    load_seconds = time.perf_counter() - start
    main = model._hf_parallel.mesh.is_main
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompts = (
        [args.prompt]
        if args.prompts_file is None
        else [line.rstrip("\n") for line in open(args.prompts_file) if line.strip()]
    )
    torch.manual_seed(args.seed)  # same seed on every rank: sampling picks the same token everywhere
    for prompt in prompts:
        if tokenizer.chat_template and not args.no_chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        else:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
        streamer = transformers.TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if main else None
        sampling = (
            dict(do_sample=True, temperature=args.temperature, top_p=args.top_p)
            if args.temperature > 0
            else dict(do_sample=False)
        )
        start = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=args.max_new_tokens, streamer=streamer, pad_token_id=tokenizer.eos_token_id, **sampling
        )
        seconds = time.perf_counter() - start
        if main:
            new = out.shape[1] - ids.shape[1]
            print(
                f"[{new} tokens in {seconds:.2f}s: {new / seconds:.1f} tokens/s; load {load_seconds:.2f}s; tp={model._hf_parallel.mesh.world_size}]",
                flush=True,
            )
    shutdown()


def cmd_plan(args) -> None:
    from .report import plan_report

    print(plan_report(args.path, args.tp, tp_plan=args.tp_plan))


def cmd_consolidate(args) -> None:
    from .consolidate import consolidate

    done = consolidate(args.dir, args.out, max_shard_size=args.max_shard_size)
    seconds = max(done["seconds"], 1e-9)
    print(f"{args.out}: {done['bytes'] / 1e6:.1f} MB in {seconds:.2f}s ({done['bytes'] / seconds / 1e6:.1f} MB/s)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="hf-parallel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text (run under torchrun for tensor parallelism)")
    gen.add_argument("--model", help="checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", default="What is tensor parallelism? Answer in one sentence.")
    gen.add_argument("--prompts-file", help="one prompt per line")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--no-chat-template", action="store_true")
    gen.set_defaults(func=cmd_generate)
    plan = sub.add_parser("plan", help="dry run: every parameter's rule, style, layout and bytes per rank")
    plan.add_argument("path")
    plan.add_argument("--tp", type=int, required=True)
    plan.add_argument("--tp-plan", default="auto")
    plan.set_defaults(func=cmd_plan)
    merge = sub.add_parser(
        "consolidate", help="a distributed save (save_pretrained(distributed=True)) to a standard checkpoint"
    )
    merge.add_argument("dir")
    merge.add_argument("out")
    merge.add_argument("--max-shard-size", default="5GB")
    merge.set_defaults(func=cmd_consolidate)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
