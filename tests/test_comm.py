"""Collectives: the shared-memory transport agrees with gloo, falls back to it, names a peer that exited and
times out clearly."""

import os

import comm_workers
import pytest
import tp_workers
from checks import assert_like_one_process
from distributed import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_memory_collectives_match_gloo(world_size, tmp_path):
    ranks = run_ranks(world_size, comm_workers.shm_collectives, out_dir=str(tmp_path))
    for out in ranks:
        assert out["shm"], "CPU ranks on one host should use the shared-memory transport"
        assert out["reduce_torch.float32"] < 1e-6
        assert out["reduce_torch.bfloat16"] < 0.05  # gloo sums in bf16; shm accumulates in fp32
        assert out["gather"] == [sum(([float(r)] * (r + 1) for r in range(world_size)), [])] * 2
        assert out["big_sum"] == [float(sum(range(1, world_size + 1)))] * 3
        assert not out["big_used_shm"]
        assert out["broadcast"] == ["torch.bfloat16", [[world_size - 1.0 + i for i in (0, 1, 2)],
                                                       [world_size - 1.0 + i for i in (3, 4, 5)]]]  # fmt: skip
        assert out["big_broadcast"] is None  # every rank learns together that gloo carries it
        for key in ("reduce_torch.float32_values", "reduce_torch.bfloat16_values"):
            assert out[key] == ranks[0][key], "every rank must hold bitwise the same sum"


def test_a_missing_rank_times_out_with_a_clear_error(tmp_path):
    rank0, _ = run_ranks(2, comm_workers.shm_rank_goes_missing, 2.0, out_dir=str(tmp_path))
    assert rank0["error"] is not None and "rank(s) [1]" in rank0["error"] and "HF_PARALLEL_TIMEOUT" in rank0["error"]
    assert rank0["seconds"] < 10


def test_gloo_transport_gives_the_same_model_results(tiny_paths, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PARALLEL_SHM", "0")  # inherited by the spawned ranks
    cases = {"llama": (tiny_paths["llama"], "auto")}
    for rank, out in enumerate(run_ranks(2, tp_workers.compare_tp, cases, None, out_dir=str(tmp_path))):
        assert out["llama"]["shm"] is False, "HF_PARALLEL_SHM=0: gloo, not shared memory, must carry TP's sums"
        assert_like_one_process(out["llama"], rank, 1e-5, "over gloo")
        assert out["llama"]["counts"] == {"all_reduce": 2 * out["llama"]["layers"] + 1, "all_gather": 1}


@pytest.mark.parametrize(
    "phase, how, env, names",
    [
        ("load", "hangs", {}, "comparing checkpoint headers across ranks"),
        ("save", "dies", {}, "receiving model.embed_tokens.weight from rank 1 on rank 0"),
        ("forward", "hangs", {"HF_PARALLEL_SHM": "0"}, "all-reduce of (2, 7, "),
    ],
)
def test_a_rank_that_dies_or_hangs_fails_the_others_clearly_and_in_bounded_time(
    tiny_paths, tmp_path, monkeypatch, phase, how, env, names
):
    """Over gloo (loading, saving, and the forward without shared memory) as over shared memory:
    the surviving rank gets a RankFailure naming what it was doing, within HF_PARALLEL_TIMEOUT."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    timeout = 3.0
    rank0, _ = run_ranks(
        2,
        comm_workers.peer_fails_during,
        phase,
        how,
        tiny_paths["llama"],
        str(tmp_path),
        timeout,
        out_dir=str(tmp_path),
    )
    assert rank0["type"] == "RankFailure" and rank0["is_timeout"], rank0
    assert names in rank0["message"] and "HF_PARALLEL_TIMEOUT=3s" in rank0["message"], rank0["message"]
    assert rank0["seconds"] < timeout + 5
    saved = tmp_path / "saved"  # a failed save writes nothing final, and leaves nothing behind
    assert not saved.exists() or os.listdir(saved) == [], os.listdir(saved)


@pytest.mark.parametrize("phase", ["generate", "step"])
def test_a_peer_that_exits_mid_generate_or_step_is_named_within_seconds(tiny_paths, tmp_path, phase):
    """Shared memory's sums spin on a flag a dead peer never sets: the wait looks at its peers' processes and
    names the one that exited within seconds, not at HF_PARALLEL_TIMEOUT (300 s here)."""
    rank0, _ = run_ranks(2, comm_workers.peer_dies_mid, phase, tiny_paths["llama"], str(tmp_path),
                         out_dir=str(tmp_path))  # fmt: skip
    assert rank0["shm"] and rank0["type"] == "RankFailure", rank0
    assert "rank(s) [1] exited (process " in rank0["message"] and "did not reach collective" in rank0["message"], rank0
    assert rank0["seconds"] < 15, rank0  # two tokens or a forward before the exit, then half a second


@pytest.mark.parametrize(
    "world_size, transport", [(2, "shm"), (3, "windows"), (4, "shm"), (2, "gloo"), (3, "gloo"), (2, "windows")]
)
def test_sequence_parallel_collectives_on_uneven_shapes(world_size, transport, tmp_path):
    """Over shared memory (pieces straight from their views, or in windows when a piece is larger
    than a slot's part) and over gloo: the same exact data movement."""
    for out in run_ranks(world_size, comm_workers.sequence_comm_properties, transport, out_dir=str(tmp_path)):
        assert (out["shm_steps"] > 0) == (transport != "gloo"), out["shm_steps"]
        assert out["all_to_all"] == 0.0 and out["all_to_all_backward"] == 0.0  # pure data movement: exact
        assert out["scatter_backward"] == 0.0  # dX = grad_scale x the gathered dY
        assert out["broadcast"] is True
        assert "pass labels= to the model" in out["gather_backward_refused"]


def test_every_collective_receives_on_the_groups_device(tmp_path, monkeypatch):
    """Each collective helper (TP's all-reduce and all-gather, SP's all-to-all and batch broadcast,
    PP's sends, receives and broadcast, the save's gather, tied gradients) with torch's default
    device set to ``meta``: every tensor handed to torch.distributed is on the groups' device (the
    CPU under gloo), none on the default device, and every helper still computes the right values."""
    monkeypatch.setenv("HF_PARALLEL_SHM", "0")  # through torch.distributed, where the recorder sees it
    monkeypatch.setenv("HF_PARALLEL_P2P_RULES", "")  # on this thread too (the strict transport's are its own)
    for rank, out in enumerate(run_ranks(2, comm_workers.collective_buffers, out_dir=str(tmp_path))):
        for helper, got in out.items():
            assert got["ops"] > 0 and got["devices"] == ["cpu"], (rank, helper, got)
            assert got["right"], (rank, helper, got)


def test_shared_memory_pipes_carry_messages_whole_and_in_order(tmp_path):
    for out in run_ranks(2, comm_workers.pipe_messages, out_dir=str(tmp_path)):
        assert out["pipes"] == [[0, 1], [1, 0]], out["pipes"]
        assert out["equal"] and out["count"] == out["of"], out


def test_the_collectives_copy_only_what_the_exchange_needs(tmp_path, monkeypatch):
    """Over gloo (NCCL's path): a row-parallel layer's sum is written into its output; a sum the caller
    keeps reading costs one copy; a gather along dim 0 lands in its result, along another dim in one
    copy; Ulysses' exchange makes one transposing copy, plus one to put the split dim first where it
    does not lead (a batch of several). Each with its values and the bytes it moved."""
    monkeypatch.setenv("HF_PARALLEL_SHM", "0")
    for rank, out in enumerate(run_ranks(2, comm_workers.collective_copies, out_dir=str(tmp_path))):
        for name, got in out.items():
            assert got["right"], (rank, name, got)
        assert out["reduce_from"]["copied"] == 0 and out["reduce_from"]["in_place"], out["reduce_from"]
        assert out["reduce_from"]["moved"] == {"all_reduce:bytes": 4 * 16 * 4}
        assert out["all_reduce"]["copied"] == out["all_reduce"]["out"]
        assert out["gather_dim0"]["copied"] == 0 and out["gather_dim0"]["moved"] == {"all_gather:bytes": 2 * 3 * 4}
        assert out["gather_dim-1"]["copied"] == out["gather_dim-1"]["out"]
        one, two = out["all_to_all_batch1"], out["all_to_all_batch2"]
        assert one["copied"] == one["out"] and one["moved"] == {"all_to_all:bytes": one["in"]}, one
        assert two["copied"] == two["in"] + two["out"], two


