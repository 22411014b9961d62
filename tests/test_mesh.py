"""The mesh: every dimension's groups from the sizes asked for, checked as data and on real gloo ranks."""

import comm_workers
import pytest
from distributed import run_ranks
from hypothesis import given
from hypothesis import strategies as st

from hf_parallel import Mesh
from hf_parallel.distributed.mesh import MeshShape

shapes = st.builds(
    MeshShape,
    st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 2),
)


@given(shapes)
def test_every_rank_sits_once_in_each_dimension_at_its_position(shape):
    world = range(shape.world_size)
    for dim in ("world", "tp", "sp"):
        members = sorted(r for ranks in shape.groups(dim) for r in ranks)
        assert members == list(world), dim  # a partition of the world
    for ranks in shape.groups("tp"):  # a TP group: adjacent ranks of one stage and one SP index
        assert list(ranks) == list(range(ranks[0], ranks[0] + len(ranks)))
        assert len({shape.position(r)[:2] for r in ranks}) == 1
    for ranks in shape.groups("sp"):  # an SP group: one stage and TP index, every SP index once
        assert [shape.position(r)[1] for r in ranks] == list(range(shape.sp))
        assert len({(shape.position(r)[0], shape.position(r)[2]) for r in ranks}) == 1
    for ranks in shape.groups("pp"):  # a PP group: one rank per stage, at the same (sp, tp) position
        assert [shape.position(r)[0] for r in ranks] == list(range(len(shape.stage_tp_sizes)))
        assert len({shape.position(r)[1:] for r in ranks}) == 1
    for ranks in shape.groups("model"):  # one replica: contiguous, every (stage, sp, tp) place once
        assert list(ranks) == list(range(ranks[0], ranks[0] + shape.replica_size))
        assert len({shape.replica(r) for r in ranks}) == 1
    for dim in ("model", "dp", "dp_shard", "dp_replicate", "fsdp"):
        members = sorted(r for ranks in shape.groups(dim) for r in ranks)
        assert members == list(world), dim
    for ranks in shape.groups("dp"):  # the same place of every replica
        assert len({shape.position(r) for r in ranks}) == 1 and len(ranks) == shape.dp
    for ranks in shape.groups("fsdp"):  # FSDP shards over dp_shard x sp: one stage and TP index, one HSDP copy
        assert len(ranks) == shape.dp_shard * shape.sp
        assert (
            len({(shape.position(r)[0], shape.position(r)[2], shape.replica(r) // shape.dp_shard) for r in ranks}) == 1
        )
    for ranks in shape.groups("dp_replicate"):
        assert len(ranks) == shape.dp_replicate and len({shape.position(r) for r in ranks}) == 1
    for rank in world:
        assert shape.global_rank(*shape.position(rank), shape.replica(rank)) == rank
        assert rank in shape.stage_ranks(shape.position(rank)[0], shape.replica(rank))


@pytest.mark.parametrize(
    "world, sizes, message",
    [
        (4, dict(tp_size=0), "tp_size=0: every mesh dimension needs a whole number of ranks"),
        (4, dict(tp_size=3), r"tp_size=3 was asked for, but the process group has world size 4 \(the mesh needs"),
        (6, dict(sp_size=4), "world size 6 is not a multiple of pp_size x sp_size = 1 x 4"),
        (3, dict(stage_tp_sizes=[2, 2]), r"sp_size x sum\(stage_tp_sizes\) = 1 x 4 = 4 ranks"),
        (3, dict(stage_tp_sizes=[2, 1], pp_size=3), "leave tp_size unset and pp_size at 2"),
        (3, dict(stage_tp_sizes=[2, 0]), "one TP size of at least 1 per pipeline stage"),
        (6, dict(tp_size=2, fsdp_size=2), r"dp_replicate_size x fsdp_size x pp_size x sp_size x tp_size = 1 x 2 x "),
        (
            8,
            dict(fsdp_size=3),
            "world size 8 is not a multiple of dp_replicate_size x fsdp_size x pp_size x sp_size = 1 x 3 x 1 x 1",
        ),
        (4, dict(fsdp_size=0), "fsdp_size=0: every mesh dimension needs a whole number of ranks"),
        (4, dict(tp_size=2, fsdp_size=2, ep_size=3), r"ep_size must be tp_size \(2\) times a divisor of the ranks "),
        (8, dict(tp_size=2, fsdp_size=2, dp_replicate_size=2, ep_size=16), r"\(dp_replicate x fsdp x cp x sp = 4\)"),
        (4, dict(pp_size=2, fsdp_size=2, ep_size=2), r"ep_size=2 with pp_size / stage_tp_sizes"),
        (2, dict(sp_size=2, ep_size=2), r"ep_size=2 with sp_size / cp_size and no fsdp_size / dp_replicate_size"),
    ],
)
def test_bad_shapes_are_clear_errors(world, sizes, message):
    with pytest.raises(ValueError, match=message):
        MeshShape.of(world, **sizes)


def test_data_parallel_dimensions_are_outermost_and_print():
    shape = MeshShape.of(16, tp_size=2, sp_size=2, fsdp_size=2, dp_replicate_size=2)
    assert str(shape) == "tp=2 x sp=2 x fsdp=2 x dp_replicate=2"
    assert shape.groups("tp")[0] == (0, 1) and shape.groups("model")[1] == (4, 5, 6, 7)
    assert shape.groups("fsdp")[0] == (0, 2, 4, 6)  # SP folded into FSDP's shard group
    assert shape.groups("dp_replicate")[0] == (0, 8)


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 2), st.data())
def test_the_ep_group_borrows_data_ranks_and_its_replicas_hold_the_same_experts(tp, fsdp, replicate, sp, data):
    """``ep_size``: TP ranks times ranks borrowed from the sequence ranks first, then FSDP's, then the replicas;
    every EP group a partition of the world, each EP index's ranks (``ep_replicas``) the same in every group."""
    places = fsdp * replicate * sp
    if sp > 1 and fsdp * replicate == 1:  # (refused: the sequence ranks' sums are FSDP's)
        return
    width = data.draw(st.sampled_from([d for d in range(1, places + 1) if places % d == 0]))
    shape = MeshShape.of(tp * places, tp_size=tp, fsdp_size=fsdp, dp_replicate_size=replicate, sp_size=sp,
                         ep_size=tp * width)  # fmt: skip
    if shape.ep == 1:  # no expert parallelism: the EP group is the (one-rank) TP group
        assert shape.groups("ep") == shape.groups("tp")
        return
    for dim in ("ep", "ep_replicas"):
        assert sorted(r for ranks in shape.groups(dim) for r in ranks) == list(range(shape.world_size)), dim
    for ranks in shape.groups("ep"):  # tp-adjacent ranks of ``width`` consecutive data places
        assert len(ranks) == tp * width and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks)))
    index = {r: i for ranks in shape.groups("ep") for i, r in enumerate(ranks)}
    for ranks in shape.groups("ep_replicas"):
        assert len(ranks) == shape.world_size // (tp * width) and len({index[r] for r in ranks}) == 1
    if width == 1 and tp > 1:  # ep_size == tp_size: the TP groups
        assert shape.groups("ep") == shape.groups("tp")


def test_a_dry_run_mesh_has_sizes_and_no_groups():
    mesh = Mesh.dry_run(tp_size=2, sp_size=2, pp_size=2)
    assert str(mesh) == "rank 0: pp 0/2, tp 0/2, sp 0/2"
    assert mesh.tp.group is None and mesh.world_size == 8
    assert mesh.subgroup("tp", lambda size: [[0, 1]]) is None


def _check_groups(ranks, world_size):
    for rank, out in enumerate(ranks):
        assert out["same_mesh"]
        for dim in ("world", "pp", "tp", "sp", "ep"):
            d = out[dim]
            assert rank in d["ranks"] and d["ranks"][d["rank"]] == rank
            assert d["sum"] == sum(d["ranks"]), f"rank {rank}: the {dim} all-reduce summed other ranks"
        assert out["ep"]["ranks"] == out["tp"]["ranks"]  # experts spread over the TP group
        assert out["tp"]["shm"] == (len(out["tp"]["ranks"]) > 1)  # each activation group has its channel


@pytest.mark.distributed
def test_tp_inside_sp_on_four_ranks(tmp_path):
    ranks = run_ranks(4, comm_workers.mesh_groups, dict(tp_size=2, sp_size=2), out_dir=str(tmp_path))
    _check_groups(ranks, 4)
    assert [out["tp"]["ranks"] for out in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [out["sp"]["ranks"] for out in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert ranks[3]["printed"] == "rank 3: pp 0/1, tp 1/2, sp 1/2"
    assert [out["subgroup_sum"] for out in ranks] == [1.0, 1.0, 5.0, 5.0]
    assert all(out["subgroup_again"] for out in ranks)


@pytest.mark.distributed
def test_a_tp_size_per_pipeline_stage(tmp_path):
    """VTP: stage 0 on ranks 0-1 at TP=2, stage 1 on rank 2 at TP=1; the stages' first ranks pipe."""
    ranks = run_ranks(3, comm_workers.mesh_groups, dict(stage_tp_sizes=[2, 1]), out_dir=str(tmp_path))
    _check_groups(ranks, 3)
    assert [out["stage"] for out in ranks] == [0, 0, 1]
    assert [out["tp"]["ranks"] for out in ranks] == [[0, 1], [0, 1], [2]]
    assert [out["pp"]["ranks"] for out in ranks] == [[0, 2], [1], [0, 2]]
    assert ranks[1]["printed"] == "rank 1: pp 0/2, tp 1/2, sp 0/1"  # stage 0 of 2, in no pipeline group
    assert ranks[2]["printed"] == "rank 2: pp 1/2, tp 0/1, sp 0/1"
    assert [out["subgroup_sum"] for out in ranks] == [1.0, 1.0, None]
