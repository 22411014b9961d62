"""TRL's SFTTrainer, unchanged (its defaults: fused LM head, gradient checkpointing), on parallel layouts:
every step's loss, grad norm and TRL's own metrics equal to one process's SFTTrainer, full and LoRA; the
layouts its fused head cannot be right on refused by name."""

import os

import pytest
from compare import assert_close

# CI installs TRL ('.[trl]'): without it these tests fail, never skip; imported by the workers, not here, so
# collecting the tests loads no TRL (nor transformers)
TOLERANCE = 1e-5  # absolute, and relative to the largest value, fp32


@pytest.fixture(scope="module")
def one_process(tiny_paths, tmp_path_factory):
    import trl_workers

    done = {}

    def get(name):
        if name not in done:
            done[name] = trl_workers.one_process(tiny_paths[name], str(tmp_path_factory.mktemp("sft_one")))
        return done[name]

    return get


def _run(world_size, sizes, path, tmp_path):
    import trl_workers
    from distributed import run_ranks

    run = str(tmp_path / "run")
    return run_ranks(world_size, trl_workers.parallel, path, run, sizes, out_dir=str(tmp_path / "out"))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, sizes, model",
    [
        (2, dict(tp_size=2), "llama"),  # 9/3 heads
        (4, dict(fsdp_size=2, tp_size=2), "llama"),  # untied LM head: an FSDP group of its own, vocab split
        (2, dict(sp_size=2, tp_plan=None), "llama"),
        (4, dict(sp_size=2, tp_size=2), "llama"),
        (2, dict(fsdp_size=2, tp_plan=None), "llama_tied_kvrep"),  # tied: in the root's FSDP group; 8/2 heads
    ],
    ids=["tp2", "fsdp2_tp2_untied", "sp2", "tp2_sp2", "fsdp2_tied"],
)
def test_sft_trainer_matches_one_process(one_process, tiny_paths, tmp_path, world_size, sizes, model):
    """The fused LM head reads this rank's rows of the vocabulary: hf_parallel scores it vocab-parallel,
    so the loss is over the whole vocabulary (not ln(V/tp)), and num_tokens counts a replica's batch once.
    TRL's fused forward calls the backbone itself: at SP hf_parallel runs it over the sequence split, each
    rank scoring its tokens, and gathers the per-token scores whole."""
    import trl_workers

    results = _run(world_size, sizes, tiny_paths[model], tmp_path)
    for rank, result in enumerate(results):
        # TRL's kernel call goes through ours
        assert result["kernel"] == "install_fused_head.<locals>.Kernel", result["kernel"]
        if sizes.get("tp_size", 1) > 1:
            unseen = result["unseen"]
            assert "would score this rank's rows of a vocabulary hf_parallel split" in unseen, unseen
        for mode in trl_workers.MODES:
            got, want = result[mode], one_process(model)[mode]
            assert isinstance(got, dict), (rank, mode, got)
            for key in want:
                assert_close(got[key], want[key], atol=TOLERANCE, rtol=TOLERANCE, what=f"rank {rank} {mode} {key}")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "model, sizes, names",
    [
        ("llama", dict(pp_size=2, tp_plan=None), ["pipeline stages", "train_step"]),  # the Trainer's refusal
        ("qwen2_moe", dict(sp_size=2, tp_plan=None, output_router_logits=True),
         ["TRL's fused LM head (tp=1 x sp=2)", "load-balancing loss", "this rank's tokens only"]),
    ],
    ids=["pp2", "sp2_router_loss"],
)
def test_sft_trainer_is_refused_by_name_where_its_fused_head_cannot_be_right(tiny_root, tmp_path, model, sizes, names):
    """TRL's fused forward runs the backbone in one call (pipeline stages need a schedule); at SP a MoE's
    router loss would see this rank's tokens only: refused when the SFTTrainer is built, before any step."""
    import trl_workers
    from tiny_models import make_checkpoint

    results = _run(2, sizes, make_checkpoint(model, tiny_root), tmp_path)
    for result in results:
        for mode in trl_workers.MODES:
            error = result[mode]
            assert isinstance(error, str), error
            for name in names:
                assert name in error, error
        assert not os.path.isdir(str(tmp_path / "run" / "full" / "checkpoint-1"))


@pytest.mark.distributed
@pytest.mark.parametrize("sizes", [dict(tp_size=2), dict(sp_size=2, tp_plan=None)], ids=["tp2", "sp2"])
def test_different_batches_on_the_ranks_of_one_replica_are_refused(tiny_paths, tmp_path, sizes):
    """GRPO and RLOO seed every rank apart, so each samples its own completions: on a replica that spans
    ranks the collectives would mix them into a gradient of no loss. TRL's fused call compares the batches
    over the replica first and refuses by name; the same batch on every rank goes through."""
    import trl_workers
    from distributed import run_ranks

    results = run_ranks(2, trl_workers.different_batches, tiny_paths["llama"], sizes, out_dir=str(tmp_path / "out"))
    for result in results:
        assert result["error"] is not None and "were given different batches" in result["error"], result
        assert "GRPO, RLOO" in result["error"] and result["same"] > 0, result


@pytest.mark.distributed
def test_dpo_trainer_with_lora_matches_one_process(tiny_paths, tmp_path):
    """TRL's DPOTrainer with LoRA at TP=2 (its reference model: the base with the adapter disabled; its
    log-probabilities from the same fused head): loss, grad norm, rewards and log-probabilities of one process."""
    import trl_workers
    from distributed import run_ranks

    want = trl_workers.dpo_one_process(tiny_paths["llama"], str(tmp_path / "one"))
    results = run_ranks(2, trl_workers.dpo_parallel, tiny_paths["llama"], str(tmp_path / "run"), dict(tp_size=2),
                        out_dir=str(tmp_path / "out"))  # fmt: skip
    for rank, got in enumerate(results):
        for key in want:
            assert_close(got[key], want[key], atol=TOLERANCE, rtol=TOLERANCE, what=f"rank {rank} {key}")
