"""Workers of data-parallel training against one process (test_training). Each runs inside a rank
of a spawned gloo group (``distributed.run_ranks``); the reference runs in one process."""

from __future__ import annotations

import contextlib
import math
import os

import torch

STEPS, MAX_NORM, LR = 5, 0.5, 1e-3
SGD_LR = 0.1  # the last step's: plain SGD moves with the gradient's scale (AdamW's m / sqrt(v) does not)


def stepper(parameters, sgd_at: int | None = STEPS - 1):
    """``step(i)``: the optimizer step of step ``i``: AdamW, and plain SGD at step ``sgd_at`` (the last: AdamW's
    first steps, near sign(g), are what the trajectories were measured with)."""
    parameters = list(parameters)
    adamw, sgd = torch.optim.AdamW(parameters, lr=LR), torch.optim.SGD(parameters, lr=SGD_LR)
    return lambda step: (sgd if step == sgd_at else adamw).step()


def training_batch(vocab: int, step: int, rows: int = 4) -> dict:
    """The global batch of one step: ``rows`` rows, a few labels ignored."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, vocab, (rows, 10), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def one_process(path: str, steps: int = STEPS, sgd_at: int | None = STEPS - 1) -> dict:
    """Losses, gradient norms and final weights of ``steps`` steps with clipping in one process: AdamW, and one
    plain SGD step at ``sgd_at``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    step_with = stepper(model.parameters(), sgd_at)
    losses, norms = [], []
    for step in range(steps):
        loss = model(**training_batch(model.config.vocab_size, step)).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        step_with(step)
        model.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


_FIRST_GRADIENTS: dict = {}


def first_gradients(path: str) -> dict:
    """One process's gradients after the first step's backward (what ``one_process`` clips and steps with)."""
    if path not in _FIRST_GRADIENTS:
        import transformers
        from compare import of_model

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.train()
        model(**training_batch(model.config.vocab_size, 0)).loss.backward()
        _FIRST_GRADIENTS[path] = of_model(model)
    return _FIRST_GRADIENTS[path]


@contextlib.contextmanager
def parameter_bytes_at_each_fully_shard():
    """The parameter bytes this rank holds of the whole model (``memory.held_bytes``) each time ``fully_shard``
    is called inside the block (the real one runs)."""
    import torch.distributed.fsdp as fsdp

    import hf_parallel.api as api
    from hf_parallel.memory import held_bytes

    real_shard, real_data_parallel, seen, root = fsdp.fully_shard, api.shard_data_parallel, [], []

    def shard(module, *args, **kwargs):
        seen.append(held_bytes(root[0].parameters()))
        return real_shard(module, *args, **kwargs)

    def data_parallel(model, *args, **kwargs):
        root.append(model)
        return real_data_parallel(model, *args, **kwargs)

    fsdp.fully_shard, api.shard_data_parallel = shard, data_parallel
    try:
        yield seen
    finally:
        fsdp.fully_shard, api.shard_data_parallel = real_shard, real_data_parallel


@contextlib.contextmanager
def gradient_buckets_of(megabytes: float | None):
    """``HF_PARALLEL_GRADIENT_BUCKET_MB`` set to ``megabytes`` inside the block (None: left as it is)."""
    from hf_parallel.distributed.buckets import BUCKET_MB_ENV

    before = os.environ.get(BUCKET_MB_ENV)
    if megabytes is not None:
        os.environ[BUCKET_MB_ENV] = str(megabytes)
    try:
        yield
    finally:
        os.environ.pop(BUCKET_MB_ENV, None)
        if before is not None:
            os.environ[BUCKET_MB_ENV] = before


def held_after_load(model, state, at_sharding: list) -> dict:
    """What this rank holds of its parameters after the load, and at each ``fully_shard`` call, beside what the
    layout predicts (``memory.footprint``) and the model's own bytes."""
    from hf_parallel.memory import footprint, held_bytes

    predicted = footprint(state.layout, torch.float32)
    whole = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    experts = [e for e in state.layout.unique_params() if e.layout.over == "ep"]  # (under ep_size)
    return {"after_load": held_bytes(model.parameters()), "share": predicted.share,
            "at_sharding": at_sharding, "local_params": sum(s.numel() for s in shards), "whole": whole,
            "fsdp_group": list(state.mesh.fsdp.ranks),
            "experts": held_bytes(model.get_parameter(e.name) for e in experts),
            "experts_whole": sum(4 * math.prod(e.full_shape) for e in experts),
            "expert_holders": state.mesh.shape.ep * state.mesh["ep_replicas"].size}  # fmt: skip


def refusal(run) -> str | None:
    """The ValueError ``run()`` raises, or None."""
    try:
        run()
    except ValueError as error:
        return str(error)
    return None


def train(rank: int, world_size: int, cases: dict, save_root: str) -> dict:
    """For each case (checkpoint, layout, loop): the same steps on a parallel model (``loop``:
    ``train_step`` on the global batch, or a plain ``loss.backward()`` on this data-parallel
    replica's rows), clipped with ``hf_parallel.clip_grad_norm_`` after ``train_step`` and with torch's own
    ``torch.nn.utils.clip_grad_norm_`` (what most scripts call) after the plain loop; the trained model saved. Every gradient this
    rank holds (its FSDP slice of its TP shard) after the first backward, against one process's."""
    from compare import gaps

    import hf_parallel

    results = {}
    for name, (path, sizes, loop) in cases.items():
        sizes = dict(sizes)
        bucket_mb = sizes.pop("gradient_bucket_mb", None)  # the sums' buckets, read at the load
        with parameter_bytes_at_each_fully_shard() as at_sharding, gradient_buckets_of(bucket_mb):
            model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
        model.train()
        state = hf_parallel.parallel_state(model)
        held = held_after_load(model, state, at_sharding)
        dp = state.mesh.dp
        step_with = stepper(model.parameters())
        losses, norms, first_grads = [], [], None
        for step in range(STEPS):
            batch = training_batch(model.config.vocab_size, step)
            if loop == "train_step":
                loss = hf_parallel.train_step(model, **batch, micro_batches=2)
            else:  # each replica its rows, the loss over the global token count (FSDP averages replicas)
                rows = batch["input_ids"].shape[0] // dp.size
                mine = {k: v[dp.rank * rows : (dp.rank + 1) * rows] for k, v in batch.items()}
                tokens = (batch["labels"][:, 1:] != -100).sum()
                loss = model(**mine, num_items_in_batch=tokens / dp.size).loss
                loss.backward()
                loss = loss.detach()
                if dp.group is not None:  # the logged loss: the replicas' mean
                    torch.distributed.all_reduce(loss, group=dp.group)
                    loss /= dp.size
            if step == 0:  # where the sums happen: before clipping and any step
                first_grads = gaps(model, state, first_gradients(path), state.mesh.tp.rank)
            if loop == "train_step":
                norms.append(hf_parallel.clip_grad_norm_(model, MAX_NORM).item())
            else:  # what most scripts call: torch's own, routed to the global norm for a split model
                if step == 0:  # a part of the model: refused, on every rank alike (nothing summed)
                    part = [p for p in model.parameters() if p.grad is not None][:2]
                    refused = refusal(lambda: torch.nn.utils.clip_grad_norm_(part, MAX_NORM))
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            step_with(step)
            model.zero_grad()
            losses.append(loss.item())
        model.save_pretrained(os.path.join(save_root, name))
        results[name] = {"losses": losses, "norms": norms, "first_grads": first_grads, "held": held}
        if loop != "train_step":
            results[name]["part_refused"] = refused
        if dp.size > 1 and loop == "train_step":  # rows the replicas cannot share: refused before any forward
            try:
                hf_parallel.train_step(model, **training_batch(model.config.vocab_size, 0, rows=dp.size + 1))
                results[name]["uneven"] = None
            except ValueError as error:
                results[name]["uneven"] = str(error)
    return results


def saved_against(weights: dict, save_dir: str) -> dict:
    """A saved checkpoint, loaded by plain transformers, against ``weights`` (one process's state dict):
    ``compare.gap`` per key."""
    import transformers
    from compare import gap

    saved = transformers.AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32).state_dict()
    assert saved.keys() == weights.keys(), f"{save_dir}: {sorted(saved.keys() ^ weights.keys())}"
    return {k: gap(saved[k], weights[k]) for k in saved}


def trainer_dataset(vocab: int, rows: int) -> list[dict]:
    return [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(3, vocab, (rows, 10), generator=torch.Generator().manual_seed(5))
    ]


def trainer_arguments(output_dir: str, batch_size: int, **overrides):
    import transformers

    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=batch_size, max_steps=STEPS, learning_rate=LR,
        max_grad_norm=MAX_NORM, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**settings, **overrides})


def trainer_history(trainer) -> dict:
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": [e["loss"] for e in logged], "norms": [e["grad_norm"] for e in logged]}


def one_process_trainer(path: str, batch_size: int, output_dir: str, **overrides) -> dict:
    """transformers' Trainer in one process on the global batch: losses, norms, final weights. ``overrides``:
    TrainingArguments (``bf16=True``: autocast over float32 weights)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    data = trainer_dataset(model.config.vocab_size, batch_size * STEPS)
    args = trainer_arguments(output_dir, batch_size, **overrides)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return {**trainer_history(trainer), "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def trainer_cases(rank: int, world_size: int, path: str, cases: dict, global_batch: int, root: str) -> dict:
    """transformers' Trainer, unchanged, on a parallel model at each layout of ``cases``; the
    trained model saved with ``trainer.save_model()``. A layout of ``None`` loads on pipeline stages
    and records the Trainer's refusal."""
    import transformers

    import hf_parallel

    results = {}
    for name, sizes in cases.items():
        if name == "unplaced":  # a parameter added after loading: in no gradient sum, refused by name
            model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
            model.model.norm.extra_scale = torch.nn.Parameter(torch.ones(1))
            data = trainer_dataset(model.config.vocab_size, global_batch)
            trainer = transformers.Trainer(
                model=model, args=trainer_arguments(os.path.join(root, name), 1), train_dataset=data
            )
            try:
                trainer.train()
                results[name] = None
            except ValueError as error:
                results[name] = str(error)
            continue
        if name == "pp2":
            model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
            try:
                transformers.Trainer(model=model, args=trainer_arguments(os.path.join(root, name), 1))
                results[name] = None
            except ValueError as error:
                results[name] = str(error)
            continue
        sizes = dict(sizes)
        overrides = sizes.pop("trainer", {})  # TrainingArguments of the case (torch_compile=True)
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
        dp = hf_parallel.parallel_state(model).mesh.dp.size
        data = trainer_dataset(model.config.vocab_size, global_batch * STEPS)
        args = trainer_arguments(os.path.join(root, name), global_batch // dp, **overrides)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        trainer.train()
        trainer.save_model(os.path.join(root, name, "final"))
        results[name] = {**trainer_history(trainer), "wrapped": type(trainer.model_wrapped).__name__,
                         "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before}
    return results


def trainer_resume(rank: int, world_size: int, path: str, sizes: dict, global_batch: int, output_dir: str) -> dict:
    """An uninterrupted Trainer run checkpointing at step 3, then a fresh model and Trainer resumed
    from that checkpoint: the logged steps 4-5 of both, and what the checkpoint holds."""
    import transformers

    import hf_parallel

    runs = {}
    for run in ("uninterrupted", "resumed"):
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
        dp = hf_parallel.parallel_state(model).mesh.dp.size
        data = trainer_dataset(model.config.vocab_size, global_batch * STEPS)
        args = trainer_arguments(output_dir, global_batch // dp, save_strategy="steps", save_steps=3)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-3") if run == "resumed" else None)
        runs[run] = trainer_history(trainer)
    return {**runs, "files": sorted(os.listdir(os.path.join(output_dir, "checkpoint-3")))}


def trainer_resume_at(rank: int, world_size: int, path: str, sizes: dict, global_batch: int, output_dir: str) -> dict:
    """Resume ``output_dir/checkpoint-3`` (written at another layout) at ``sizes``: the error, or None."""
    import transformers

    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
    dp = hf_parallel.parallel_state(model).mesh.dp.size
    data = trainer_dataset(model.config.vocab_size, global_batch * STEPS)
    args = trainer_arguments(output_dir + "-elsewhere", global_batch // dp, save_strategy="steps", save_steps=3)
    try:
        transformers.Trainer(model=model, args=args, train_dataset=data).train(
            resume_from_checkpoint=os.path.join(output_dir, "checkpoint-3")
        )
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


RESUME_STEPS, SAVED_AT = 6, 3  # runs that resume take three steps after the checkpoint


def _resume_trainer(model, global_batch: int, output_dir: str):
    """A Trainer of RESUME_STEPS steps on the global batch, checkpointing every SAVED_AT steps."""
    import transformers

    from hf_parallel import parallel_state
    from hf_parallel.state import is_parallel

    dp = parallel_state(model).mesh.dp.size if is_parallel(model) else 1
    args = trainer_arguments(output_dir, global_batch // dp, save_strategy="steps", save_steps=SAVED_AT,
                             max_steps=RESUME_STEPS)  # fmt: skip
    data = trainer_dataset(model.config.vocab_size, global_batch * RESUME_STEPS)
    return transformers.Trainer(model=model, args=args, train_dataset=data)


def trainer_layouts(rank: int, world_size: int, path: str, runs: dict, global_batch: int, root: str) -> dict:
    """Each run ``name: (layout, resumed from, consolidated)``: a Trainer run (hf_parallel at the layout,
    or plain transformers for None) writing under ``root/name``, resumed from the SAVED_AT checkpoint
    of an earlier run (after ``hf-parallel consolidate`` when asked): its logged history, or its error;
    an unresumed run also lists its checkpoint's files."""
    import transformers

    import hf_parallel

    results = {}
    for name, (sizes, resumed_from, consolidated) in runs.items():
        if sizes is None:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:
            model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
        checkpoint = os.path.join(root, resumed_from, f"checkpoint-{SAVED_AT}") if resumed_from else None
        if consolidated:
            hf_parallel.consolidate(checkpoint, os.path.join(root, name, "consolidated"), progress=False)
            checkpoint = os.path.join(root, name, "consolidated")
        try:
            trainer = _resume_trainer(model, global_batch, os.path.join(root, name))
            trainer.train(resume_from_checkpoint=checkpoint)
        except ValueError as error:
            results[name] = {"error": str(error)}
            continue
        results[name] = trainer_history(trainer)
        results[name]["files"] = sorted(os.listdir(checkpoint or os.path.join(root, name, f"checkpoint-{SAVED_AT}")))
    return results


def train_step_layouts(rank: int, world_size: int, path: str, written_at: dict, resumed_at: dict, root: str) -> dict:
    """SAVED_AT ``train_step``s at ``written_at``, ``hf_parallel.save_training_state``; a new model
    and optimizer at ``resumed_at`` read it back (``load_training_state``) and take the other steps:
    every step's loss and gradient norm."""
    import hf_parallel

    losses, norms = [], []
    for sizes, steps in ((written_at, range(SAVED_AT)), (resumed_at, range(SAVED_AT, RESUME_STEPS))):
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        if steps.start:
            hf_parallel.load_training_state(model, optimizer, root)
        for step in steps:
            losses.append(hf_parallel.train_step(model, **training_batch(model.config.vocab_size, step)).item())
            norms.append(hf_parallel.clip_grad_norm_(model, MAX_NORM).item())
            optimizer.step()
            optimizer.zero_grad()
        if not steps.start:
            hf_parallel.save_training_state(model, optimizer, root)
    return {"losses": losses, "norms": norms}


def resume_layouts(rank: int, world_size: int, path: str, runs: dict, global_batch: int, root: str,
                   pipeline: tuple[dict, dict] | None = None) -> dict:  # fmt: skip
    """``trainer_layouts``, then (``pipeline``) ``train_step_layouts`` from one layout to another."""
    results = trainer_layouts(rank, world_size, path, runs, global_batch, root)
    if pipeline is not None:
        results["train_step"] = train_step_layouts(rank, world_size, path, *pipeline, os.path.join(root, "steps"))
    return results


MIXED_SGD_LR = 1.0  # one plain SGD step: the update is the gradient's own scale, large against float32's rounding


def one_process_mixed(path: str, mode: str) -> dict:
    """One process's bf16-compute step with float32 master weights: the gradient of the global batch computed in
    bf16 (``mode="fsdp"``: a bf16 copy of the model, as FSDP's mixed-precision policy gathers it; ``"autocast"``:
    under ``torch.autocast``), the update ``-lr x`` that gradient in float32, per parameter."""
    import copy

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    batch = training_batch(model.config.vocab_size, 0)
    if mode == "fsdp":
        computing = copy.deepcopy(model).to(torch.bfloat16)
        computing(**batch).loss.backward()
    else:
        computing = model
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
    return {name: -MIXED_SGD_LR * param.grad.float()
            for name, param in computing.named_parameters(remove_duplicate=False)}  # fmt: skip


def mixed_step(rank: int, world_size: int, cases: dict, save_root: str) -> dict:
    """For each case (checkpoint, layout): one plain SGD step of ``train_step`` on the global batch, loaded with
    mixed precision; each parameter's update on this rank against its piece of one process's
    (``one_process_mixed``), the parameters' dtypes after the step, and the saved checkpoint's dtypes."""
    from compare import piece_gap

    import hf_parallel

    results = {}
    for name, (path, sizes, mode) in cases.items():
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, **sizes)
        model.train()
        state = hf_parallel.parallel_state(model)
        before = {entry.name: model.get_parameter(entry.name).detach().clone() for entry in state.layout.unique_params()}
        hf_parallel.train_step(model, **training_batch(model.config.vocab_size, 0))
        torch.optim.SGD(model.parameters(), lr=MIXED_SGD_LR).step()
        want = one_process_mixed(path, mode)
        updates = {}
        for entry in state.layout.unique_params():
            moved = model.get_parameter(entry.name).detach() - before[entry.name]
            updates[entry.name] = piece_gap(moved, want[entry.name], entry.layout, state.mesh.tp.rank)
        dtypes = sorted({str(p.dtype) for p in model.parameters()})  # (FSDP's: sharded, before any forward)
        with torch.no_grad():  # the compute dtype: bf16 logits from float32 parameters
            computed = model(**training_batch(model.config.vocab_size, 1)).logits.dtype
        model.save_pretrained(os.path.join(save_root, name))  # after a forward: the masters, not the bf16 copies
        results[name] = {"updates": updates, "dtypes": dtypes, "computed": str(computed)}
    return results


def generated_under_fsdp(rank: int, world_size: int, path: str, sizes: dict, prompts: list, new_tokens: list,
                         short_rank: int | None) -> dict:  # fmt: skip
    """Each data-parallel rank generates its own prompt under FSDP, the ranks stepping together: its greedy tokens,
    the all-gathers FSDP ran meanwhile (``dist.all_gather_single``, counted on the way: the gathers still run), the
    forwards and the FSDP modules, and whether every parameter is sharded again after. ``short_rank``: that rank's
    free memory read as none, so it cannot keep the layers whole (and no rank may)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import hf_parallel
    import hf_parallel.distributed.fsdp as fsdp

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
    if rank == short_rank:
        fsdp.free_bytes = lambda device: 0
    mine = hf_parallel.parallel_state(model).mesh.dp.rank
    counted = {"gathers": 0, "forwards": 0}
    gather = dist.all_gather_single

    def counting(*args, **kwargs):
        counted["gathers"] += 1
        return gather(*args, **kwargs)

    model.register_forward_pre_hook(lambda *_: counted.__setitem__("forwards", counted["forwards"] + 1))
    dist.all_gather_single = counting
    try:
        out = model.generate(torch.tensor([prompts[mine]]), max_new_tokens=new_tokens[mine], do_sample=False,
                             eos_token_id=None)  # fmt: skip
    finally:
        dist.all_gather_single = gather
    modules = sum(isinstance(module, FSDPModule) for module in model.modules())
    sharded = all(isinstance(param, DTensor) for param in model.parameters())
    return {"prompt": mine, "tokens": out[0].tolist(), **counted, "fsdp_modules": modules, "sharded_after": sharded}
