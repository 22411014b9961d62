"""Workers of pipeline parallelism against one process (test_pipeline). Each runs inside a rank of a spawned gloo group (``distributed.run_ranks``)."""

from __future__ import annotations

import os

import torch
from compare import gap, gaps, of_model
from tp_workers import INPUT_IDS


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
    import transformers

    import hf_parallel
    from hf_parallel.checkpoint.loading import BYTES_READ
    from hf_parallel.pipeline.tied import full_tensor

    results = {}
    for name, (path, kwargs) in cases.items():
        single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        BYTES_READ.clear()
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes, **kwargs)
        state = hf_parallel.parallel_state(model)
        read = {  # bytes read, and the layers whose keys were read at all
            "bytes": sum(BYTES_READ.values()),
            "local": sum(model.get_parameter(e.name).nbytes for e in state.layout.unique_params()),
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
            out["logits"] = gap(model(**inputs).logits.masked_fill(~real, 0), want.masked_fill(~real, 0))
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
            loss = hf_parallel.train_step(model, **batch, micro_batches=4, schedule=schedule)
            out[schedule] = {"loss": gap(loss, reference.loss),
                             "grads": gaps(model, state, of_model(single), state.mesh.tp.rank)}  # fmt: skip
        for stepping in (single, model):
            torch.optim.SGD(stepping.parameters(), lr=0.5).step()
        out["step"] = gaps(model, state, of_model(single, "data"), state.mesh.tp.rank, "data")
        out["tied"] = [  # the full tied weight after the step, as this stage holds it
            full_tensor(
                model.get_parameter(n).detach(),
                state.layout.params[n].layout,
                state.layout.params[n].full_shape,
                state.mesh.tp,
            )
            .sum()
            .item()
            for n in state.stage.tied
        ]
        out["tied_bits"] = [
            full_tensor(
                model.get_parameter(n).detach(),
                state.layout.params[n].layout,
                state.layout.params[n].full_shape,
                state.mesh.tp,
            )
            .view(torch.int32)
            .long()
            .sum()
            .item()
            for n in state.stage.tied
        ]
        model.eval()
        out["stage"], out["layers"] = state.mesh.stage, list(state.stage.layers())
        out["transport"] = transport(state.mesh)
        out["read"] = read
        results[name] = out
    return results


def transport(mesh) -> dict:
    """What carried this rank's messages: shared-memory pipes between stages, a shared-memory TP channel."""
    from hf_parallel.distributed.shm import channel_for

    return {"pipes": len(mesh.pipes), "tp_shm": mesh.tp.group is not None and channel_for(mesh.tp.group) is not None}


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
    import transformers

    import hf_parallel

    single = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
    batch = pipeline_batch(single.config.vocab_size)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        real = batch["attention_mask"].bool().unsqueeze(-1)
        error = gap(model(**inputs).logits.masked_fill(~real, 0), single(**inputs).logits.masked_fill(~real, 0))
    return {"logits": error, "stage": hf_parallel.parallel_state(model).mesh.stage}


def accumulate_without_pipeline(rank: int, world_size: int, path: str, layouts: dict) -> dict:
    """``train_step`` over 3 micro-batches on a TP or SP model: gradients against one process's. A layout
    with a ``dtype`` (bf16, fp16) loads in it and takes one batch whole, against one process in that dtype:
    the loss, logits and every gradient, in fp32 from those dtypes' values."""
    import transformers

    import hf_parallel

    references = {}
    batch = None
    out = {}
    for name, sizes in layouts.items():
        sizes = dict(sizes)
        dtype = getattr(torch, sizes.pop("dtype", "float32"))
        if dtype not in references:
            single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            batch = pipeline_batch(single.config.vocab_size)
            references[dtype] = (single, single(**batch))
            references[dtype][1].loss.backward()
        single, reference = references[dtype]
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **sizes)
        state = hf_parallel.parallel_state(model)
        if dtype == torch.float32:
            loss = hf_parallel.train_step(model, **batch, micro_batches=3)
            out[name] = {"loss": gap(loss, reference.loss)}
        else:
            got = model(**batch)
            got.loss.backward()
            whole = reference.logits if state.sequence is None else None
            out[name] = {"loss": gap(got.loss, reference.loss), "dtype": str(got.logits.dtype),
                         **({"logits": gap(got.logits, whole)} if whole is not None else {})}  # fmt: skip
        out[name]["grads"] = gaps(model, state, of_model(single), state.mesh.tp.rank)
    return out


def checkpointed_stages(rank: int, world_size: int, path: str, sizes: dict) -> dict:
    """Activation checkpointing (reentrant and not) on pipeline stages, trained by ``train_step`` (GPipe
    and 1F1B): the loss and every gradient against one process's, checkpointed the same way."""
    import transformers

    import hf_parallel

    out = {}
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
    batch = pipeline_batch(single.config.vocab_size)
    single.train()
    single.gradient_checkpointing_enable(**kwargs)
    reference = single(**batch)
    reference.loss.backward()
    model.train()
    for reentrant, schedule in ((False, "gpipe"), (True, "1f1b")):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.zero_grad()
        loss = hf_parallel.train_step(model, **batch, micro_batches=2, schedule=schedule)
        state = hf_parallel.parallel_state(model)
        grads = gaps(model, state, of_model(single), state.mesh.tp.rank)
        out[schedule] = {"loss": gap(loss, reference.loss), "grads": grads,
                         "checkpointed": model.is_gradient_checkpointing}  # fmt: skip
    return out
