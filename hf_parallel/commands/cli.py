"""hf-parallel generate | serve | plan | verify | consolidate  (``generate`` and ``serve`` run under torchrun,
``verify`` under torchrun or starting its own ranks; the others need no processes)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from .flags import (KEEP_QUANTIZED_HELP, KEPT_MODES, DefaultsShown, KeepQuantized, add_layout_flags, byte_size,
                    layout_kwargs, pipeline_kwargs, tp_plan_arg)  # fmt: skip
from .refusals import answered_once


def read_prompts(args) -> list[str]:
    if args.prompts_file is None:
        return [args.prompt]
    with open(args.prompts_file) as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError(f"{args.prompts_file}: no prompts in it (one per line)")
    return prompts


def encode(tokenizer, prompts: list[str], chat: bool):
    """Token ids and attention mask of a batch, left-padded so every row ends where generation starts."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat:
        conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
        return tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompts, padding=True, return_tensors="pt")


def generated_lengths(new_tokens, eos_ids: set[int]) -> list[int]:
    """New tokens per row, up to and including the first end-of-sequence (the rest is padding)."""
    lengths = []
    for row in new_tokens.tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        lengths.append(ends[0] + 1 if ends else len(row))
    return lengths


def cmd_generate(args) -> None:
    import torch
    import transformers

    from ..api import AutoModelForCausalLM
    from ..distributed.mesh import shutdown
    from ..state import parallel_state
    from ..quant.kept import kept_products
    from .default_model import default_checkpoint

    path = args.model or default_checkpoint()
    start = time.perf_counter()
    kept = dict(keep_quantized=args.keep_quantized) if args.keep_quantized else {}
    layout_asked = layout_kwargs(args)
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan=tp_plan_arg(args.tp_plan), dtype=args.dtype,
                                                 **layout_asked, **kept)  # fmt: skip
    load_seconds = time.perf_counter() - start
    mesh = parallel_state(model).mesh
    announce("generate", path, model)
    ways = ", ".join(f"{n} {way}" for way, n in sorted(kept_products(model).items())) if args.keep_quantized else ""
    how = f"; rank 0's kept modules: {ways}" if ways else ""  # which took a kernel, which dequantize
    main, layout = mesh.is_main, str(mesh.shape)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    chat = bool(tokenizer.chat_template) and not args.no_chat_template
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])
    sampling = (
        dict(do_sample=True, temperature=args.temperature, top_p=args.top_p)
        if args.temperature > 0
        else dict(do_sample=False)
    )
    prompts = read_prompts(args)
    replicas = ReplicaShare(prompts, mesh.dp, args.batch_size)  # each data-parallel replica its share of the prompts
    stream = main and args.prompts_file is None and mesh.dp.size == 1  # --prompt streams; batches print once done
    torch.manual_seed(args.seed)  # same seed on every rank: sampling picks the same token everywhere
    for numbers, batch in replicas.batches():
        inputs = {name: tensor.to(mesh.device) for name, tensor in encode(tokenizer, batch, chat).items()}
        streamer = transformers.TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
        start = time.perf_counter()
        out = model.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            streamer=streamer,
            **(dict(cache_implementation="dynamic") if mesh.sp.size > 1 else {}),  # the cache split over the SP group
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
        seconds = time.perf_counter() - start
        new_tokens = out[:, inputs["input_ids"].shape[1] :]
        lengths = generated_lengths(new_tokens, eos_ids)
        texts = [tokenizer.decode(row[:length], skip_special_tokens=True) for row, length in zip(new_tokens, lengths)]
        done = replicas.gathered(list(zip(numbers, texts, lengths)), mesh)  # every replica's, on rank 0
        if not main:
            continue
        if not stream:
            for number, text, _ in done:
                print(f"### prompt {number + 1}: {prompts[number]}\n{text}\n", flush=True)
        lengths, batch = [length for _, _, length in done], [prompts[number] for number, _, _ in done]
        total = sum(lengths)
        what = f"{total} tokens" if stream else f"{total} tokens for {len(batch)} prompt{'s' * (len(batch) > 1)}"
        print(
            f"[{what} in {seconds:.2f}s: {total / seconds:.1f} tokens/s; load {load_seconds:.2f}s; {layout}{how}]",
            flush=True,
        )
    shutdown()


class ReplicaShare:
    """``generate --dp-replicate N`` (or ``--fsdp N``): each data-parallel replica generates its own share of the
    prompts (every N-th), in batches, all replicas the same number of calls (one left without prompts repeats the
    first, its output dropped: under ``--ep`` or ``--fsdp`` every forward exchanges with the other replicas)."""

    def __init__(self, prompts: list[str], dp, batch_size: int):
        self.prompts, self.dp, self.batch_size = prompts, dp, batch_size
        self.mine = list(range(dp.rank, len(prompts), dp.size))

    def batches(self):
        """(prompt numbers, prompts) of each call; numbers empty where this replica only steps along."""
        calls = -(-(-(-len(self.prompts) // self.dp.size)) // self.batch_size)
        for call in range(calls):
            numbers = self.mine[call * self.batch_size : (call + 1) * self.batch_size]
            yield numbers, [self.prompts[n] for n in numbers] or self.prompts[:1]

    def gathered(self, outputs: list[tuple], mesh) -> list[tuple]:
        """Every replica's ``(number, ...)`` outputs of one call, in prompt order, on rank 0 (this rank's
        alone without replicas); a replica only stepping along gives none."""
        import torch.distributed as dist

        if self.dp.size == 1:
            return outputs
        everyone = [None] * mesh.world_size
        dist.all_gather_object(everyone, outputs if mesh.tp.rank == 0 else [], group=mesh.world.group)
        return sorted(item for part in everyone for item in part)


def announce(command: str, path: str, model) -> None:
    """Rank 0 says, once loaded, the layout the sizes resolved to (the ranks an unset --tp took among them)."""
    from ..state import parallel_state

    state = parallel_state(model)
    mesh = state.mesh
    if mesh.is_main:
        dtype = str(model.dtype).removeprefix("torch.")
        print(f"hf-parallel {command}: {path} on {mesh.world_size} rank{'s' * (mesh.world_size > 1)} as {mesh.shape} "
              f"({mesh.device.type}, {dtype}; plan: {state.layout.source})", file=sys.stderr, flush=True)  # fmt: skip


def cmd_plan(args) -> None:
    from ..memory import Savings
    from .report import parse_lora, plan_facts, plan_report

    sizes = dict(tp_plan=tp_plan_arg(args.tp_plan), dtype=args.dtype, sp=args.sp, cp=args.cp, seq=args.seq,
                 fsdp_size=args.fsdp, dp_replicate_size=args.dp_replicate, nproc_per_node=args.nproc_per_node,
                 lora=parse_lora(args.lora) if args.lora else None, batch=args.batch, ep_size=args.ep)  # fmt: skip
    if args.ep_plan:
        sizes["ep_plan"] = args.ep_plan
    if args.offload_checkpoints and not args.checkpointing:
        raise SystemExit("hf-parallel plan: --offload-checkpoints offloads the checkpointed layers' inputs; add "
                         "--checkpointing (from_pretrained refuses offload_checkpoints without it too)")  # fmt: skip
    sizes["savings"] = Savings(args.checkpointing, args.offload_checkpoints, args.tiled_loss, args.tiled_mlp)
    stages = pipeline_kwargs(args)
    if args.html and (stages.get("pp_size", 1) > 1 or stages.get("stage_tp_sizes")):
        raise SystemExit("hf-parallel plan --html draws one replica without pipeline stages; drop --pp/--stage-tp "
                         "(the text report shows each stage)")  # fmt: skip
    if not args.html:
        print(plan_report(args.path, args.tp, **sizes, **stages))
        return
    from .plan_html import render

    facts = plan_facts(args.path, args.tp, **sizes)
    print("\n".join(facts.lines()))
    with open(args.html, "w") as f:
        f.write(render(facts))
    print(f"wrote {args.html}")


def start_ranks(world_size: int, command: list[str]) -> int:
    """Run ``command`` as ``world_size`` ranks on this host (what torchrun would do, without its
    launcher); the first rank to fail stops the others. Returns the exit status of the first rank
    that failed by itself, else 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"OMP_NUM_THREADS": "1", **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ranks = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size)},
        )
        for r in range(world_size)
    ]
    while any(p.poll() is None for p in ranks):
        if any(p.returncode for p in ranks):  # one failed: the others would wait for it until the timeout
            for p in ranks:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.1)
    codes = [p.returncode for p in ranks]  # negative: stopped by a signal, after another rank failed
    return next((code for code in codes if code > 0), 1 if any(codes) else 0)


def cmd_verify(args) -> int:
    """Under torchrun: the comparison itself (a layout or plan that cannot split the model refused before any
    weight is read). Otherwise: start the layout's ranks (``--tp`` x ``--sp``, times ``--pp`` or with
    ``--stage-tp``'s sum) running this same command, and pass on their exit status."""
    from ..distributed.shape import MeshShape

    stages = pipeline_kwargs(args)
    sizes = {key: value for key, value in stages.items() if key in ("pp_size", "stage_tp_sizes")}
    world = MeshShape.requested(tp_size=None if args.stage_tp else args.tp, sp_size=args.sp, cp_size=args.cp,
                                **sizes).world_size  # fmt: skip
    if "WORLD_SIZE" not in os.environ and world > 1:
        return start_ranks(world, [sys.executable, "-m", "hf_parallel", *sys.argv[1:]])
    from ..distributed.mesh import shutdown
    from .verify import verify

    report = verify(args.path, tp_plan_arg(args.tp_plan), args.dtype, args.tolerance, args.tp, args.sp,
                    reference_memory=args.reference_memory, cp_size=args.cp, **stages)  # fmt: skip
    if report is not None:
        print(report, flush=True)
    shutdown()
    return 1 if report is not None and report.first_divergence is not None else 0


def cmd_consolidate(args) -> None:
    from ..checkpoint.consolidate import consolidate

    done = consolidate(args.dir, args.out, max_shard_size=args.max_shard_size)
    seconds = max(done["seconds"], 1e-9)
    print(f"{args.out}: {done['bytes'] / 1e6:.1f} MB in {seconds:.2f}s ({done['bytes'] / seconds / 1e6:.1f} MB/s)")


def cmd_serve(args) -> int:
    import transformers

    from ..api import AutoModelForCausalLM
    from ..serving.server import check_serving_packages, serve
    from .default_model import default_checkpoint

    check_serving_packages()
    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models named ({args.model_path} and --model {args.model})")
    path = args.model_path or args.model or default_checkpoint()
    kept = dict(keep_quantized=args.keep_quantized) if args.keep_quantized else {}
    budget = dict(kv_cache_memory_bytes=args.kv_cache_memory) if args.kv_cache_memory else {}
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan=tp_plan_arg(args.tp_plan), dtype=args.dtype,
                                                 **layout_kwargs(args), **kept, **budget)  # fmt: skip
    announce("serve", path, model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    name = args.served_model_name or os.path.basename(os.path.normpath(path))
    return serve(model, tokenizer, name, host=args.host, port=args.port, api_key=args.api_key,
                 temperature=args.temperature, max_batch_tokens=args.max_batch_tokens)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag (the docs' CLI reference is generated from it)."""
    parser = argparse.ArgumentParser(prog="hf-parallel", description=__doc__, formatter_class=DefaultsShown)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_serve, _add_plan, _add_verify, _add_consolidate):
        add(sub)
    return parser


def _command(sub, name: str, help: str):
    return sub.add_parser(name, help=help, description=help, formatter_class=DefaultsShown)


DTYPE_HELP = "auto (the checkpoint's, as from_pretrained takes it), float32, bfloat16, float16"


def _add_generate(sub) -> None:
    """``hf-parallel generate``: the sampling flags, the quantized load's, the layout's."""
    gen = _command(sub, "generate", "generate text (run under torchrun: every rank holds its shard)")
    gen.add_argument("--model", help="checkpoint directory or hub id (unset: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", default="What is tensor parallelism? Answer in one sentence.",
                     help="one prompt, streamed by rank 0 as it is generated")  # fmt: skip
    gen.add_argument("--prompts-file", help="one prompt per line, generated in left-padded batches (instead of "
                     "--prompt)")  # fmt: skip
    gen.add_argument("--batch-size", type=int, default=8, help="prompts of --prompts-file per generate call")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampling at it")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass (with --temperature)")
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed, the same on every rank")
    gen.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    gen.add_argument("--no-chat-template", action="store_true", help="the prompt as text, not as a user turn of "
                     "the tokenizer's chat template")  # fmt: skip
    gen.add_argument("--keep-quantized", action=KeepQuantized, help=KEEP_QUANTIZED_HELP)
    add_layout_flags(gen, "tp tp_plan ep_plan sp cp fsdp dp_replicate ep pp stage_tp stage_layers")
    gen.add_argument("--dp", type=int, dest="dp_replicate", default=argparse.SUPPRESS,
                     help=argparse.SUPPRESS)  # the earlier name
    gen.add_argument("--micro-batches", type=int, help="with --pp/--stage-tp: micro-batches per forward (unset: "
                     "one per stage)")  # fmt: skip
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    """``hf-parallel serve``: transformers serve's OpenAI-compatible app over continuous batching at TP."""
    srv = _command(sub, "serve", "OpenAI-compatible HTTP server (run under torchrun: TP over every rank)")
    srv.add_argument("model_path", nargs="?", metavar="MODEL",
                     help="checkpoint directory or hub id (unset: the embedded SmolLM2-135M-Instruct)")  # fmt: skip
    srv.add_argument("--model", help="the same as MODEL")
    srv.add_argument("--served-model-name", help="the name clients ask for (unset: the directory's name)")
    srv.add_argument("--host", default="127.0.0.1", help="the address rank 0 listens on")
    srv.add_argument("--port", type=int, default=8000, help="the port rank 0 listens on")
    srv.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    srv.add_argument("--keep-quantized", action=KeepQuantized, help=KEEP_QUANTIZED_HELP)
    add_layout_flags(srv, "tp tp_plan ep_plan")
    srv.add_argument("--api-key", help="clients must send 'Authorization: Bearer <key>' to /v1 routes (unset: "
                     "no key asked)")  # fmt: skip
    srv.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: every request samples "
                     "at it (one setting for the continuous batch; a request asking another is refused)")
    srv.add_argument("--kv-cache-memory", type=byte_size, metavar="SIZE", help="memory each rank gives the paged "
                     "cache and the batch, e.g. 20GiB (unset: transformers' share of free memory, divided among "
                     "the ranks sharing a device)")  # fmt: skip
    srv.add_argument("--kv-cache-memory-bytes", type=byte_size, dest="kv_cache_memory", default=argparse.SUPPRESS,
                     help=argparse.SUPPRESS)  # the earlier name
    srv.add_argument("--max-batch-tokens", type=int, help="tokens one step of the batch holds (unset: 8192)")
    srv.set_defaults(func=cmd_serve)


def _add_plan(sub) -> None:
    """``hf-parallel plan``: the layout's sizes and the extras a dry run can show (tokens, LoRA, HTML)."""
    plan = _command(sub, "plan", "dry run: every parameter's rule, style, layout and bytes per rank")
    plan.add_argument("path", help="checkpoint directory or hub id (its config is enough: no weights are read)")
    add_layout_flags(plan, "tp tp_plan ep_plan sp cp fsdp dp_replicate ep pp stage_tp stage_layers",
                     tp=dict(default=1, help="tensor-parallel size (of every stage, with --pp)"))  # fmt: skip
    plan.add_argument("--dtype", default="auto", help=DTYPE_HELP + " (float32 for a run with float32 masters, "
                      "as mixed_precision='bf16' keeps them)")
    plan.add_argument("--seq", type=int, help="a sequence length: the tokens each rank holds under --sp/--cp, and "
                      "the training step of the memory line (unset: 2048)")
    plan.add_argument("--batch", type=int, default=1, help="rows of the training step the memory line assumes")
    plan.add_argument("--checkpointing", action="store_true", help="the training step with activation "
                      "checkpointing (model.gradient_checkpointing_enable()): each layer keeps its input alone")
    plan.add_argument("--offload-checkpoints", action="store_true", help="with --checkpointing: those inputs in "
                      "host memory (from_pretrained's offload_checkpoints)")  # fmt: skip
    plan.add_argument("--tiled-loss", type=int, nargs="?", const=True, default=False, metavar="TOKENS",
                      help="the loss a chunk of tokens at a time (from_pretrained's tiled_loss; no value: 1024)")
    plan.add_argument("--tiled-mlp", type=int, nargs="?", const=True, default=False, metavar="TOKENS",
                      help="each MLP over tiles of tokens (from_pretrained's tiled_mlp; no value: hidden_size)")
    plan.add_argument("--nproc-per-node", type=int, help="ranks per node: flag TP or SP groups that span nodes "
                      "(unset: not checked)")  # fmt: skip
    plan.add_argument("--lora", help="r=N,target=name[,name...]: each LoRA adapter's split and bytes per rank")
    plan.add_argument("--html", metavar="OUT", help="also write the plan as one self-contained HTML page (no network)")
    plan.set_defaults(func=cmd_plan)


def _add_verify(sub) -> None:
    """``hf-parallel verify``: the layout to compare against one process, and the comparison's tolerance."""
    check = _command(sub, "verify", "load PATH parallel and in one process, compare every layer's output on a "
                     "probe batch (starts its own ranks, or runs under torchrun)")  # fmt: skip
    check.add_argument("path", help="checkpoint directory or hub id")
    add_layout_flags(check, "tp tp_plan sp cp pp stage_tp stage_layers",
                     tp=dict(default=1, help="tensor-parallel size (of every stage, with --pp)"))  # fmt: skip
    check.add_argument("--dtype", default="float32", help="float32 unlike generate's auto, so differences show "
                       "at 1e-4 (bf16's tolerance is 5e-2); auto: the checkpoint's, bfloat16, float16")
    check.add_argument("--tolerance", type=float, help="relative to each output's largest value (unset: by dtype, "
                       "fp32 1e-4, fp16 1e-2, bf16 5e-2)")  # fmt: skip
    check.add_argument("--reference-memory", type=byte_size, metavar="SIZE", help="memory for the one-process "
                       "reference, e.g. 40GiB; the rest streams from disk layer by layer (unset: half the free "
                       "memory when the weights need more, else all in memory)")  # fmt: skip
    check.add_argument("--reference-memory-gb", type=lambda gb: int(float(gb) * 2**30), dest="reference_memory",
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the earlier name (GiB)
    check.set_defaults(func=cmd_verify)


def _add_consolidate(sub) -> None:
    """``hf-parallel consolidate``: a distributed save or a Trainer's per-rank state into standard files."""
    from ..checkpoint.files import MAX_SHARD_SIZE  # (names only: no torch)

    merge = _command(sub, "consolidate", "a distributed save (save_pretrained(distributed=True)) to a standard "
                     "checkpoint; a parallel Trainer checkpoint's per-rank training state to transformers' "
                     "optimizer.pt (one process, no torchrun)")  # fmt: skip
    merge.add_argument("dir", help="the distributed save, or the Trainer's checkpoint-N directory")
    merge.add_argument("out", help="the standard checkpoint's directory (written staged, renamed at the end)")
    merge.add_argument("--max-shard-size", type=byte_size, default=MAX_SHARD_SIZE, metavar="SIZE",
                       help="split the files at this size, e.g. 5GB or 4GiB, as transformers' save_pretrained")
    merge.set_defaults(func=cmd_consolidate)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    stray = getattr(args, "after_keep_quantized", None)
    if stray is not None:
        if getattr(args, "model_path", "taken") is not None:  # no positional MODEL free to take it
            parser.error(f"argument --keep-quantized: {stray!r} is not one of {', '.join(KEPT_MODES)}")
        args.model_path = stray
    return answered_once(args.command, args.func, args)  # a refusal as one line (from rank 0 under torchrun)


if __name__ == "__main__":
    sys.exit(main())
