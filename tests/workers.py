"""Functions that run inside each rank of a spawned gloo group (see distributed.run_ranks)."""

from __future__ import annotations

import math
import os

import torch
import transformers

PROMPT = [{"role": "user", "content": "Explain in detail how a bicycle works."}]
# holds the first vocab row of every rank at TP=2, 3, 4 (vocab 101: 51; 34, 68; 26, 51, 76), where a
# padding_idx left unshifted would silently drop the gradient
INPUT_IDS = torch.tensor([[1, 51, 42, 34, 99, 68, 8], [3, 64, 26, 76, 31, 9, 50]])


def _output_and_loss(model, encoder: bool):
    """Causal LMs: logits and the LM loss. Encoders: the last hidden state and a loss on it."""
    if encoder:
        out = model(INPUT_IDS)
        pooled = getattr(out, "pooler_output", None)
        loss = out.last_hidden_state.square().mean() + (0 if pooled is None else pooled.square().mean())
        return out.last_hidden_state, loss
    out = model(INPUT_IDS, labels=INPUT_IDS)
    return out.logits, out.loss


def reference(path: str, encoder: bool = False):
    """Single-process transformers: output and gradients of one step."""
    auto = transformers.AutoModel if encoder else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32)
    output, loss = _output_and_loss(model, encoder)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return output.detach(), grads


def expected_slice(full: torch.Tensor, layout, rank: int) -> torch.Tensor:
    pieces = [full[index] for index in layout.index(tuple(full.shape), rank)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=layout.dim)


def compare_tp(
    rank: int, world_size: int, cases: dict, save_root: str | None, encoder: bool = False, distributed: bool = False
) -> dict:
    """For each case (checkpoint path, tp_plan[, reference path]): TP output/grads vs single process
    (of the reference path, when the checkpoint is one transformers cannot read), collectives per
    forward, and a save (``distributed``: per-rank files). ``encoder``: AutoModel and its last hidden
    state instead of logits."""
    import hf_parallel
    from hf_parallel.distributed import comm

    auto = hf_parallel.AutoModel if encoder else hf_parallel.AutoModelForCausalLM
    results = {}
    for name, (path, tp_plan, *reference_path) in cases.items():
        ref_output, ref_grads = reference(reference_path[0] if reference_path else path, encoder)
        model = auto.from_pretrained(path, tp_plan=tp_plan, dtype=torch.float32)
        comm.COUNTS.clear()
        with torch.no_grad():
            model(INPUT_IDS)
        counts = {op: comm.COUNTS[op] for op in ("all_reduce", "all_gather")}
        output, loss = _output_and_loss(model, encoder)
        loss.backward()
        grad_error, missing = 0.0, []
        state = model._hf_parallel
        for entry in state.shard.unique_params():
            grad = model.get_parameter(entry.name).grad
            if grad is None:
                if ref_grads[entry.name] is not None:  # unused in this forward (cross-attention) is fine
                    missing.append(entry.name)
                continue
            want = expected_slice(ref_grads[entry.name], entry.layout, rank)
            grad_error = max(grad_error, (grad - want).abs().max().item() if grad.numel() else 0.0)
        results[name] = {
            "logits": (output.detach() - ref_output).abs().max().item(),
            "grads": grad_error,
            "missing_grads": missing,
            "grad_scale": max(
                (g.abs().max().item() for g in ref_grads.values() if g is not None and g.numel()), default=0.0
            ),
            "counts": counts,
            "layers": model.config.num_hidden_layers,
            "plan_source": state.shard.plan.source,
        }
        if save_root is not None:
            model.save_pretrained(os.path.join(save_root, name), distributed=distributed)
    return results


def generate_tokens(rank: int, world_size: int, path: str, max_new_tokens: int, save_dir: str | None) -> dict:
    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    if save_dir is not None:
        model.save_pretrained(save_dir)
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"tokens": out[0, ids.shape[1] :].tolist(), "local_bytes": local_bytes}


def _mapped_safetensors() -> list[tuple[int, int]]:
    """Address ranges where this process has a .safetensors file memory-mapped."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def count_bytes_read(rank: int, world_size: int, path: str) -> dict:
    """Bytes the loader requested per checkpoint key vs the bytes of this rank's shard."""
    import hf_parallel
    from hf_parallel.checkpoint.loading import BYTES_READ

    BYTES_READ.clear()
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    state = model._hf_parallel
    rows = {}
    for entry in state.shard.unique_params():
        key = state.source_keys[entry.name]
        param = model.get_parameter(entry.name)
        full = 1
        for n in entry.full_shape:
            full *= n
        rows[key] = {
            "read": BYTES_READ[key],
            "local": param.numel() * param.element_size(),
            "full": full * param.element_size(),
            "sharded": not entry.layout.is_replicated,
            "contiguous": param.is_contiguous(),
            "file_view": any(lo <= param.data_ptr() < hi for lo, hi in _mapped_safetensors()),
        }
    return rows


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


def load_expecting_error(rank: int, world_size: int, paths: list, kwargs: dict) -> dict:
    """Rank r loads ``paths[r]``; returns the error it got (or None)."""
    import hf_parallel

    try:
        hf_parallel.AutoModelForCausalLM.from_pretrained(paths[rank], tp_plan="auto", **kwargs)
    except Exception as error:  # noqa: BLE001 - the test asserts the type by name
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": None}


def save_as_loaded(rank: int, world_size: int, path: str, out: str, distributed: bool) -> dict:
    """Load in the checkpoint's own dtype and save: the round trip must be bit-exact."""
    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    model.save_pretrained(out, distributed=distributed)
    return {"local_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def save_killed_midway(rank: int, world_size: int, path: str, out: str) -> dict:
    """A distributed save in which rank 1 is SIGKILLed after writing its first tensor."""
    import signal

    import hf_parallel
    from hf_parallel.checkpoint import writer

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    if rank == 1:
        write = writer.SafetensorsWriter.write

        def write_then_die(self, key, tensor):
            write(self, key, tensor)
            self.file.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        writer.SafetensorsWriter.write = write_then_die
    model.save_pretrained(out, distributed=True)
    return {}


def compare_ep(rank: int, world_size: int, cases: dict, save_root: str) -> dict:
    """compare_tp for expert parallelism (``ep_plan="auto"``, with or without tensor parallelism):
    outputs and gradients vs one process, experts held per rank, and a save."""
    import hf_parallel

    results = {}
    for name, (path, tp_plan) in cases.items():
        ref_output, ref_grads = reference(path)
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(
            path, tp_plan=tp_plan, ep_plan="auto", dtype=torch.float32
        )
        output, loss = _output_and_loss(model, False)
        loss.backward()
        state, errors, experts = model._hf_parallel, [0.0], {}
        for entry in state.shard.unique_params():
            grad = model.get_parameter(entry.name).grad
            if grad is not None:
                errors.append((grad - expected_slice(ref_grads[entry.name], entry.layout, rank)).abs().max().item())
            if entry.name.endswith("experts.gate_up_proj"):
                experts[entry.name] = model.get_parameter(entry.name).shape[0]
        results[name] = {
            "logits": (output.detach() - ref_output).abs().max().item(),
            "grads": max(errors),
            "experts": experts,
        }
        model.save_pretrained(os.path.join(save_root, name))
    return results


BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def benchmark_rss_readings():
    """benchmarks/measure.py's (rss_bytes, peak_rss_bytes, reset_peak_rss): tests read RSS as the benchmark does."""
    import sys

    sys.path.insert(0, BENCHMARKS)
    import measure

    return measure.rss_bytes, measure.peak_rss_bytes, measure.reset_peak_rss


def consolidate_in_fresh_process(src: str, out: str) -> dict:
    """``hf_parallel.consolidate`` run as the benchmark runs it (its own script, a fresh process):
    its result plus RSS after imports and the peak."""
    import json
    import subprocess
    import sys

    sys.path.insert(0, BENCHMARKS)
    from worker import CONSOLIDATE

    env = {**os.environ, "PYTHONPATH": BENCHMARKS}
    run = subprocess.run(
        [sys.executable, "-c", CONSOLIDATE, src, out], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def expert_parallel_memory(rank: int, world_size: int, path: str, warm_path: str, ep: bool) -> dict:
    """Peak and resident RSS above the pre-load baseline, over loading and one forward, with
    experts spread over the ranks (``ep``) or every rank holding all of them. A tiny model of the
    same family is loaded and run first, so code imported and initialised on first use (and the
    process group) is in the baseline."""
    import gc

    import hf_parallel

    rss_bytes, peak_rss_bytes, reset_peak_rss = benchmark_rss_readings()

    kwargs = dict(tp_plan=None, ep_plan="auto") if ep else dict(tp_plan=None)
    warm = hf_parallel.AutoModelForCausalLM.from_pretrained(warm_path, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        warm(INPUT_IDS)
    del warm
    gc.collect()
    baseline = rss_bytes()
    reset_peak_rss()
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        model(INPUT_IDS)
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    return {
        "peak": peak_rss_bytes() - baseline,
        "resident": rss_bytes() - baseline,
        "local_expert_bytes": experts,
        "rest_bytes": rest,
    }


def save_memory(rank: int, world_size: int, path: str, out: str) -> dict:
    """Rank 0's peak RSS added by a gathered save, above its RSS before it. Every local shard is
    paged in first and a first save warms the code, so what is measured is the save's own buffers.
    Then a distributed save, for the test to consolidate."""
    import hf_parallel

    rss_bytes, peak_rss_bytes, reset_peak_rss = benchmark_rss_readings()

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.sum()
    model.save_pretrained(os.path.join(out, "warm"))
    before = rss_bytes()
    reset_peak_rss()
    model.save_pretrained(os.path.join(out, "saved"))
    added = peak_rss_bytes() - before
    model.save_pretrained(os.path.join(out, "distributed"), distributed=True)  # for consolidation
    largest = max(math.prod(entry.full_shape) * 4 for entry in model._hf_parallel.shard.unique_params())
    return {"added": added, "largest_full_tensor": largest}


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


def verify_with_a_broken_layer(rank: int, world_size: int, path: str) -> dict | None:
    """hf-parallel verify on a plan whose layer 1 output projection keeps each rank's partial sum
    (a registered style that forgot its all-reduce): wrong numbers and no error, from layer 1 on."""
    import torch.nn.functional as F

    from hf_parallel import register_style
    from hf_parallel.tensor.plan import curated_plan_for
    from hf_parallel.tensor.styles import Rowwise
    from hf_parallel.verify import verify

    class RowwiseWithoutSum(Rowwise):
        def install(self, module, ctx, name, layouts):
            module.forward = lambda x, *args, **kwargs: F.linear(x, module.weight)

    register_style("rowwise_without_sum", RowwiseWithoutSum(), overwrite=True)
    rules = {**curated_plan_for("llama")[0], "layers.1.self_attn.o_proj": "rowwise_without_sum"}
    report = verify(path, tp_plan=rules)
    if report is None:
        return None
    first = report.first_divergence
    return {"first": first.name, "rows": {row.name: row.relative for row in report.rows}, "text": str(report)}


def sequence_batches(vocab: int) -> dict:
    """Batches for sequence parallelism: lengths that do not divide (37) and do (64), padding on
    the left and on the right, two samples packed in one row (positions restarting at 0), and a
    sequence shorter than the group (3 tokens)."""
    gen = torch.Generator().manual_seed(7)

    def ids(length, rows=2):
        return torch.randint(3, vocab, (rows, length), generator=gen)

    padded_ids, mask = ids(37), torch.ones(2, 37, dtype=torch.long)
    mask[0, :6] = 0  # left padding
    mask[1, 30:] = 0  # right padding
    packed_ids = ids(37, rows=1)
    # use_cache=False everywhere: with a cache, transformers' single-process mask ignores packed samples
    # (their position_ids restart at 0) and lets the second attend to the first
    return {
        "len37": dict(input_ids=(x := ids(37)), labels=x, use_cache=False),
        "len64": dict(input_ids=(y := ids(64)), labels=y, use_cache=False),
        "padded": dict(
            input_ids=padded_ids, attention_mask=mask, labels=padded_ids.masked_fill(mask == 0, -100), use_cache=False
        ),
        "packed": dict(
            input_ids=packed_ids,
            position_ids=torch.cat([torch.arange(20), torch.arange(17)]).unsqueeze(0),
            labels=packed_ids,
            use_cache=False,
        ),
        "len3": dict(input_ids=(z := ids(3)), labels=z, use_cache=False),
    }


def compare_sp(rank: int, world_size: int, cases: dict, tp_size: int, sp_size: int, save_root: str) -> dict:
    """For each checkpoint: every batch's loss, this rank's logits and every parameter's gradient
    under tp x sp against one process, the whole logits of an inference forward (no labels), greedy
    generate, a save, and the weights after one SGD step."""
    import hf_parallel
    from hf_parallel.distributed.mesh import get_mesh

    results = {}
    sp_rank = get_mesh(tp_size, sp_size=sp_size).sp.rank
    for name, path in cases.items():
        single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto" if tp_size > 1 else None, tp_size=tp_size, sp_size=sp_size, dtype=torch.float32
        )
        state = model._hf_parallel
        for batch_name, batch in sequence_batches(single.config.vocab_size).items():
            single.zero_grad()
            model.zero_grad()
            want = single(**batch)
            want.loss.backward()
            got = model(**batch)
            got.loss.backward()
            seq = batch["input_ids"].shape[1]
            sizes = [seq // sp_size + (r < seq % sp_size) for r in range(sp_size)]
            start = sum(sizes[:sp_rank])
            real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool().unsqueeze(-1)
            local_logits = want.logits[:, start : start + sizes[sp_rank]]  # padding tokens are compared nowhere
            local_real = real[:, start : start + sizes[sp_rank]]
            grad_error, grad_scale = 0.0, 0.0
            for entry in state.shard.unique_params():
                grad = model.get_parameter(entry.name).grad
                reference = expected_slice(single.get_parameter(entry.name).grad, entry.layout, state.mesh.tp.rank)
                grad_error = max(grad_error, (grad - reference).abs().max().item() if grad.numel() else 0.0)
                grad_scale = max(grad_scale, reference.abs().max().item() if grad.numel() else 0.0)
            with torch.no_grad():
                whole = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            results[f"{name}/{batch_name}"] = {
                "loss": abs(got.loss.item() - want.loss.item()),
                "logits": (got.logits - local_logits).masked_fill(~local_real, 0).abs().max().item()
                if local_logits.numel()
                else 0.0,
                "local_tokens": got.logits.shape[1],
                "whole_logits": (whole - want.logits).masked_fill(~real, 0).abs().max().item(),
                "grads": grad_error,
                "grad_scale": grad_scale,
            }
        prompt = sequence_batches(single.config.vocab_size)["len37"]["input_ids"][:, :9]
        want_tokens = single.generate(prompt, max_new_tokens=6, do_sample=False)
        results[f"{name}/generate"] = model.generate(prompt, max_new_tokens=6, do_sample=False).equal(want_tokens)
        model.save_pretrained(os.path.join(save_root, name))
        for opt_model in (single, model):
            torch.optim.SGD(opt_model.parameters(), lr=0.5).step()
        results[f"{name}/step"] = max(
            (
                model.get_parameter(e.name)
                - expected_slice(single.get_parameter(e.name).detach(), e.layout, state.mesh.tp.rank)
            )
            .abs()
            .max()
            .item()
            for e in state.shard.unique_params()
        )
    return results


def sequence_comm_properties(rank: int, world_size: int) -> dict:
    """The sequence-parallel collectives on random uneven shapes (hypothesis, derandomized so every
    rank draws the same examples in the same order; errors are returned, not raised, so no rank
    leaves a collective the others are in)."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    from hf_parallel.distributed import comm
    from hf_parallel.distributed.mesh import get_mesh
    from hf_parallel.tensor.layout import even_sizes, sizes_to_ranges

    group = get_mesh().tp.group
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
            worst["all_to_all"] = max(worst["all_to_all"], (out - full[:, slice(*head_range)]).abs().max().item())
        if local.numel():
            error = (local.grad - grad[:, :, slice(*seq_range)]).abs().max().item()
            worst["all_to_all_backward"] = max(worst["all_to_all_backward"], error)
        whole = full.clone().requires_grad_()
        part = comm.scatter_to(whole, 2, even_sizes(seq, world_size), group, grad_scale=1 / world_size)
        part.backward(grad[:, :, slice(*seq_range)])
        if whole.numel():
            worst["scatter_backward"] = max(
                worst["scatter_backward"], (whole.grad - grad * (1 / world_size)).abs().max().item()
            )

    check()
    mine = {
        "ids": torch.arange(6).view(2, 3),
        "rest": [torch.ones(4, dtype=torch.bfloat16), 5, None],
        "m": (torch.tensor([True]),),
    }
    other = {"ids": torch.zeros(1), "rest": [], "m": ()}
    got = comm.broadcast_batch(mine if rank == 0 else other, group)
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


def pipeline_batch(vocab: int) -> dict:
    """Four rows, the last two left-padded (their masks reach every stage's mask sizing)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (4, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[2, :3], mask[3, :5] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def compare_pp(rank: int, world_size: int, cases: dict, sizes: dict, save_root: str) -> dict:
    """For each checkpoint under the pipeline layout ``sizes``: logits (padded batch), greedy and
    seeded-sampling tokens, every gradient after a GPipe and a 1F1B step of 4 micro-batches, one
    SGD step (tied copies bitwise equal), a gathered save and a distributed save."""
    import hf_parallel
    from hf_parallel.checkpoint.loading import BYTES_READ
    from hf_parallel.pipeline import train_step
    from hf_parallel.pipeline.tied import full_tensor

    results = {}
    for name, (path, kwargs) in cases.items():
        single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        BYTES_READ.clear()
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes, **kwargs)
        state = model._hf_parallel
        read = {  # bytes read, and the layers whose keys were read at all
            "bytes": sum(BYTES_READ.values()),
            "local": sum(model.get_parameter(e.name).nbytes for e in state.shard.unique_params()),
            "layers": sorted({int(k.split(".layers.")[1].split(".")[0]) for k in BYTES_READ if ".layers." in k}),
        }
        model.save_pretrained(os.path.join(save_root, name, "gathered"))
        model.save_pretrained(os.path.join(save_root, name, "distributed"), distributed=True)
        batch = pipeline_batch(single.config.vocab_size)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = {}
        with torch.no_grad():
            real = batch["attention_mask"].bool().unsqueeze(-1)
            want = single(**inputs).logits
            out["logits"] = (model(**inputs).logits - want).masked_fill(~real, 0).abs().max().item()
        prompt = {k: v[:, :6] for k, v in inputs.items()}
        out["greedy"] = model.generate(**prompt, max_new_tokens=5, do_sample=False).equal(
            single.generate(**prompt, max_new_tokens=5, do_sample=False)
        )
        sampled = []
        for generating in (model, single):
            torch.manual_seed(11)
            sampled.append(generating.generate(**prompt, max_new_tokens=5, do_sample=True, top_k=0, temperature=1.0))
        out["sampled"] = sampled[0].equal(sampled[1])
        single.train()
        model.train()
        try:  # a plain forward's loss cannot reach the other stages' parameters: refused, with the way out
            model(**batch)
            out["plain_backward"] = None
        except RuntimeError as error:
            out["plain_backward"] = str(error)
        single.zero_grad()
        reference = single(**batch)
        reference.loss.backward()
        for schedule in ("gpipe", "1f1b"):
            model.zero_grad()
            loss = train_step(model, **batch, micro_batches=4, schedule=schedule)
            grad_error, grad_scale = 0.0, 0.0
            for entry in state.shard.unique_params():
                want_grad = expected_slice(single.get_parameter(entry.name).grad, entry.layout, state.mesh.tp.rank)
                got = model.get_parameter(entry.name).grad
                grad_error = max(grad_error, (got - want_grad).abs().max().item())
                grad_scale = max(grad_scale, want_grad.abs().max().item())
            out[schedule] = {"loss": abs(loss.item() - reference.loss.item()), "grads": grad_error, "scale": grad_scale}
        for stepping in (single, model):
            torch.optim.SGD(stepping.parameters(), lr=0.5).step()
        out["step"] = max(
            (model.get_parameter(e.name) - expected_slice(single.get_parameter(e.name).detach(), e.layout, state.mesh.tp.rank))
            .abs()
            .max()
            .item()
            for e in state.shard.unique_params()
        )
        out["tied"] = [  # the full tied weight after the step, as this stage holds it
            full_tensor(model.get_parameter(n).detach(), state.shard.params[n].layout, state.shard.params[n].full_shape, state.mesh.tp).sum().item()
            for n in state.tied_across_stages
        ]
        out["tied_bits"] = [
            full_tensor(model.get_parameter(n).detach(), state.shard.params[n].layout, state.shard.params[n].full_shape, state.mesh.tp).view(torch.int32).long().sum().item()
            for n in state.tied_across_stages
        ]
        model.eval()
        out["stage"], out["layers"] = state.mesh.stage, list(state.pipeline.split.layers_of(state.mesh.stage))
        out["read"] = read
        results[name] = out
    return results


def pipeline_refusals(rank: int, world_size: int, path: str) -> dict:
    """Bad pipeline layouts: the error each gives, and the bytes read before it (none)."""
    import hf_parallel
    from hf_parallel.checkpoint.loading import BYTES_READ

    BYTES_READ.clear()
    asked = {
        "world_mismatch": dict(stage_tp_sizes=[2, 1]),
        "stage_layers_sum": dict(pp_size=2, stage_layers=[2, 2]),
        "stage_layers_count": dict(pp_size=2, stage_layers=[5]),
        "too_few_layers": dict(pp_size=2, num_hidden_layers=1),
    }
    out = {}
    try:
        hf_parallel.AutoModel.from_pretrained(path, pp_size=2)
        out["no_head"] = None
    except ValueError as error:
        out["no_head"] = str(error)
    for name, kwargs in asked.items():
        try:
            hf_parallel.AutoModelForCausalLM.from_pretrained(path, **kwargs)
            out[name] = None
        except (ValueError, TypeError) as error:
            out[name] = str(error)
    out["bytes_read"] = sum(BYTES_READ.values())
    return out


def pipeline_peer_fails(
    rank: int, world_size: int, path: str, out: str, timeout: float, failing: int, how: str = "dies"
) -> dict:
    """At PP=2, rank ``failing`` dies (process exit) or hangs (alive, absent) before a forward; the
    other runs it and reports its error."""
    import json
    import time

    import torch.distributed as dist

    import hf_parallel
    from hf_parallel.distributed.mesh import get_mesh

    os.environ["HF_PARALLEL_TIMEOUT"] = str(timeout)
    get_mesh(pp_size=2)
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, pp_size=2, tp_plan=None)
    if rank == failing:
        if how == "hangs":
            time.sleep(timeout + 3)
            dist.destroy_process_group()
            return {}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({}, f)
        os._exit(0)
    start = time.monotonic()
    try:
        with torch.no_grad():
            model(INPUT_IDS)
        result = {"type": None}
    except Exception as error:  # noqa: BLE001 - the test asserts the type by name
        result = {"type": type(error).__name__, "message": str(error)}
    dist.destroy_process_group()
    return {**result, "seconds": time.monotonic() - start}


def pipeline_logits(rank: int, world_size: int, path: str, reference: str, sizes: dict) -> dict:
    """Logits of a pipeline load of ``path`` against one process of ``reference`` (same weights)."""
    import hf_parallel

    single = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
    batch = pipeline_batch(single.config.vocab_size)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        real = batch["attention_mask"].bool().unsqueeze(-1)
        error = (model(**inputs).logits - single(**inputs).logits).masked_fill(~real, 0).abs().max().item()
    return {"logits": error, "stage": model._hf_parallel.mesh.stage}


def accumulate_without_pipeline(rank: int, world_size: int, path: str, layouts: dict) -> dict:
    """``train_step`` over 3 micro-batches on a TP or SP model: gradients against one process's."""
    import hf_parallel

    single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = pipeline_batch(single.config.vocab_size)
    reference = single(**batch)
    reference.loss.backward()
    out = {}
    for name, sizes in layouts.items():
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
        loss = hf_parallel.train_step(model, **batch, micro_batches=3)
        state, error = model._hf_parallel, 0.0
        for entry in state.shard.unique_params():
            want = expected_slice(single.get_parameter(entry.name).grad, entry.layout, state.mesh.tp.rank)
            error = max(error, (model.get_parameter(entry.name).grad - want).abs().max().item())
        out[name] = {"loss": abs(loss.item() - reference.loss.item()), "grads": error}
    return out
