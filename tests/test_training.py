"""Training at every layout against one process: data-parallel dimensions (FSDP2, HSDP) beside TP,
SP and PP, the global gradient norm, transformers' Trainer unchanged, and resuming.

Each layout runs 5 steps (AdamW, the last one plain SGD) clipped to a norm below the gradients' (so clipping acts every
step) on a global batch of 4 rows; one process runs the same steps on the same batches.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from checks import assert_steps_like_one_process
from compare import assert_close, assert_within
from conftest import once_per_world_size

LOSS_TOLERANCE = NORM_TOLERANCE = WEIGHT_TOLERANCE = 1e-5

LOOP_CASES = {  # world size -> case -> (checkpoint, layout, loop)
    2: {
        "fsdp2": ("llama", dict(fsdp_size=2, tp_plan=None), "train_step"),
        "fsdp2_plain_loop": ("llama", dict(fsdp_size=2, tp_plan=None), "plain"),
        "tp2_plain_loop": ("llama", dict(tp_size=2), "plain"),  # torch's clip_grad_norm_ on TP shards
        "fsdp2_tied": ("llama_tied_kvrep", dict(distributed_config=dict(fsdp_size=2), tp_plan=None), "train_step"),
        # ep_size: tokens travel to the experts' ranks, attention data-parallel; the experts FSDP-sharded over
        # the ranks holding the same ones (here none: a one-rank group, still divided by the data size)
        "fsdp2_ep2": ("qwen2_moe", dict(distributed_config=dict(fsdp_size=2, ep_size=2)), "train_step"),
        "replicate2_ep2_plain_loop": ("qwen2_moe", dict(dp_replicate_size=2, ep_size=2, tp_plan=None), "plain"),
    },
    4: {
        "fsdp2_tp2": ("llama", dict(fsdp_size=2, tp_size=2), "train_step"),
        "fsdp2_tp2_plain_loop": ("llama", dict(fsdp_size=2, tp_size=2), "plain"),
        "fsdp2_tp2_moe": ("qwen2_moe", dict(fsdp_size=2, tp_size=2), "train_step"),
        "fsdp2_tp2_ep4": ("qwen2_moe", dict(fsdp_size=2, tp_size=2, ep_size=4), "train_step"),  # TP inside EP
        # one expert per rank, held by two: FSDP shards each expert's rows (dim 1) between them
        "replicate2_fsdp2_ep2": ("qwen2_moe_2experts", dict(dp_replicate_size=2, fsdp_size=2, ep_size=2), "train_step"),
        "fsdp2_tp2_tied": ("llama_tied_kvrep", dict(fsdp_size=2, tp_size=2), "train_step"),
        "replicate2_tp2": ("llama", dict(dp_replicate_size=2, tp_size=2), "train_step"),
        "replicate2_fsdp2": ("llama", dict(dp_replicate_size=2, fsdp_size=2, tp_plan=None), "train_step"),
        "sp2_fsdp2": ("llama", dict(sp_size=2, fsdp_size=2, tp_plan=None), "train_step"),
        "sp2_fsdp2_moe": ("qwen2_moe", dict(sp_size=2, fsdp_size=2, tp_plan=None), "train_step"),
        # the EP group borrowed from the sequence ranks: each holds its part of the sequence and half the experts
        "sp2_fsdp2_ep2": ("qwen2_moe", dict(sp_size=2, fsdp_size=2, ep_size=2, tp_plan=None), "train_step"),
        "cp2_fsdp2": ("llama", dict(cp_size=2, fsdp_size=2, tp_plan=None), "train_step"),  # the ring in FSDP's fold
        "pp2_fsdp2": ("llama", dict(pp_size=2, fsdp_size=2, tp_plan=None), "train_step"),
        "pp2_fsdp2_tied": ("llama_tied_kvrep", dict(pp_size=2, fsdp_size=2, tp_plan=None), "train_step"),
        # clipping counts KV copies once; the sums in buckets of ~1 KB: many launched while backward goes on
        "tp4_kv_replicated": ("llama_tied_kvrep", dict(tp_size=4, gradient_bucket_mb=0.001), "train_step"),
    },
}


ARCHS = ("llama", "llama_tied_kvrep", "qwen2_moe", "qwen2_moe_2experts")


@pytest.fixture(scope="module")
def paths(tiny_root):
    from tiny_models import make_checkpoint

    return {name: make_checkpoint(name, tiny_root) for name in ARCHS}


@pytest.fixture(scope="module")
def references(paths):
    import training_workers

    return {name: training_workers.one_process(path) for name, path in paths.items()}


def layout(sizes: dict) -> dict:
    """from_pretrained's keywords, a ``distributed_config`` given as its fields made transformers' own."""
    if "distributed_config" not in sizes:
        return sizes
    from transformers.distributed import DistributedConfig

    return {**sizes, "distributed_config": DistributedConfig(**sizes["distributed_config"])}


@pytest.fixture(scope="module")
def loop_runs(paths, tmp_path_factory):
    import training_workers
    from distributed import run_ranks

    def run(world_size):
        root = str(tmp_path_factory.mktemp(f"train{world_size}"))
        cases = {
            name: (paths[arch], layout(sizes), loop) for name, (arch, sizes, loop) in LOOP_CASES[world_size].items()
        }
        results = run_ranks(world_size, training_workers.train, cases, root, out_dir=os.path.join(root, "results"))
        return results, root

    return once_per_world_size(run)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,case", [(w, c) for w, cases in LOOP_CASES.items() for c in cases])
def test_steps_match_one_process(loop_runs, references, world_size, case):
    """Every gradient slice each rank holds after the first backward, the losses, clipped global gradient
    norms and the gathered final weights of 5 steps equal one process's on the same global batches."""
    results, root = loop_runs(world_size)
    want = references[LOOP_CASES[world_size][case][0]]
    assert_steps_like_one_process(results, case, want, os.path.join(root, case), LOSS_TOLERANCE)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,case", [(w, c) for w, cases in LOOP_CASES.items() for c in cases if "fsdp" in c])
def test_an_fsdp_load_holds_only_each_ranks_share(loop_runs, world_size, case):
    """Under FSDP the model is sharded while empty and each rank reads only its rows: at every ``fully_shard`` call
    a rank holds no parameter bytes, after the load exactly its share as the layout predicts
    (``memory.footprint``), and the shards of each FSDP group add up to the TP shard they split, each element once.
    Under ``ep_size`` the experts' bytes of each rank are the whole experts' over the EP size and the ranks holding
    the same ones (``ep_replicas``): 1 / ep of them at rest (the TP-group EP holds 1 / tp of them on every rank)."""
    results, _ = loop_runs(world_size)
    held = [result[case]["held"] for result in results]
    for rank, mine in enumerate(held):
        assert mine["at_sharding"] and set(mine["at_sharding"]) == {0}, (rank, mine["at_sharding"])
        assert mine["after_load"] == mine["share"] == 4 * mine["local_params"], (rank, mine)
        if mine["experts_whole"]:
            assert mine["experts"] * mine["expert_holders"] == mine["experts_whole"], (rank, mine)
    if held[0]["experts_whole"]:  # the rest: each FSDP group's shards are the dense parameters' once
        return
    for group in {tuple(mine["fsdp_group"]) for mine in held}:
        assert sum(held[r]["after_load"] for r in group) == held[group[0]]["whole"], (group, held)


MIXED_CASES = {  # case -> (checkpoint, layout, how one process computes the reference step)
    "fsdp2_tp2": ("llama", dict(fsdp_size=2, tp_size=2, mixed_precision="bf16"), "fsdp"),  # FSDP's policy, fp32 TP sums
    "fsdp4_config": ("llama_tied_kvrep", dict(distributed_config=dict(fsdp_size=4, fsdp_mixed_precision=True),
                                              tp_plan=None), "fsdp"),  # fmt: skip
    "tp4_autocast": ("llama_tied_kvrep", dict(tp_size=4, mixed_precision="bf16"), "autocast"),  # replicated KV heads
    "pp2_tp2_autocast": ("llama", dict(pp_size=2, tp_size=2, mixed_precision="bf16"), "autocast"),  # the schedule's
}
MIXED_TOLERANCE = 3e-2  # of the largest element of each update: bf16 roundings (2^-8 each) through two layers (1.6e-2
# seen at most on this host)


@pytest.mark.distributed
def test_mixed_precision_steps_like_one_process_in_bf16_with_fp32_masters(paths, tmp_path):
    """One plain SGD step (its update the gradient's own scale) with ``mixed_precision="bf16"``, FSDP's policy or
    autocast: every update on every rank within bf16's tolerance of one process's bf16-compute step with float32
    masters, the parameters float32 after it, and the saved checkpoint float32 (the masters)."""
    import training_workers
    from checks import read_checkpoint
    from distributed import run_ranks

    cases = {name: (paths[arch], layout(sizes), mode) for name, (arch, sizes, mode) in MIXED_CASES.items()}
    results = run_ranks(4, training_workers.mixed_step, cases, str(tmp_path), out_dir=str(tmp_path / "results"))
    for rank, result in enumerate(results):
        for name in MIXED_CASES:
            got = result[name]
            assert_within(got["updates"], atol=0, rtol=MIXED_TOLERANCE, where=f"{name} rank {rank}: updates")
            assert got["dtypes"] == ["torch.float32"] and got["computed"] == "torch.bfloat16", (name, rank, got)
    for name in MIXED_CASES:
        assert {t.dtype for t in read_checkpoint(str(tmp_path / name)).values()} == {torch.float32}, name


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(mixed_precision="fp16"), "bf16 only"),
        (dict(mixed_precision="bf16", dtype="bfloat16"), "float32 master weights"),
        (dict(mixed_precision="bf16", fsdp_cpu_offload=True), "without fsdp_size"),
    ],
)
def test_mixed_precision_that_cannot_hold_is_refused(paths, sizes, message):
    import hf_parallel

    with pytest.raises(ValueError, match=message):
        hf_parallel.AutoModelForCausalLM.from_pretrained(paths["llama"], **sizes)


@pytest.mark.distributed
def test_a_batch_the_replicas_cannot_share_is_refused(loop_runs):
    results, _ = loop_runs(2)
    for rank, result in enumerate(results):
        error = result["fsdp2"]["uneven"]
        assert error is not None and "3 rows" in error and "2 data-parallel replicas" in error, (rank, error)


@pytest.mark.distributed
def test_torch_clipping_a_part_of_a_split_model_is_refused(loop_runs):
    """torch.nn.utils.clip_grad_norm_ over two of a split model's gradients: refused by name on every rank (the
    whole model's, in the plain loops, is the global norm: ``test_steps_match_one_process``)."""
    for world_size in LOOP_CASES:
        results, _ = loop_runs(world_size)
        for case, (_, _, loop) in LOOP_CASES[world_size].items():
            if loop == "plain":
                for rank, result in enumerate(results):
                    error = result[case]["part_refused"]
                    assert error is not None and "was given 2 of the" in error, (world_size, case, rank, error)
                    assert "hf_parallel.clip_grad_norm_(model, max_norm)" in error, error


TRAINER_CASES = {  # world size -> case -> layout (transformers' Trainer, unchanged)
    2: {
        "tp2": dict(tp_size=2),
        "fsdp2": dict(fsdp_size=2, tp_plan=None),
        "tp2_compiled": dict(tp_size=2, trainer=dict(torch_compile=True)),
        "fsdp2_compiled": dict(fsdp_size=2, tp_plan=None, trainer=dict(torch_compile=True)),
        "pp2": dict(pp_size=2, tp_plan=None),
        "cp2": dict(cp_size=2, tp_plan=None),
        "unplaced": dict(tp_size=2),
    },
    4: {
        "fsdp2_tp2": dict(fsdp_size=2, tp_size=2),
        "replicate2_tp2": dict(dp_replicate_size=2, tp_size=2),
        "sp2_fsdp2": dict(sp_size=2, fsdp_size=2, tp_plan=None),
        "sp2_tp2": dict(sp_size=2, tp_size=2),
        "fsdp2_tp2_bf16": dict(fsdp_size=2, tp_size=2, mixed_precision="bf16", trainer=dict(bf16=True)),
    },
}
BF16_TOLERANCE = 2e-2  # bf16 compute against one process's autocast: losses and norms, relative
GLOBAL_BATCH = 4


@pytest.fixture(scope="module")
def trainer_reference(paths, tmp_path_factory):
    import training_workers

    return training_workers.one_process_trainer(paths["llama"], GLOBAL_BATCH, str(tmp_path_factory.mktemp("trainer1")))


@pytest.fixture(scope="module")
def trainer_runs(paths, tmp_path_factory):
    import training_workers
    from distributed import run_ranks

    def run(world_size):
        root = str(tmp_path_factory.mktemp(f"trainer{world_size}"))
        results = run_ranks(
            world_size, training_workers.trainer_cases, paths["llama"], TRAINER_CASES[world_size], GLOBAL_BATCH, root,
            out_dir=os.path.join(root, "results"),
        )  # fmt: skip
        return results, root

    return once_per_world_size(run)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size,case",
    [(w, c) for w, cases in TRAINER_CASES.items() for c in cases if c not in ("pp2", "unplaced") and "bf16" not in c],
)
def test_trainer_matches_one_process(trainer_runs, trainer_reference, world_size, case):
    """Trainer(model=parallel model) logs one process's losses and grad norms (same global batch),
    wraps nothing around the model, and its save_model writes a checkpoint plain transformers
    loads with one process's trained weights and logits."""
    import torch
    import training_workers
    import transformers
    from tp_workers import INPUT_IDS

    results, root = trainer_runs(world_size)
    want = trainer_reference
    for rank, result in enumerate(results):
        got = result[case]
        assert not got["wrapped"].startswith("DistributedDataParallel"), got["wrapped"]
        compiled = case.endswith("_compiled")  # torch_compile=True: the model wrapped, and graphs compiled
        assert (got["wrapped"] == "OptimizedModule") == compiled and (got["compiled_graphs"] > 0) == compiled, got
        assert_log_like(got, want, f"{case} rank {rank}")
    saved = os.path.join(root, case, "final")
    assert_within(training_workers.saved_against(want["weights"], saved), atol=WEIGHT_TOLERANCE,
                  rtol=WEIGHT_TOLERANCE, where=saved)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    single = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    single.load_state_dict(want["weights"])
    with torch.no_grad():
        assert_close(model(INPUT_IDS).logits, single(INPUT_IDS).logits, atol=1e-4, rtol=1e-4, what=f"{case} logits")


@pytest.mark.distributed
def test_trainer_bf16_trains_float32_masters_like_one_processes_bf16(trainer_runs, paths, tmp_path):
    """``Trainer(bf16=True)`` on a model loaded with ``mixed_precision="bf16"`` (FSDP x TP: FSDP's bf16 policy)
    logs one process's ``Trainer(bf16=True)`` losses and gradient norms within bf16's tolerance, and saves
    float32 masters."""
    import training_workers
    from checks import read_checkpoint

    want = training_workers.one_process_trainer(paths["llama"], GLOBAL_BATCH, str(tmp_path), bf16=True)
    results, root = trainer_runs(4)
    for rank, result in enumerate(results):
        got = result["fsdp2_tp2_bf16"]
        for what in ("losses", "norms"):
            assert_close(got[what], want[what], atol=0, rtol=BF16_TOLERANCE, what=f"bf16 rank {rank}: {what}")
    saved = read_checkpoint(os.path.join(root, "fsdp2_tp2_bf16", "final"))
    assert {t.dtype for t in saved.values()} == {torch.float32}


@pytest.mark.distributed
def test_trainer_refuses_pipeline_stages(trainer_runs):
    results, _ = trainer_runs(2)
    for rank, result in enumerate(results):
        error = result["pp2"]
        assert error is not None and "pipeline stages" in error and "hf_parallel.train_step" in error, (rank, error)


@pytest.mark.distributed
def test_trainer_refuses_a_trainable_parameter_hf_parallel_did_not_place(trainer_runs):
    results, _ = trainer_runs(2)
    for rank, result in enumerate(results):
        error = result["unplaced"]
        assert error is not None and error.startswith("model.norm.extra_scale: trainable parameter(s) added after"), (
            rank, error,
        )  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,sizes", [(4, dict(fsdp_size=2, tp_size=2))])
def test_trainer_resumes_where_it_stopped(paths, tmp_path, world_size, sizes):
    """save_strategy="steps" + train(resume_from_checkpoint=...) continues with the losses and
    norms of an uninterrupted run; each rank's checkpoint holds only its own state."""
    import training_workers
    from distributed import run_ranks

    results = run_ranks(
        world_size, training_workers.trainer_resume, paths["llama"], sizes, GLOBAL_BATCH, str(tmp_path / "run"),
        out_dir=str(tmp_path / "results"),
    )  # fmt: skip
    for result in results:
        assert result["resumed"] == result["uninterrupted"], result
    files = results[0]["files"]
    for rank in range(world_size):
        assert f"training-state-rank-{rank:05d}-of-{world_size:05d}.safetensors" in files, files
    assert "model.safetensors" in files and "optimizer.pt" not in files, files


RESUMES = {  # world size -> run -> (layout, or None: plain transformers; resumed from; consolidated first)
    1: {"plain": (None, None, False)},
    2: {
        "tp2": (dict(tp_size=2), None, False),
        "fsdp2_from_tp2": (dict(fsdp_size=2, tp_plan=None), "tp2", False),
        "sp2": (dict(sp_size=2, tp_plan=None), None, False),
        "tp2_from_sp2": (dict(tp_size=2), "sp2", False),
        "cp2_from_tp2": (dict(cp_size=2, tp_plan=None), "tp2", False),
        "tp2_from_plain": (dict(tp_size=2), "plain", False),  # transformers' optimizer.pt
    },
    "1 after 2": {
        "one_rank_from_tp2": ({}, "tp2", False),
        "plain_from_tp2": (None, "tp2", True),  # plain transformers, after hf-parallel consolidate
    },
    4: {
        "fsdp2_tp2": (dict(fsdp_size=2, tp_size=2), None, False),
        "tp4_from_fsdp2_tp2": (dict(tp_size=4), "fsdp2_tp2", False),
    },
}
PIPELINE_RESUME = (dict(pp_size=2, tp_plan=None), dict(tp_size=2))  # train_step: written at, resumed at


@pytest.fixture(scope="module")
def resumed(paths, tmp_path_factory):
    """Every run of RESUMES, in order (a run resumes an earlier one's checkpoint), rank 0's results."""
    import training_workers
    from distributed import run_ranks

    root, results = str(tmp_path_factory.mktemp("resume")), {}
    for world, runs in RESUMES.items():
        world_size = world if isinstance(world, int) else 1
        pipeline = PIPELINE_RESUME if world == 2 else None
        ranks = run_ranks(world_size, training_workers.resume_layouts, paths["llama"], runs, GLOBAL_BATCH, root,
                          pipeline, out_dir=os.path.join(root, f"results-{world}"))  # fmt: skip
        for rank in ranks[1:]:
            assert {k: v for k, v in rank.items() if k != "files"} == {k: v for k, v in ranks[0].items()
                                                                       if k != "files"}  # fmt: skip
        results.update(ranks[0])
    return results


def assert_log_like(got: dict, want: dict, what: str) -> None:
    """A run's logged losses and gradient norms, one process's."""
    assert_close(got["losses"], want["losses"], atol=LOSS_TOLERANCE, rtol=LOSS_TOLERANCE, what=f"{what}: losses")
    assert_close(got["norms"], want["norms"], atol=NORM_TOLERANCE, rtol=NORM_TOLERANCE, what=f"{what}: norms")


@pytest.mark.distributed
@pytest.mark.parametrize("run", [run for runs in RESUMES.values() for run in runs if run != "plain"])
def test_a_trainer_checkpoint_resumes_at_another_layout(resumed, run):
    """A Trainer checkpoint written at one layout (hf_parallel's per-rank pieces, or transformers'
    optimizer.pt) resumes at another, or in plain transformers after ``hf-parallel consolidate``, with
    its optimizer, scheduler and data position: the three steps after it log what one process's
    uninterrupted run logs (a fresh optimizer's Adam steps would not; the first three are the
    checkpoint's log)."""
    import training_workers

    want, got = resumed["plain"], resumed[run]
    assert "error" not in got, got
    assert len(want["losses"]) == training_workers.RESUME_STEPS  # a resumed log starts with the checkpoint's
    assert_log_like(got, want, run)


@pytest.mark.distributed
def test_what_a_parallel_trainer_checkpoint_holds(resumed):
    """Each rank's pieces in one safetensors file (no pickle, no gather); ``consolidate`` replaces them
    with transformers' optimizer.pt."""
    for world_size, run in ((2, "tp2"), (4, "fsdp2_tp2")):
        files = resumed[run]["files"]
        assert [f for f in files if f.startswith("training-state")] == [
            f"training-state-rank-{rank:05d}-of-{world_size:05d}.safetensors" for rank in range(world_size)
        ], files
        assert "model.safetensors" in files and not [f for f in files if f.endswith(".pt") and "optimizer" in f]
    consolidated = resumed["plain_from_tp2"]["files"]
    assert "optimizer.pt" in consolidated and "model.safetensors" in consolidated, consolidated
    assert not [f for f in consolidated if f.startswith("training-state")], consolidated


@pytest.mark.distributed
def test_train_step_state_resumes_from_pipeline_stages_at_tp(resumed, paths):
    """``save_training_state`` on pipeline stages, ``load_training_state`` at TP=2: the six steps are
    one process's."""
    import training_workers

    want = training_workers.one_process(paths["llama"], steps=training_workers.RESUME_STEPS, sgd_at=None)
    assert_log_like(resumed["train_step"], want, "train_step resumed")


@pytest.mark.distributed
def test_the_trainer_trains_an_ep_size_moe_like_one_process(paths, tmp_path):
    """transformers' Trainer, unchanged, on Qwen2-MoE loaded with ``DistributedConfig(fsdp_size=2, ep_size=2)``
    (tokens exchanged between the two data-parallel ranks): one process's losses and clipped gradient norms, and
    its trained weights saved."""
    import training_workers
    from distributed import run_ranks

    case = {"fsdp2_ep2": layout(dict(distributed_config=dict(fsdp_size=2, ep_size=2)))}
    ranks = run_ranks(2, training_workers.trainer_cases, paths["qwen2_moe"], case, GLOBAL_BATCH, str(tmp_path),
                      out_dir=str(tmp_path / "results"))  # fmt: skip
    want = training_workers.one_process_trainer(paths["qwen2_moe"], GLOBAL_BATCH, str(tmp_path / "one"))
    for rank, result in enumerate(ranks):
        assert_log_like(result["fsdp2_ep2"], want, f"Trainer at ep_size=2, rank {rank}")
    saved = str(tmp_path / "fsdp2_ep2" / "final")
    assert_within(training_workers.saved_against(want["weights"], saved), atol=WEIGHT_TOLERANCE,
                  rtol=WEIGHT_TOLERANCE, where=saved)  # fmt: skip


@pytest.mark.distributed
def test_train_step_state_resumes_at_another_ep_size(paths, tmp_path):
    """``save_training_state`` at ``tp=2 x fsdp=2, ep_size=4`` (one expert per rank), ``load_training_state`` at
    ``fsdp=2 x dp_replicate=2, ep_size=2`` (two per rank, FSDP over their copies): the six steps are one
    process's (Adam's moments of every expert found in the other layout's pieces)."""
    import training_workers
    from distributed import run_ranks

    written, resumed = dict(fsdp_size=2, tp_size=2, ep_size=4), dict(dp_replicate_size=2, fsdp_size=2, ep_size=2)
    ranks = run_ranks(4, training_workers.train_step_layouts, paths["qwen2_moe"], written, resumed, str(tmp_path),
                      out_dir=str(tmp_path / "results"))  # fmt: skip
    want = training_workers.one_process(paths["qwen2_moe"], steps=training_workers.RESUME_STEPS, sgd_at=None)
    for rank, got in enumerate(ranks):
        assert_log_like(got, want, f"ep_size 4 -> 2, rank {rank}")


@pytest.mark.parametrize(
    "given, sizes",
    [
        (dict(tp_size=2, fsdp_size=2), dict(tp_size=2, fsdp_size=2, dp_replicate_size=1, pp_size=1)),
        (dict(tp_size=2, fsdp_size=2, ep_size=4), dict(tp_size=2, fsdp_size=2, ep_size=4)),  # tokens exchanged
        (dict(fsdp_size=2), dict(tp_size=1, fsdp_size=2, dp_replicate_size=1, pp_size=1)),
        (dict(tp_size=2, dp_replicate_size=2), dict(tp_size=2, fsdp_size=1, dp_replicate_size=2, pp_size=1)),
    ],
)
def test_transformers_distributed_config_gives_the_mesh_sizes(given, sizes):
    from transformers.distributed import DistributedConfig

    from hf_parallel.training.trainer import from_distributed_config

    got, tp_plan, ep_plan, policies = from_distributed_config(DistributedConfig(**given), {}, "auto", None)
    assert {k: got[k] for k in sizes} == sizes and tp_plan == "auto" and ep_plan is None
    assert policies == dict(mixed_precision=None, fsdp_cpu_offload=False)
    *_, policies = from_distributed_config(DistributedConfig(**given, fsdp_mixed_precision=True), {}, "auto", None)
    assert policies == dict(mixed_precision="bf16", fsdp_cpu_offload=False)  # transformers' policy: bf16, fp32 sums


@pytest.mark.parametrize(
    "given, sizes, message",
    [
        (dict(tp_size=2, enable_sequence_parallel=True), {}, "use sp_size=N"),
        (dict(fsdp_size=2), dict(tp_size=2), r"distributed_config=..., tp_size=...\): give the sizes once"),
        (dict(tp_size=2, fsdp_size=2, ep_size=4, ep_implementation="all_reduce"), {}, "ep_size must equal tp_size"),
        (dict(tp_size=2, ep_size=2, ep_implementation="deepgemm_megamoe"), {}, "hf_parallel implements 'auto'"),
    ],
)
def test_what_hf_parallel_cannot_honour_in_a_distributed_config_is_refused(given, sizes, message):
    from transformers.distributed import DistributedConfig

    from hf_parallel.training.trainer import from_distributed_config

    with pytest.raises(ValueError, match=message):
        from_distributed_config(DistributedConfig(**given), sizes, "auto", None)


def test_the_plan_dry_run_shows_the_data_dimensions_and_groups_that_span_nodes(paths):
    from hf_parallel.commands.report import plan_report

    text = plan_report(paths["llama"], 4, fsdp_size=2, dp_replicate_size=2, nproc_per_node=2).splitlines()
    assert text[0].startswith("mesh: tp=4 x fsdp=2 x dp_replicate=2 = 16 ranks; one model replica = 4 ranks, 4 data")
    assert text[1].startswith("warning: tp group [0, 1, 2, 3] spans nodes [0, 1] (2 ranks per node)")
    assert any(line.startswith("at rest under FSDP2 (each TP shard split over fsdp x cp x sp = 2 ranks)") for line in text)
    fits = plan_report(paths["llama"], 2, sp=2, fsdp_size=2, nproc_per_node=4).splitlines()
    assert fits[1] == "every tp and sp group stays inside a node of 4 ranks"


@pytest.mark.distributed
@pytest.mark.slow
def test_the_trainer_example_resumes_at_another_layout_as_one_process_trains(tiny_smollm2, tmp_path):
    """examples/train_with_trainer.py as its docstring runs it: 4 steps at TP=4 saving every 2, then resumed from
    checkpoint-2 at TP=2 x FSDP=2 (another layout reading every rank's optimizer state), with a tokenizer that has
    no pad token: every rank logs the losses the same script logs in one process, uninterrupted (the same global
    batch of 8 rows)."""
    import re

    from test_examples import run_example, without_pad_token

    model = without_pad_token(tiny_smollm2, tmp_path)  # as Llama 3's tokenizer: padded with EOS, out of the loss
    runs = {}
    checkpoint = tmp_path / "tp4" / "checkpoint-2"
    for name, ranks, sizes in (
        ("one", 1, dict(FSDP="1")),
        ("tp4", 4, dict(FSDP="1", TP="4", SAVE_EVERY="2")),
        ("resumed", 4, dict(FSDP="2", TP="2", RESUME=str(checkpoint))),
    ):
        if name == "resumed":  # the checkpoint's logged losses marked: a run that starts over would log its own
            state = json.loads((checkpoint / "trainer_state.json").read_text())
            for entry in (entry for entry in state["log_history"] if "loss" in entry):
                entry["loss"] = 99.0
            (checkpoint / "trainer_state.json").write_text(json.dumps(state))
        stdout = run_example("train_with_trainer.py", ranks, MODEL=model, STEPS="4", OUT=str(tmp_path / name), **sizes)
        runs[name] = [[float(x) for x in found.split(",")]
                      for found in re.findall(r"rank \d: [^:]*: losses \[([-\d., ]+)\]", stdout)]  # fmt: skip
        assert os.path.isfile(tmp_path / name / "final" / "model.safetensors")
    (one,) = runs["one"]
    assert len(one) == 4 and len(runs["tp4"]) == len(runs["resumed"]) == 4, runs
    for losses in runs["tp4"]:
        assert_close(losses, one, atol=2e-4, rtol=0, what="the example's losses at TP=4")
    for losses in runs["resumed"]:  # steps 1-2 read from the checkpoint, 3-4 trained at TP=2 x FSDP=2
        assert losses[:2] == [99.0, 99.0], runs["resumed"]
        assert_close(losses[2:], one[2:], atol=2e-4, rtol=0, what="the resumed steps' losses")


def test_a_model_without_repeated_layers_is_refused_for_fsdp():
    from torch import nn

    from hf_parallel import Mesh
    from hf_parallel.distributed.fsdp import layers_to_shard

    with pytest.raises(ValueError, match="fsdp_size=2, dp_replicate_size=1: Linear has no list of repeated layers"):
        layers_to_shard(nn.Linear(2, 2), Mesh.dry_run(fsdp_size=2))


@pytest.mark.distributed
@pytest.mark.parametrize("short_rank", [None, 1], ids=["kept_whole", "one_rank_short_of_memory"])
def test_generate_under_fsdp_gathers_each_layer_once_per_call(paths, tmp_path, short_rank):
    """``generate`` at FSDP=2, each rank its own prompt (7 and 3 new tokens: the ranks step together): each FSDP
    module is gathered once for the whole call, not again at every token (FSDP's own hooks would), and every
    parameter is sharded again after; where one rank lacks the memory to keep the layers whole, neither rank keeps
    them (both gather per token, in step). The tokens are one process's either way."""
    import training_workers
    import transformers
    from distributed import run_ranks

    path = paths["llama"]
    prompts, new_tokens = [[5, 9, 14, 3, 7, 21], [11, 4, 8]], [7, 3]
    sizes = dict(fsdp_size=2, tp_plan=None)
    ranks = run_ranks(2, training_workers.generated_under_fsdp, path, sizes, prompts, new_tokens, short_rank,
                      out_dir=str(tmp_path))  # fmt: skip
    single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for got in ranks:
        ids = torch.tensor([prompts[got["prompt"]]])
        want = single.generate(ids, max_new_tokens=new_tokens[got["prompt"]], do_sample=False, eos_token_id=None)
        assert got["tokens"] == want[0].tolist(), got
        assert got["forwards"] == max(new_tokens) and got["sharded_after"], got  # (the shorter one keeps stepping)
        if short_rank is None:
            assert got["gathers"] == got["fsdp_modules"] == 5, got  # 2 layers, embedding, head, the root
        else:
            assert got["gathers"] > got["forwards"], got  # a module gathered again at each token
    assert sorted(got["prompt"] for got in ranks) == [0, 1]


def test_the_plan_prints_the_memory_formula_for_a_rank(paths):
    """``hf-parallel plan`` at fsdp_size=2 prints the tiny Llama's memory per rank (float32) as counted by hand:
    rank 0 holds the first half of every tensor's rows (the odd ones' larger half), the load reads the largest
    tensor whole, and a step adds the gradients, AdamW's two states, one decoder layer gathered (parameters and
    gradients) and the activations of 1 x 2048 tokens (34 bytes per token and hidden unit per layer in 16-bit,
    doubled for float32; the logits in float32 and twice more for the loss; sdpa keeps no scores)."""
    from hf_parallel.commands.report import plan_report

    line = plan_report(paths["llama"], 1, fsdp_size=2).splitlines()[-1]
    hidden, kv, inner, vocab, layers, tokens = 72, 3 * 8, 100, 101, 2, 2048
    layer = 2 * hidden * hidden + 2 * kv * hidden + 3 * inner * hidden + 2 * hidden  # q o, k v, gate up down, norms
    rank0_layer = 36 * 72 + 12 * 72 + 12 * 72 + 36 * 72 + 50 * 72 + 50 * 72 + 36 * 100 + 36 + 36
    share = 4 * (layers * rank0_layer + 51 * 72 + 36 + 51 * 72)  # + embedding, final norm, LM head rows
    largest = 4 * vocab * hidden
    gathered = 2 * 4 * layer
    activations = layers * tokens * hidden * 34 * 2 + tokens * vocab * (4 + 2 * 4)

    def mib(n: int) -> str:
        return f"{n / 2**20:,.2f}"

    assert line == (
        f"memory per rank (formula): weights {mib(share)} MiB, load peak {mib(share + largest)} MiB (share + largest "
        f"TP slice {mib(largest)} MiB), training step ~ {mib(4 * share + gathered + activations)} MiB (params "
        f"{mib(share)} + grads {mib(share)} + AdamW {mib(2 * share)} + one gathered unit {mib(gathered)} "
        f"(model.layers.0) + activations {mib(activations)} at batch 1 x seq 2048; hf_parallel/memory.py)"
    ), line


def test_the_plan_counts_what_checkpointing_tiling_offload_and_lora_keep_less_of(paths):
    """``plan --checkpointing --tiled-loss 512 --tiled-mlp 256 [--offload-checkpoints] --lora r=4,...`` on the tiny
    Llama (float32, one rank, 1 x 2048 tokens), counted by hand: one layer's activations at once (the one the
    backward recomputes: 10 + 24 bytes per token and hidden unit in 16-bit, of which the MLP's 16 for one tile of
    256 tokens), each layer's input kept (none with the offload), one chunk of 512 tokens' logits and the final
    hidden states they are scored from; only LoRA's adapters (float32) have gradients and AdamW's states."""
    from hf_parallel.commands.report import parse_lora, plan_report
    from hf_parallel.memory import Savings

    hidden, vocab, layers, tokens, kv = 72, 101, 2, 2048, 3 * 8
    one_layer = tokens * hidden * (10 + 8 + 16 * 256 / tokens) * 4 / 2
    logits = 512 * vocab * (4 + 2 * 4) + tokens * hidden * 4
    adapters = layers * 4 * (4 * hidden + hidden * 4 + 4 * hidden + kv * 4)  # q's A and B, v's A and B
    lora = parse_lora("r=4,target=q_proj,v_proj")

    def mib(n: float) -> str:
        return f"{n / 2**20:,.2f}"

    for offload in (False, True):
        savings = Savings(checkpointing=True, offload=offload, loss_chunk=512, mlp_tile=256)
        line = plan_report(paths["llama"], 1, lora=lora, savings=savings).splitlines()[-1]
        inputs = 0 if offload else layers * tokens * hidden * 4
        assert f"activations {mib(int(one_layer) + logits + inputs)} at batch 1 x seq 2048 (checkpointing" in line, line
        assert f"grads {mib(adapters)} + AdamW {mib(2 * adapters)} " in line, line
        assert ("layer inputs offloaded" in line) == offload and "only the adapters have gradients" in line, line
