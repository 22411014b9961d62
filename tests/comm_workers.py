"""Workers of the collectives, the mesh and rank failures (test_comm, test_mesh). Each runs inside a rank of a spawned gloo group (``distributed.run_ranks``)."""

from __future__ import annotations

import math
import os

import torch
from tp_workers import INPUT_IDS


def worse(a: float, b: float) -> float:
    """The larger error, NaN if either is (Python's ``max(0.0, nan)`` is 0.0)."""
    return a if math.isnan(a) or a > b else b


def shm_collectives(rank: int, world_size: int) -> dict:
    """The shared-memory transport against gloo's own collectives on the same inputs."""
    import torch.distributed as dist

    from hf_parallel.distributed import comm
    from hf_parallel.distributed.mesh import get_mesh
    from hf_parallel.distributed.shm import channel_for

    mesh = get_mesh()
    channel = channel_for(mesh.tp.group)
    out = {"shm": channel is not None}
    gen = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 7, generator=gen).to(dtype)
        want = x.clone()
        dist.all_reduce(want)
        got = comm.all_reduce(x, mesh.tp.group)
        out[f"reduce_{dtype}"] = (got.float() - want.float()).abs().max().item()
        out[f"reduce_{dtype}_values"] = got.float().flatten().tolist()
    sizes = [r + 1 for r in range(world_size)]  # uneven: rank r holds r+1 columns
    local = torch.full((2, sizes[rank]), float(rank))
    gathered = comm.all_gather(local, 1, sizes, mesh.tp.group)
    out["gather"] = gathered.tolist()
    seq = channel.seq
    big = torch.full((3 << 20,), float(rank + 1))  # 12 MB: more than a slot, so gloo carries it
    out["big_sum"] = comm.all_reduce(big, mesh.tp.group)[:: 1 << 20].tolist()
    out["big_used_shm"] = channel.seq != seq
    source = world_size - 1  # a broadcast from the last rank: header and bytes in one step
    sent = torch.arange(6, dtype=torch.bfloat16).view(2, 3) + source
    got = channel.broadcast(sent if rank == source else None, source)
    out["broadcast"] = [str(got.dtype), got.float().tolist()]
    out["big_broadcast"] = channel.broadcast(big if rank == source else None, source)  # past a slot: None
    return out


def shm_rank_goes_missing(rank: int, world_size: int, timeout: float) -> dict:
    """Rank 1 never joins the collective: rank 0 must fail with a clear error within the bound."""
    import time

    import torch.distributed as dist

    from hf_parallel import RankFailure
    from hf_parallel.distributed import comm
    from hf_parallel.distributed.mesh import get_mesh

    dist.init_process_group("gloo")  # gloo keeps its long timeout, for the teardown barrier
    os.environ["HF_PARALLEL_TIMEOUT"] = str(timeout)
    mesh = get_mesh()
    if rank == 1:
        time.sleep(timeout * 2)  # alive but absent
        return {}
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), mesh.tp.group)
    except RankFailure as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None}


def peer_fails_during(rank: int, world_size: int, phase: str, how: str, path: str, out: str, timeout: float) -> dict:
    """Rank 1 hangs (alive, absent) or dies (process exit) where rank 0 runs ``phase``; rank 0
    reports the error it got and how long it took to get it."""
    import json
    import time

    import torch.distributed as dist

    import hf_parallel
    from hf_parallel.distributed.mesh import get_mesh

    os.environ["HF_PARALLEL_TIMEOUT"] = str(timeout)
    get_mesh()
    model = None if phase == "load" else hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    if rank == 1:
        if how == "dies":
            with open(os.path.join(out, "rank1.json"), "w") as f:
                json.dump({}, f)
            os._exit(0)
        time.sleep(timeout + 3)
        dist.destroy_process_group()
        return {}
    start = time.monotonic()
    try:
        if phase == "load":
            hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        elif phase == "save":
            model.save_pretrained(os.path.join(out, "saved"))
        else:
            model(INPUT_IDS)
        result = {"type": None}
    except Exception as error:  # noqa: BLE001 - the test asserts the type by name
        result = {"type": type(error).__name__, "message": str(error), "is_timeout": isinstance(error, TimeoutError)}
    dist.destroy_process_group()  # the group is broken: no teardown barrier
    return {**result, "seconds": time.monotonic() - start}


def peer_dies_mid(rank: int, world_size: int, phase: str, path: str, out: str) -> dict:
    """Rank 1's process exits inside ``phase`` ("generate": at its third token's forward; "step": in the
    backward of a training step), the TP sums on shared memory; rank 0, under a timeout far longer than the
    test allows, reports the error it got and how long after its peer's last collective."""
    import json
    import time

    import torch.distributed as dist

    import hf_parallel
    from hf_parallel.distributed import shm

    os.environ["HF_PARALLEL_TIMEOUT"] = "300"
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    calls = []

    def die(*_):
        calls.append(1)
        if rank == 1 and (phase == "step" or len(calls) == 3):
            with open(os.path.join(out, "rank1.json"), "w") as f:
                json.dump({}, f)
            os._exit(0)

    start = time.monotonic()
    try:
        if phase == "generate":
            model.model.layers[1].register_forward_hook(die)
            model.generate(INPUT_IDS, max_new_tokens=6, do_sample=False)
        else:
            model.model.layers[1].register_full_backward_hook(die)
            model(INPUT_IDS, labels=INPUT_IDS).loss.backward()
        result = {"type": None}
    except Exception as error:  # noqa: BLE001 - the test asserts the type by name
        result = {"type": type(error).__name__, "message": str(error)}
    on_shm = shm.channel_for(hf_parallel.parallel_state(model).mesh.tp.group) is not None
    dist.destroy_process_group()  # the group is broken: no teardown barrier
    return {**result, "seconds": time.monotonic() - start, "shm": on_shm}


def sequence_comm_properties(rank: int, world_size: int, transport: str = "shm") -> dict:
    """The sequence-parallel collectives on random uneven shapes (hypothesis, derandomized so every
    rank draws the same examples in the same order; errors are returned, not raised, so no rank
    leaves a collective the others are in). ``transport``: the shared-memory channel, gloo, or a
    channel of 1 KB slots (most pieces then travel in several windows)."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    from hf_parallel.distributed import comm, shm
    from hf_parallel.distributed.batch import broadcast_batch
    from hf_parallel.distributed.mesh import get_mesh
    from hf_parallel.core.layout import even_sizes, sizes_to_ranges

    group = get_mesh().tp.group
    if transport == "gloo":
        shm._CHANNELS.pop(group)
    elif transport == "windows":
        shm.attach(group, rank, world_size, timeout=30.0, slot_bytes=1024)
    channel, steps = shm.channel_for(group), shm.channel_for(group) and shm.channel_for(group).seq
    worst = {"all_to_all": 0.0, "all_to_all_backward": 0.0, "scatter_backward": 0.0}

    def seeded(shape, seed):
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    @settings(derandomize=True, max_examples=30, phases=[Phase.generate], deadline=None, database=None)
    @given(st.integers(1, 2), st.integers(1, 7), st.integers(0, 9), st.integers(1, 3), st.integers(0, 10**6))
    def check(batch, heads, seq, dim, seed):
        seq_range = sizes_to_ranges(even_sizes(seq, world_size))[rank]
        head_range = sizes_to_ranges(even_sizes(heads, world_size))[rank]
        full, grad = seeded((batch, heads, seq, dim), seed), seeded((batch, heads, seq, dim), seed + 1)
        local = full[:, :, slice(*seq_range)].clone().requires_grad_()
        out = comm.all_to_all(local, 1, 2, even_sizes(heads, world_size), even_sizes(seq, world_size), group)
        out.backward(grad[:, slice(*head_range)])  # the conjugate: dX_r = dY's tokens of rank r, all heads
        if out.numel():
            worst["all_to_all"] = worse(worst["all_to_all"], (out - full[:, slice(*head_range)]).abs().max().item())
        if local.numel():
            error = (local.grad - grad[:, :, slice(*seq_range)]).abs().max().item()
            worst["all_to_all_backward"] = worse(worst["all_to_all_backward"], error)
        whole = full.clone().requires_grad_()
        part = comm.scatter_to(whole, 2, even_sizes(seq, world_size), group, grad_scale=1 / world_size)
        part.backward(grad[:, :, slice(*seq_range)])
        if whole.numel():
            worst["scatter_backward"] = worse(
                worst["scatter_backward"], (whole.grad - grad * (1 / world_size)).abs().max().item()
            )

    check()
    worst["shm_steps"] = 0 if channel is None else channel.seq - steps
    mine = {
        "ids": torch.arange(6).view(2, 3),
        "rest": [torch.ones(4, dtype=torch.bfloat16), 5, None],
        "m": (torch.tensor([True]),),
    }
    other = {"ids": torch.zeros(1), "rest": [], "m": ()}
    got = broadcast_batch(mine if rank == 0 else other, group, torch.device("cpu"))
    worst["broadcast"] = (
        got["ids"].tolist() == [[0, 1, 2], [3, 4, 5]]
        and got["rest"][0].dtype == torch.bfloat16
        and got["rest"][0].tolist() == [1.0] * 4
        and got["rest"][1:] == [5, None]
        and isinstance(got["m"], tuple)
        and got["m"][0].tolist() == [True]
    )
    whole = comm.gather_to_use(torch.ones(1, 2, requires_grad=True), 1, [2] * world_size, group)
    try:
        whole.sum().backward()
        worst["gather_backward_refused"] = ""
    except RuntimeError as error:
        worst["gather_backward_refused"] = str(error)
    return worst


def pipe_messages(rank: int, world_size: int) -> dict:
    """Two ranks' shared-memory pipes (4 slots of 1 KB) both ways: messages of every size from
    empty to several slots, more of them than the ring holds (queued, never blocking the sender),
    arrive whole and in order."""
    from hf_parallel.distributed.mesh import get_mesh
    from hf_parallel.distributed.shm import attach_pipes, drain

    get_mesh()  # joins the process group
    pipes = attach_pipes([(0, 1), (1, 0)], rank, world_size, timeout=30.0, slots=4, slot_bytes=1024)
    gen = torch.Generator().manual_seed(0)
    messages = [
        torch.randn(n, generator=gen).to(dtype)
        for n in (0, 1, 255, 256, 257, 1000, 3000)
        for dtype in (torch.float32, torch.bfloat16, torch.int64)
    ]
    received = []
    for sender, receiver in ((0, 1), (1, 0)):
        pipe = pipes[(sender, receiver)]
        for message in messages:
            if rank == sender:
                pipe.send(message)
            else:
                received.append(pipe.recv(torch.empty_like(message), "a test message"))
        if rank == sender:
            drain(30.0, "the test's messages")
    return {
        "pipes": sorted(pipes),
        "equal": len(received) == len(messages) and all(torch.equal(a, b) for a, b in zip(received, messages)),
        "count": len(received),
        "of": len(messages),
    }


def mesh_groups(rank: int, world_size: int, sizes: dict) -> dict:
    """Each dimension's group of this rank, proved by an all-reduce of the global ranks over it;
    and that asking again returns the same mesh (its groups are created once)."""
    from hf_parallel.distributed import comm
    from hf_parallel.distributed.mesh import get_mesh
    from hf_parallel.distributed.shm import channel_for

    mesh = get_mesh(**sizes)
    out = {"printed": str(mesh), "same_mesh": get_mesh(**sizes) is mesh, "stage": mesh.stage}
    for dim in ("world", "pp", "tp", "sp", "ep"):
        d = mesh[dim]
        out[dim] = {
            "ranks": list(d.ranks),
            "rank": d.rank,
            "sum": comm.all_reduce(torch.tensor([float(rank)]), d.group).item(),
            "shm": d.group is not None and channel_for(d.group) is not None,
        }
    # ranks 0 and 1 of every TP group form a subgroup (as ranks sharing a KV head do)
    group = mesh.subgroup("tp", lambda size: [[0, 1]] if size > 1 else [])
    out["subgroup_sum"] = None if group is None else comm.all_reduce(torch.tensor([float(rank)]), group).item()
    out["subgroup_again"] = mesh.subgroup("tp", lambda size: [[0, 1]] if size > 1 else []) is group
    return out


def collective_buffers(rank: int, world_size: int) -> dict:
    """Every collective helper run with the groups' device (the CPU, under gloo) while torch's
    default device is ``meta``: a buffer allocated without naming its device comes out ``meta``
    and is seen in the collective it is handed to (under NCCL the same slip gives a CPU buffer to a
    GPU collective). Per helper: the device of every tensor passed to a torch.distributed op, and
    whether it computed the right values."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_parallel.checkpoint.saving import Scratch, gather_block
    from hf_parallel.distributed import comm
    from hf_parallel.distributed.batch import broadcast_batch
    from hf_parallel.distributed.mesh import get_mesh
    from hf_parallel.pipeline.p2p import StageLink
    from hf_parallel.pipeline.tied import full_tensor
    from hf_parallel.core.layout import per_rank

    class Devices(TorchDispatchMode):
        """The devices of the tensors each torch.distributed op is given (the op still runs)."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                flat = [*args, *(kwargs or {}).values()]
                flat = [t for item in flat for t in (item if isinstance(item, (list, tuple)) else [item])]
                self.seen += [str(t.device) for t in flat if isinstance(t, torch.Tensor)]
            return func(*args, **(kwargs or {}))

    cpu = torch.device("cpu")
    tp, pp = get_mesh(tp_size=world_size), get_mesh(pp_size=world_size)
    other = 1 - rank
    layout = per_rank(1, [(0, 3), (3, 5)])  # a column split, uneven: every run goes through the wire buffer
    full = torch.arange(20.0, device=cpu).view(4, 5)
    helpers = {
        "all_reduce": lambda: (
            comm.all_reduce(torch.full((3,), float(rank), device=cpu), tp.tp.group).tolist() == [1.0] * 3
        ),
        "all_gather": lambda: (
            comm.all_gather(torch.full((1, rank + 1), float(rank), device=cpu), 1, [1, 2], tp.tp.group).tolist()
            == [[0.0, 1.0, 1.0]]
        ),
        "all_to_all": lambda: (
            comm.all_to_all(
                torch.full((1, 3, rank + 1), float(rank), device=cpu), 1, 2, [2, 1], [1, 2], tp.tp.group
            ).shape
            == (1, [2, 1][rank], 3)
        ),
        "broadcast_batch": lambda: (
            broadcast_batch(
                {"ids": torch.arange(4, device=cpu).view(2, 2) if rank == 0 else None}, tp.tp.group, cpu
            )["ids"].tolist()
            == [[0, 1], [2, 3]]
        ),
        "stage_send_recv": lambda: _stage_round_trip(StageLink(pp), rank, other, cpu),
        "broadcast_from_last": lambda: (
            StageLink(pp).broadcast_from_last(torch.ones(2, 2, device=cpu) if rank == 1 else None).tolist()
            == [[1.0, 1.0], [1.0, 1.0]]
        ),
        "gather_block": lambda: _gathered(
            gather_block(
                layout.extract(full, rank).contiguous(), layout, ((1, 3), (0, 5)), tp.tp, "w", (Scratch(), Scratch(cpu))
            ),
            full[1:3],
            rank,
        ),  # fmt: skip
        "full_tensor": lambda: torch.equal(
            full_tensor(layout.extract(full, rank).contiguous(), layout, (4, 5), tp.tp), full
        ),
    }
    out = {}
    for name, helper in helpers.items():
        recorder = Devices()
        torch.set_default_device("meta")
        try:
            with recorder:
                right = bool(helper())
        finally:
            torch.set_default_device(None)
        out[name] = {"devices": sorted(set(recorder.seen)), "ops": len(recorder.seen), "right": right}
    dist.barrier()
    return out


def _stage_round_trip(link, rank: int, other: int, device) -> bool:
    sent = torch.full((2, 3), float(rank + 1), device=device)
    with link.hold_sends():  # both send and receive: one batch each, as NCCL's rules require
        link.send(sent, other, "a test tensor")
    got = link.recv(other, "a test tensor")
    link.flush()
    return got.tolist() == [[float(other + 1)] * 3] * 2


def _gathered(block, want, rank: int) -> bool:
    return block is None if rank else torch.equal(block, want)


COPYING_OPS = ("clone", "cat", "copy_", "_to_copy", "index_select", "constant_pad_nd")


def collective_copies(rank: int, world_size: int) -> dict:
    """The bytes each eager transport copies on this rank, over gloo (the path NCCL's collectives take;
    the caller sets ``HF_PARALLEL_SHM=0``), counted by a dispatch mode that adds up every copying op's
    output, with each collective's result and what it moved (``comm.COUNTS``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_parallel.distributed import comm
    from hf_parallel.distributed.mesh import get_mesh

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in COPYING_OPS:
                written = args[0] if func.overloadpacket.__name__ == "copy_" else out
                self.bytes += written.numel() * written.element_size()
            return out

    group = get_mesh().tp.group
    mine = float(rank + 1)
    total = sum(range(1, world_size + 1))

    def measured(name, call):
        comm.COUNTS.clear()
        with Copies() as copies:
            out = call()
        moved = {op: comm.COUNTS[op] for op in ("all_reduce:bytes", "all_gather:bytes", "all_to_all:bytes")}
        return name, {"copied": copies.bytes, "out": out.nbytes, "moved": {k: v for k, v in moved.items() if v}}, out

    results = {}
    x = torch.full((4, 16), mine)
    name, facts, out = measured("reduce_from", lambda: comm.reduce_from(x, group))
    results[name] = {**facts, "right": bool((out == total).all()), "in_place": out.data_ptr() == x.data_ptr()}
    kept = torch.full((4, 16), mine)
    name, facts, out = measured("all_reduce", lambda: comm.all_reduce(kept, group))
    results[name] = {**facts, "right": bool((out == total).all() and (kept == mine).all())}
    for dim in (0, -1):
        piece = torch.full((2, 3), mine)
        sizes = [2 if dim == 0 else 3] * world_size
        name, facts, out = measured(f"gather_dim{dim}", lambda: comm.gather_from(piece, dim, sizes, group))
        want = torch.cat([torch.full((2, 3), float(r + 1)) for r in range(world_size)], dim)
        results[name] = {**facts, "right": torch.equal(out, want)}
    for batch in (1, 2):  # Ulysses' query exchange: [batch, heads, seq/sp, dim] -> [batch, heads/sp, seq, dim]
        heads, seq, dim = 2 * world_size, 3, 4
        whole = torch.arange(batch * heads * seq * world_size * dim, dtype=torch.float32)
        whole = whole.view(batch, heads, seq * world_size, dim)
        local = whole[:, :, rank * seq : (rank + 1) * seq].contiguous()
        heads_each, tokens_each = [2] * world_size, [seq] * world_size
        name, facts, out = measured(
            f"all_to_all_batch{batch}", lambda: comm.all_to_all(local, 1, 2, heads_each, tokens_each, group)
        )
        results[name] = {**facts, "in": local.nbytes, "right": torch.equal(out, whole[:, 2 * rank : 2 * rank + 2])}
    return results


