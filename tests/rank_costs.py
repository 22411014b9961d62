"""The fixed cost of one group of test ranks, by how its processes start: ``python tests/rank_costs.py``.

Each row is the wall time of ``distributed.run_ranks`` for a case that does (1) nothing (the processes, torch
imported), (2) a gloo process group's init and one all-reduce, (3) that plus a tiny llama loaded at TP=world
(transformers and the package imported, the model built), under ``spawn`` (a fresh interpreter per rank, as
the suite ran before) and under the fork server (``rank_preload`` imported once a session). (2) − (1) is the
group's init, (3) − (2) the imports and the build. docs/contributing.md quotes its output."""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))


def nothing(rank, world_size):
    return rank


def group_init(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


def tiny_load(rank, world_size, path):
    group_init(rank, world_size)
    from hf_parallel import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    return rank


def main() -> None:
    import rank_costs  # the cases by their module's name, not __main__'s (which a forked rank would re-run)
    from distributed import run_ranks
    from tiny_models import make_checkpoint

    root = tempfile.mkdtemp()
    path = make_checkpoint("llama", root)
    cases = {"processes (torch imported)": (rank_costs.nothing,), "+ gloo group": (rank_costs.group_init,),
             "+ tiny llama loaded at TP (transformers, hf_parallel imported)": (rank_costs.tiny_load, path)}
    print("| start | world | " + " | ".join(cases) + " |")
    print("|---|---|" + "---|" * len(cases))
    for start in ("forkserver", "spawn"):
        os.environ["HF_PARALLEL_TEST_SPAWN"] = "1" if start == "spawn" else "0"
        run_ranks(1, rank_costs.nothing, out_dir=os.path.join(root, "warm"))  # the server starts once a session
        for world in (2, 4):
            seconds = []
            for fn, *args in cases.values():
                begin = time.perf_counter()
                run_ranks(world, fn, *args, out_dir=os.path.join(root, "out"))
                seconds.append(time.perf_counter() - begin)
            print(f"| {start} | {world} | " + " | ".join(f"{s:.1f} s" for s in seconds) + " |")


if __name__ == "__main__":
    main()
