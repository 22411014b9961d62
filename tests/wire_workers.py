"""Workers of ``test_wire.py``: point-to-point transfers under NCCL's rules on real gloo ranks."""

from __future__ import annotations

import json
import os
import time

import torch


def under_the_rules(rank: int, world_size: int, out_dir: str) -> None:
    """Two ranks: a swap in one batch, messages matched by order, then both sending first (a deadlock on
    NCCL) under the strict transport, which must name the stuck send. Writes its own result and leaves
    without the runner's closing barrier: the deadlock's timeout closes the gloo pair for good."""
    import torch.distributed as dist

    from hf_parallel.distributed import p2p
    from hf_parallel.distributed.faults import RankFailure

    dist.init_process_group("gloo")
    other, out = 1 - rank, {}
    mine = torch.full((1 << 20,), float(rank))  # 4 MiB: no transport buffers that on NCCL
    theirs = torch.empty_like(mine)
    for rules in ("", "nccl"):  # torch's batch_isend_irecv, then the strict transport
        os.environ[p2p.RULES_ENV] = rules
        theirs.zero_()
        p2p.run([p2p.Op("send", mine, other, "swap"), p2p.Op("recv", theirs, other, "swap")])
        out[f"swap:{rules or 'torch'}"] = theirs.unique().tolist()
    if rank == 0:  # two messages; tags are ignored, so they arrive in the order they were sent
        p2p.send(torch.tensor([1.0, 2.0]), other, "first")
        p2p.send(torch.tensor([3.0, 4.0]), other, "second")
    else:
        out["order"] = [p2p.recv(torch.empty(2), other, "a").tolist(), p2p.recv(torch.empty(2), other, "b").tolist()]
    start = time.perf_counter()
    try:
        p2p.send(mine, other, f"rank {rank} sending before it receives")
        p2p.recv(theirs, other, f"rank {rank} receiving")
        out["deadlock"] = None
    except RankFailure as failure:
        out["deadlock"] = str(failure)
    out["seconds"] = time.perf_counter() - start
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)


def fsdp_save_one_layer_at_a_time(rank: int, world_size: int, path: str, out: str) -> dict:
    """A gathered and a distributed save at FSDP=2: how many of FSDP's modules were whole at once (counted at
    every unshard and reshard; before, every layer was made whole for the whole save)."""
    from torch.distributed.fsdp import FSDPModule

    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan=None, fsdp_size=2, dtype=torch.float32)
    whole, peak = set(), [0]
    unshard, reshard = FSDPModule.unshard, FSDPModule.reshard

    def counted_unshard(self, *args, **kwargs):
        whole.add(id(self))
        peak[0] = max(peak[0], len(whole))
        return unshard(self, *args, **kwargs)

    def counted_reshard(self, *args, **kwargs):
        whole.discard(id(self))
        return reshard(self, *args, **kwargs)

    FSDPModule.unshard, FSDPModule.reshard = counted_unshard, counted_reshard
    peaks = {}
    try:
        for distributed in (False, True):
            peak[0] = 0
            model.save_pretrained(os.path.join(out, str(distributed)), distributed=distributed)
            peaks[str(distributed)] = peak[0]
    finally:
        FSDPModule.unshard, FSDPModule.reshard = unshard, reshard
    layers = len(model.model.layers)
    return {"peaks": peaks, "modules": sum(isinstance(m, FSDPModule) for m in model.modules()), "layers": layers,
            "still_whole": len(whole)}  # fmt: skip
