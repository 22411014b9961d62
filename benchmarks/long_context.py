"""Long-context training step: hf_parallel's sequence parallelism against one process using every core.

    python benchmarks/long_context.py [--seqs 2048 3072 4096 6144 8192 12288] [--sp 2 4] [--cp 2]
                                      [--sp-cp 2x2] [--cap-mib 768] [--checkpointing] [--packed 256]
                                      [--tiled-mlp 1024] [--tiled-loss 1024] [--decode 8]

A small Llama (random fp32 weights, built locally) runs forward + backward with labels, one
sequence per step: one process with all the machine's cores, and SP ranks with cores/SP threads
each, in the same invocation. Lengths run in ascending order in one process per configuration,
each step after one warm-up at that length; a configuration stops at the first length whose step
goes past the memory cap. Per rank (max over ranks): the step's peak RSS above the RSS after the
load (activations, logits, gradients), and tokens/s. The longest length under ``--cap-mib`` per
rank is each configuration's longest fitting sequence. Ratios against one process, and the
issue's targets, are printed and written to ``long_context.json``. ``--checkpointing`` adds one process and
SP=2 with activation checkpointing (``gradient_checkpointing_enable()``): the memory it saves per rank.
``--cp``: context parallelism alone (ring attention over that many ranks, zigzag chunks), ``--sp-cp 2x2``:
Ulysses inside a ring; their targets: CP=2's tokens/s at least 0.9x SP=2's, and per-rank peak at most
1.2 / (sp x cp) of one process's, at the longest length all of them ran. ``--packed 256``: each row
packs documents of 256 tokens (positions restarting), so the model's mask is not plain causal: one
process builds its ``[S, S]`` mask, context parallelism builds each chunk pair's (no ``[S, S]`` tensor).
``--tiled-mlp 1024``: each ``--cp`` layout again with ``from_pretrained(tiled_mlp=1024)`` (ALST's tiled MLP);
``--tiled-loss 1024``: with ``tiled_loss=1024`` too (the loss from the hidden states, 1024 tokens at a time).
``--decode 8``: one process and SP=2 decoding 8 tokens, step by step, after each length's prompt (a KV cache,
split over the sequence group at SP=2): the mean time of a decode step.

The issue's goals, printed met or not: at CP=2 and SP=2 x CP=2, doubling the length costs at most 2.2x the
per-rank peak; under ``--cap-mib`` CP=2 reaches at least twice one process's longest length; at SP=2 a decode
step's time grows with the prompt no faster than one process's (the ratio of the longest prompt's step to the
shortest's, SP=2's over one process's, at most 1); and CP=2's tokens/s against SP=2's.

Anchor: ``--deepspeed`` adds DeepSpeed's Ulysses for transformers (``UlyssesSPAttentionHF``, on
its CPU accelerator over gloo), run as its tutorial does, in the same table; it needs
``pip install deepspeed hjson einops`` and sequence lengths divisible by sp. transformers' and
accelerate's context parallelism go through torch's ``context_parallel`` (DTensor ring attention
on CUDA devices) and do not run on CPU ranks, so they are not in the table.
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


def deepspeed_ulysses(path: str, world: int):
    """The anchor: DeepSpeed's Ulysses for transformers as its tutorial runs it (ranks take their
    chunk of input_ids, position_ids and shifted labels; sdpa without a mask; losses combined
    weighted by tokens), plus the sum of gradients over the group its engine would do."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn
    import transformers
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")
    mpu = UlyssesSPAttentionHF.register_with_transformers(path, "sdpa", world, 1, seq_length_is_variable=True)
    group, rank = mpu.get_sequence_parallel_group(), dist.get_rank()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")

    def summed(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for param in model.parameters():
        param.register_hook(summed)

    def loss_of(ids):
        if ids.shape[1] % world:
            raise ValueError(f"DeepSpeed's Ulysses needs the sequence length ({ids.shape[1]}) divisible by sp={world}")
        chunk = slice(rank * ids.shape[1] // world, (rank + 1) * ids.shape[1] // world)
        shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        logits = model(input_ids=ids[:, chunk], position_ids=positions[:, chunk], use_cache=False).logits
        loss = model.loss_function(
            logits=logits, labels=None, shift_labels=shift[:, chunk], vocab_size=logits.shape[-1]
        )
        tokens = (shift[:, chunk] != -100).sum()
        losses = dist_nn.all_gather(loss * tokens, group=group)
        return sum(losses) / (shift != -100).sum()

    return model, loss_of


def packed_positions(seq: int, document: int):
    """Positions of ``seq`` tokens packed as documents of ``document`` tokens (restarting at 0), ``[1, seq]``."""
    import torch

    return (torch.arange(seq) % document).unsqueeze(0)


def worker(implementation: str, path: str, seqs: list[int], cap: int, out: str, packed: int = 0,
           decode: int = 0) -> None:  # fmt: skip
    import torch
    import transformers
    from measure import peak_rss_bytes, reset_peak_rss, rss_bytes

    import hf_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, os.cpu_count() // world))
    checkpointing = implementation.endswith("+checkpointing")
    implementation = implementation.removesuffix("+checkpointing")
    decoding = implementation.endswith("+decode")
    implementation = implementation.removesuffix("+decode")
    implementation, _, losses = implementation.partition("+loss")  # ...+lossL: tiled loss of L tokens
    implementation, _, tiles = implementation.partition("+tiled")  # hf_parallel:cpN+tiledT: tiled MLP of T tokens
    tiled = (dict(tiled_mlp=int(tiles)) if tiles else {}) | (dict(tiled_loss=int(losses)) if losses else {})
    implementation, _, rings = implementation.partition(":cp")  # hf_parallel:cpN: a ring of N Ulysses groups
    cp = int(rings or 1)
    if implementation == "deepspeed":
        model, loss_of = deepspeed_ulysses(path, world)
    elif world == 1:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(
            path, tp_plan=None, sp_size=world // cp, cp_size=cp, dtype=torch.float32, **tiled
        )
    if implementation != "deepspeed":

        def loss_of(ids):  # packed: documents in one row, the model's mask from their positions
            positions = packed_positions(ids.shape[1], packed) if packed else None
            return model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss

    generator = torch.Generator().manual_seed(0)
    if decoding:
        return decode_steps(model, seqs, decode, cap, out, generator)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    baseline, rows = None, {}

    def step(ids):
        model.zero_grad(set_to_none=False)
        loss_of(ids).backward()

    step(torch.randint(0, model.config.vocab_size, (1, 64), generator=generator))  # gradients allocated
    baseline = rss_bytes()
    for seq in seqs:
        ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=generator)
        reset_peak_rss()
        step(ids)  # warm-up at this length
        start = time.perf_counter()
        step(ids)
        seconds = time.perf_counter() - start
        peak = peak_rss_bytes() - baseline
        rows[seq] = {"peak_above_load": peak, "tokens_per_s": seq / seconds, "step_s": seconds}
        if peak > cap:
            break
    written(rows, out, world > 1 and implementation != "deepspeed")


def decode_steps(model, seqs: list[int], new: int, cap: int, out: str, generator) -> None:
    """Greedy decoding after a prompt of each length, step by step through the forward (the prompt's forward
    keeps the KV cache, split over the sequence group at SP): a decode step's time (the mean of ``new`` steps
    after one warm-up step), and the peak above the load."""
    import torch
    from measure import peak_rss_bytes, reset_peak_rss, rss_bytes

    model.eval()
    baseline, rows = rss_bytes(), {}
    with torch.no_grad():
        for seq in seqs:
            ids = torch.randint(3, model.config.vocab_size, (1, seq), generator=generator)
            reset_peak_rss()
            output = model(input_ids=ids, use_cache=True)  # the prompt's forward
            for step in range(1 + new):
                if step == 1:  # the first step a warm-up
                    start = time.perf_counter()
                token = output.logits[:, -1:].argmax(-1)
                output = model(input_ids=token, past_key_values=output.past_key_values, use_cache=True)
            seconds = (time.perf_counter() - start) / new
            rows[seq] = {"peak_above_load": peak_rss_bytes() - baseline, "tokens_per_s": 1 / seconds,
                         "step_s": seconds}  # fmt: skip
            if rows[seq]["peak_above_load"] > cap:
                break
    written(rows, out, int(os.environ.get("WORLD_SIZE", "1")) > 1)


def written(rows: dict, out: str, parallel: bool) -> None:
    """This rank's rows in its file (then the mesh shut down where hf_parallel made one)."""
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    if parallel:
        from hf_parallel.distributed.mesh import shutdown

        shutdown()


def configuration(path: str, implementation: str, sp: int, args, gloo: bool = False) -> dict[int, dict]:
    """One configuration's rows; ``gloo``: its collectives over gloo, not shared memory (the A/B)."""
    from hf_parallel.commands.cli import start_ranks

    tag = implementation.replace(":", "_")
    out = os.path.join(args.out, f"long_context_{tag}_ranks{sp}" + ("_gloo" if gloo else ""))
    os.makedirs(out, exist_ok=True)
    command = [sys.executable, __file__, "--worker", implementation, path, "--out", out, "--cap-mib", str(args.cap_mib)]
    command += ["--seqs", *map(str, args.seqs), "--packed", str(args.packed), "--decode", str(args.decode)]
    if sp == 1:
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
        code = subprocess.run(command, env=env).returncode
    else:
        os.environ["HF_PARALLEL_SHM"] = "0" if gloo else "1"  # inherited by the ranks
        code = start_ranks(sp, command)
        os.environ.pop("HF_PARALLEL_SHM")
    if code:
        raise SystemExit(f"sp={sp} failed with exit status {code}")
    ranks = []
    for name in sorted(os.listdir(out)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                ranks.append({int(k): v for k, v in json.load(f).items()})
    return {
        seq: {
            "peak_above_load": max(r[seq]["peak_above_load"] for r in ranks),
            "tokens_per_s": min(r[seq]["tokens_per_s"] for r in ranks),
            "step_s": max(r[seq]["step_s"] for r in ranks),
        }
        for seq in ranks[0]
        if all(seq in r for r in ranks)
    }


def report(results: dict[str, dict], cap: int) -> tuple[list[str], dict]:
    """A markdown table (per rank, ratios to one process), the longest length under the cap, and the goals."""
    single = results["one process"]
    lines = ["| seq | " + " | ".join(f"{name}: peak MiB (x one) | tokens/s (x one)" for name in results) + " |"]
    lines.append("|---" * (1 + 2 * len(results)) + "|")
    for seq in sorted({s for rows in results.values() for s in rows}):
        cells = []
        for name, rows in results.items():  # (decode rows against one process's decode)
            row, one = rows.get(seq), results.get("one process, decode" if "decode" in name else "one process").get(seq)
            if row is None:
                cells += ["past the cap", "-"]
                continue
            for key, scale in (("peak_above_load", MiB), ("tokens_per_s", 1)):
                cells.append(f"{row[key] / scale:.0f}" + (f" ({row[key] / one[key]:.2f})" if one else ""))
        lines.append(f"| {seq} | {' | '.join(cells)} |")
    fits = lambda rows: max((s for s, r in rows.items() if r["peak_above_load"] <= cap), default=0)  # noqa: E731
    longest = {name: fits(rows) for name, rows in results.items()}
    lines.append(
        f"longest sequence under {cap // MiB} MiB per rank: " + ", ".join(f"{k}: {n}" for k, n in longest.items())
    )
    checks = []  # (goal, ratio, bound, whether the ratio must stay at or below the bound)
    for name, rows in results.items():
        if _context_ranks(name) is None:
            continue
        for seq in sorted(rows):  # twice the length: at most 2.2x the peak per rank
            if 2 * seq in rows:
                growth = rows[2 * seq]["peak_above_load"] / rows[seq]["peak_above_load"]
                checks.append((f"peak growth at {name.removeprefix('hf_parallel ')} ({seq} -> {2 * seq})", growth,
                               2.2, True))  # fmt: skip
    if "hf_parallel CP=2" in longest and longest["one process"]:
        reach = longest["hf_parallel CP=2"] / longest["one process"]
        checks.append(("longest sequence at CP=2 against one process's", reach, 2.0, False))
    ours, ring = results.get("hf_parallel SP=2", {}), results.get("hf_parallel CP=2", {})
    common = [s for s in ours if s in ring]
    if common:
        seq = max(common)
        speed = ring[seq]["tokens_per_s"] / ours[seq]["tokens_per_s"]
        checks.append((f"tokens/s at CP=2 against SP=2 (seq {seq})", speed, 0.9, False))
    one, split = results.get("one process, decode", {}), results.get("hf_parallel SP=2, decode", {})
    prompts = sorted(s for s in split if s in one)
    if len(prompts) > 1:  # a decode step's time from the shortest prompt to the longest, SP=2's over one process's
        first, last = prompts[0], prompts[-1]
        growth = (split[last]["step_s"] / split[first]["step_s"]) / (one[last]["step_s"] / one[first]["step_s"])
        checks.append((f"decode step growth at SP=2 against one process's ({first} -> {last})", growth, 1.0, True))
    for name, value, bound, at_most in checks:
        met = value <= bound if at_most else value >= bound
        verdict = "met" if met else "NOT met"
        lines.append(f"- {name}: {value:.2f}, goal {'<=' if at_most else '>='} {bound}: {verdict}")
    return lines, {"longest": longest, "checks": [list(c) for c in checks]}


def _context_ranks(name: str) -> int | None:
    """The ranks a sequence is split over in a context-parallel configuration's name, else None."""
    if "CP=" not in name or "+" in name:
        return None
    sizes = [int(part.split("=")[1]) for part in name.removeprefix("hf_parallel ").split(" x ")]
    return sizes[0] * (sizes[1] if len(sizes) > 1 else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 3072, 4096, 6144, 8192, 12288])
    parser.add_argument("--sp", type=int, nargs="*", default=[2, 4] if (os.cpu_count() or 1) >= 4 else [2])
    parser.add_argument("--cp", type=int, nargs="*", default=[2], help="context-parallel sizes (ring attention alone)")
    parser.add_argument("--sp-cp", nargs="*", default=["2x2"] if (os.cpu_count() or 1) >= 4 else [],
                        help="Ulysses x ring layouts, as SPxCP")  # fmt: skip
    parser.add_argument("--cap-mib", type=int, default=768)
    parser.add_argument("--packed", type=int, default=0, help="documents of this many tokens packed in each row")
    parser.add_argument("--tiled-mlp", type=int, default=0, help="also each --cp with tiled_mlp of this many tokens")
    parser.add_argument("--tiled-loss", type=int, default=0, help="and with tiled_loss of this many tokens")
    parser.add_argument("--decode", type=int, default=0, help="also one process and SP=2 decoding this many tokens")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--model", help="a checkpoint (default: the small random Llama of checkpoints.py)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed's Ulysses (pip install deepspeed)")
    parser.add_argument(
        "--checkpointing", action="store_true", help="also one process and SP=2 with activation checkpointing"
    )
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker, args.seqs, args.cap_mib * MiB, args.out, args.packed, args.decode)
    from checkpoints import random_llama_long_context

    path = args.model or random_llama_long_context()
    results = {"one process": configuration(path, "transformers", 1, args)}
    for sp in args.sp:
        results[f"hf_parallel SP={sp}"] = configuration(path, "hf_parallel", sp, args)
        if sp == 2:  # the all-to-alls over gloo (HF_PARALLEL_SHM=0), as before they had shared memory
            results["hf_parallel SP=2 over gloo"] = configuration(path, "hf_parallel", sp, args, gloo=True)
        if args.deepspeed:
            results[f"DeepSpeed Ulysses SP={sp}"] = configuration(path, "deepspeed", sp, args)
    for cp in args.cp:
        results[f"hf_parallel CP={cp}"] = configuration(path, f"hf_parallel:cp{cp}", cp, args)
        if args.tiled_mlp or args.tiled_loss:
            name = f"hf_parallel CP={cp} + " + " + ".join(
                what for what, size in (("tiled MLP", args.tiled_mlp), ("tiled loss", args.tiled_loss)) if size)
            tiled = (f"+tiled{args.tiled_mlp}" if args.tiled_mlp else "") + (
                f"+loss{args.tiled_loss}" if args.tiled_loss else "")
            results[name] = configuration(path, f"hf_parallel:cp{cp}{tiled}", cp, args)
    for layout in args.sp_cp:
        sp, cp = map(int, layout.split("x"))
        results[f"hf_parallel SP={sp} x CP={cp}"] = configuration(path, f"hf_parallel:cp{cp}", sp * cp, args)
    if args.decode:
        results["one process, decode"] = configuration(path, "transformers+decode", 1, args)
        results["hf_parallel SP=2, decode"] = configuration(path, "hf_parallel+decode", 2, args)
    if args.checkpointing:
        results["one process + checkpointing"] = configuration(path, "transformers+checkpointing", 1, args)
        results["hf_parallel SP=2 + checkpointing"] = configuration(path, "hf_parallel+checkpointing", 2, args)
    lines, summary = report(results, args.cap_mib * MiB)
    print("\n".join([f"long-context forward+backward, {path}, {os.cpu_count()} cores", *lines]))
    with open(os.path.join(args.out, "long_context.json"), "w") as f:
        json.dump({"model": path, "cores": os.cpu_count(), "results": results, **summary}, f, indent=1)


if __name__ == "__main__":
    main()
