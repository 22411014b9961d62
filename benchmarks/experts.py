"""Expert parallelism: a training step and greedy decode of a wide tiny MoE at EP=2 and EP=4, hf_parallel's
``ep_size`` (tokens travel to the experts, attention data-parallel: dense layers copied on every rank, or FSDP-sharded
with ``fsdp``) beside its TP-group EP (``ep_plan="auto"``:
every rank on the whole batch, outputs all-reduced), transformers' own ``DistributedConfig(ep_size=N,
ep_implementation="all_to_all")`` and one process, on the same cores.

    python benchmarks/experts.py [--layers 4] [--hidden 256] [--experts 16] [--rows 8] [--seq 64] [--steps 2]
                                 [--decode 8] [--sizes 2 4]

The model: a random Qwen3-MoE (``--experts`` experts of intermediate size 2 x ``--hidden``, top-2, float32) built
into the cache once. Every configuration trains on the same global batch of ``rows`` x ``seq`` random tokens
(data-parallel ranks each take their rows; the TP group shares them) with AdamW, one warm-up step then
``--steps`` timed, and decodes ``--decode`` greedy tokens for ``rows`` prompts of 16 tokens (each data-parallel
rank its rows, stepping together). Per configuration: tokens/s of both, the losses against one process's, and
each rank's expert bytes at compute time (``memory.held_bytes`` of every experts module's parameters as its
forward starts, FSDP's unsharded ones included) over the whole experts'. Under ``ep_size`` also one more step's
peak tensor memory (torch's ``MemTracker``) against ``memory.step_memory``'s formula, with and without the (token,
expert) pairs that may arrive, and the pairs that did arrive against the formula's bound. Writes ``experts.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this checkout's hf_parallel, not an installed copy

PROMPT_TOKENS = 16


def kinds(sizes: list[int]) -> dict[str, int]:
    """configuration -> ranks"""
    out = {"one process": 1}
    for n in sizes:
        for kind in ("hf_parallel ep_size={}", "hf_parallel ep_size={} fsdp", "hf_parallel TP-group EP={}",
                     "transformers ep_size={}"):  # fmt: skip
            out[kind.format(n)] = n
    return out


def checkpoint(args) -> str:
    """The random MoE of these sizes, built once into the cache."""
    import torch
    import transformers

    from hf_parallel.commands.default_model import cache_root

    name = f"qwen3moe-l{args.layers}-h{args.hidden}-e{args.experts}"
    path = os.path.join(cache_root(), "benchmarks", name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        config = transformers.Qwen3MoeConfig(
            vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
            moe_intermediate_size=2 * args.hidden, num_experts=args.experts, num_experts_per_tok=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def load(kind: str, path: str, ranks: int):
    import torch
    import transformers

    import hf_parallel

    if kind == "one process":
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), 1
    if kind.startswith("transformers"):
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(fsdp_size=ranks, ep_size=ranks, ep_implementation="all_to_all")
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)
        return model, ranks
    if "TP-group" in kind:
        return hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, ep_plan="auto"), 1
    data = dict(fsdp_size=ranks) if kind.endswith("fsdp") else dict(dp_replicate_size=ranks)  # dense: FSDP or copies
    sizes = dict(ep_size=ranks, tp_plan=None, count_expert_tokens=True, **data)  # (the pairs each rank receives)
    return hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes), ranks


def expert_bytes_at_compute(model) -> list:
    """Every experts module's parameter bytes held as its forward starts (the largest seen), filled in by hooks."""
    from hf_parallel.memory import held_bytes

    seen = [0]

    def hook(module, *_):
        seen[0] = max(seen[0], held_bytes(module.parameters()))

    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(hook)
    return seen


def step_memory_measured(model, rows) -> dict:
    """Under ``ep_size``: one more training step's peak tensor memory on this rank (torch's ``MemTracker``, after a
    warm-up step, so AdamW's states exist) against ``memory.step_memory``'s formula for this rank, and that formula
    without the pairs arriving (the activations of the rank's own tokens alone); the pairs that arrived at this
    rank per experts layer (the most of any layer) against the formula's bound."""
    import torch
    from memory import categories, peak_tracker

    import hf_parallel
    from hf_parallel.memory import activation_bytes, step_memory
    from hf_parallel.tensor.token_exchange import EXCHANGE_ATTR

    state = hf_parallel.parallel_state(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        model(input_ids=rows, labels=rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    state.tokens_per_expert()  # counted from here: the tracked step's routing
    tracker = peak_tracker()
    tracker.track_external(model, optimizer, rows)
    with tracker:
        step()
    by_category = categories(tracker.get_tracker_snapshot("peak"))
    measured = by_category.get("Total", 0)
    routed = state.tokens_per_expert()  # each expert's tokens over the world: the data replicas are the EP ranks
    arrived = 0
    for path, counts in routed.items():
        exchange = getattr(model.get_submodule(path), EXCHANGE_ATTR)
        mine = exchange.first[exchange.ep.rank]
        arrived = max(arrived, sum(counts[mine : mine + exchange.local]))
    formula = step_memory(model, state.layout, torch.float32, rows.shape[0], rows.shape[1])
    own = activation_bytes(model, state.mesh.tp.size, rows.numel(), rows.shape[1], torch.float32)
    return {"measured": measured, "formula": formula.total, "without_pairs": formula.total - formula.activations + own,
            "pairs_arrived": arrived, "pairs_bound": formula.expert_pairs, "peak_at": tracker.where,
            "by_category": by_category, "formula_terms": dataclasses.asdict(formula)}  # fmt: skip


def worker(kind: str, args) -> None:
    import torch
    import torch.distributed as dist
    from measure import timed_training_steps

    ranks = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    model, data_parallel = load(kind, checkpoint(args), ranks)
    experts_whole = sum(p.numel() * 4 for n, p in _whole_experts(args).items())
    held = expert_bytes_at_compute(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.rows, args.seq), generator=generator)
    rows = args.rows // data_parallel
    mine = ids[(rank % data_parallel) * rows : (rank % data_parallel + 1) * rows]
    model.train()
    losses, seconds = timed_training_steps(model, mine, args.steps, data_parallel)
    step_memory = step_memory_measured(model, mine) if "ep_size" in kind and "hf_parallel" in kind else None
    model.eval()
    prompts = ids[:, :PROMPT_TOKENS][(rank % data_parallel) * rows : (rank % data_parallel + 1) * rows]
    with torch.no_grad():
        model.generate(prompts, max_new_tokens=2, do_sample=False, eos_token_id=None)  # warm-up
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        model.generate(prompts, max_new_tokens=args.decode, do_sample=False, eos_token_id=None)
        if dist.is_initialized():
            dist.barrier()
        decode_s = time.perf_counter() - start
    result = {"step_s": sum(seconds) / len(seconds), "decode_s": decode_s, "losses": losses,
              "expert_bytes": held[0], "experts_whole": experts_whole, "step_memory": step_memory}  # fmt: skip
    with open(os.path.join(args.out, f"experts-{kind.replace(' ', '_')}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _whole_experts(args) -> dict:
    """One experts module's parameters at full size (names -> meta tensors), for the whole experts' bytes."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(checkpoint(args))
    with torch.device("meta"):
        experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    return dict(experts.named_parameters())


def step_memory_row(ranks: list[dict]) -> dict:
    """The step-memory columns (the largest rank's each, MiB) where the ranks measured them (``ep_size``)."""
    measured = [r["step_memory"] for r in ranks if r.get("step_memory")]
    if not measured:
        return {}
    top = lambda key: max(m[key] for m in measured)  # noqa: E731
    return {"step_peak_mib": top("measured") / 2**20, "step_formula_mib": top("formula") / 2**20,
            "formula_without_pairs_mib": top("without_pairs") / 2**20, "pairs_arrived": top("pairs_arrived"),
            "pairs_bound": top("pairs_bound")}  # fmt: skip


def launch(kind: str, ranks: int, args) -> list[dict] | str:
    from measure import run_worker

    flags = [f"--{flag}={getattr(args, flag)}" for flag in ("layers", "hidden", "experts", "rows", "seq", "steps",
                                                              "decode")]  # fmt: skip
    return run_worker(__file__, kind, ranks, flags, args.out, os.pathsep.join([HERE, os.path.dirname(HERE)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--only", nargs="+", help=argparse.SUPPRESS)  # configurations to run (the tests' smoke run)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        return worker(args.worker, args)
    checkpoint(args)  # built once, before any timing
    runs = {kind: launch(kind, ranks, args) for kind, ranks in kinds(args.sizes).items()
            if not args.only or kind in args.only}  # fmt: skip
    from measure import result_rows

    table = result_rows(runs, lambda ranks: {
        "train_tokens_per_s": args.rows * args.seq / max(r["step_s"] for r in ranks),
        "decode_tokens_per_s": args.rows * args.decode / max(r["decode_s"] for r in ranks),
        "expert_bytes_fraction": max(r["expert_bytes"] for r in ranks) / ranks[0]["experts_whole"],
        **step_memory_row(ranks),
    })  # fmt: skip
    print(f"\nMoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts (top-2), fp32; training step "
          f"{args.rows} x {args.seq} tokens + AdamW, decode {args.decode} tokens x {args.rows} prompts; "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(f"{'configuration':<30} {'train tok/s':>11} {'decode tok/s':>12} {'experts held':>12} {'loss - 1 proc':>13}")
    for kind, row in table.items():
        if "failed" in row:
            print(f"{kind:<30} failed: {row['failed']}")
            continue
        error = "-" if row["loss_error"] is None else f"{row['loss_error']:.1e}"
        print(f"{kind:<30} {row['train_tokens_per_s']:>11.1f} {row['decode_tokens_per_s']:>12.1f} "
              f"{row['expert_bytes_fraction']:>12.3f} {error:>13}")  # fmt: skip
    memory = {kind: row for kind, row in table.items() if "step_peak_mib" in row}
    if memory:
        print(f"\n{'step memory, the largest rank':<30} {'peak MiB':>9} {'formula':>9} {'w/o pairs':>9} "
              f"{'pairs arrived':>13} {'bound':>7}")  # fmt: skip
    for kind, row in memory.items():
        print(f"{kind:<30} {row['step_peak_mib']:>9.2f} {row['step_formula_mib']:>9.2f} "
              f"{row['formula_without_pairs_mib']:>9.2f} {row['pairs_arrived']:>13} {row['pairs_bound']:>7}")
    ratios = {}
    for n in args.sizes:
        others = {"TP-group EP": f"hf_parallel TP-group EP={n}", "transformers": f"transformers ep_size={n}",
                  "one process": "one process"}  # fmt: skip
        for ours in (f"hf_parallel ep_size={n}", f"hf_parallel ep_size={n} fsdp"):
            for key in ("train_tokens_per_s", "decode_tokens_per_s"):
                for name, other in others.items():
                    a, b = table.get(ours, {"failed": 1}), table.get(other, {"failed": 1})
                    if "failed" not in a and "failed" not in b:
                        ratios[f"{key} {ours.removeprefix('hf_parallel ')} / {name}"] = a[key] / b[key]
    print()
    for text, value in ratios.items():
        print(f"{text}: {value:.2f}")
    with open(os.path.join(args.out, "experts.json"), "w") as f:
        json.dump({"args": vars(args), "table": table, "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
