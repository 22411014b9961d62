"""torch.compile on parallel models: one graph, no breaks, every collective an op in it, the same
numbers as one process (and as eager); a static-cache generate with a compiled forward gives eager's tokens with no host
synchronisation in the traced decode step."""

import os

import pytest
from compare import assert_within
from conftest import once_per_world_size
from distributed import run_ranks
from tiny_models import make_checkpoint

TOL = 1e-5
CASES = {  # world size -> name -> (kind, checkpoint, layout, options)
    2: {
        "tp2": ("forward", "llama", dict(tp_size=2), dict(inductor=True)),  # 9 / 3 heads: 6 + 3 per rank
        "tp2_ep": ("forward", "qwen3_moe", dict(tp_size=2, ep_plan="auto"), dict(inductor=False)),
        "sp2": ("forward", "llama", dict(sp_size=2, tp_plan=None), dict(inductor=False, per_rank=True)),
        "cp2": ("forward", "llama", dict(cp_size=2, tp_plan=None), dict(inductor=False)),  # the ring's exchanges
        # a described mask (padding, a sliding window), checked on the device
        "cp2_padded": ("forward", "mistral", dict(cp_size=2, tp_plan=None), dict(inductor=False, padded=True)),
        "cp2_train": ("train", "llama", dict(cp_size=2, tp_plan=None), {}),  # and its backward's
        "sp2_shapes_differ": ("mismatch", "llama", dict(sp_size=2, tp_plan=None), {}),
        "tp2_lora": ("lora", "llama", dict(tp_size=2), {}),
        "tp2_static_generate": ("generate", "llama", dict(tp_size=2), {}),
        # a pipeline stage's receive and send wait on another process: traced around, not through
        "pp2": ("forward", "pp_llama", dict(pp_size=2, tp_plan=None), dict(inductor=False, fullgraph=False)),
    },
    4: {"tp2_sp2": ("forward", "llama", dict(tp_size=2, sp_size=2), dict(inductor=False))},
}


@pytest.fixture(scope="module")
def compiled(tiny_root, tmp_path_factory):
    def run(world_size):
        cases = {
            name: (kind, make_checkpoint(model, tiny_root), sizes, options)
            for name, (kind, model, sizes, options) in CASES[world_size].items()
        }
        root = str(tmp_path_factory.mktemp(f"compile{world_size}"))
        import compile_workers

        return run_ranks(world_size, compile_workers.compiled_cases, cases, out_dir=os.path.join(root, "results"))

    return once_per_world_size(run)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size,case", [(w, c) for w, cases in CASES.items() for c, (kind, *_) in cases.items() if kind == "forward"]
)
def test_a_compiled_forward_is_one_graph_with_one_process_logits(compiled, world_size, case):
    for rank, results in enumerate(compiled(world_size)):
        got = results[case]
        assert_within({k: got[k] for k in ("logits", "eager_logits")}, atol=TOL, rtol=TOL, where=f"{case} rank {rank}")
        # the same collectives moving the same bytes (the compiled batch broadcast's header check aside)
        sums = ("all_reduce", "all_reduce:bytes", "all_to_all", "all_to_all:bytes", "ring_shift", "ring_shift:bytes")
        assert {k: got["compiled_moved"].get(k) for k in sums} == {k: got["eager_moved"].get(k) for k in sums}, got
        moved = sum(got["eager_moved"].get(k, 0) for k in ("all_reduce", "all_to_all", "ring_shift"))
        assert moved > 0 or case == "pp2"
        if case == "pp2":  # pieces between the stage's links, no other break
            assert got["graphs"] > 1 and all("disable" in reason for reason in got["breaks"]), got
            continue
        assert got["explain_graphs"] == 1 and got["breaks"] == [], (rank, case, got["breaks"])
        assert got["graphs"] == 1 and got["collectives"] > 0, (rank, case, got)
        assert got["host_syncs"] == [], (rank, case, got["host_syncs"])  # a TP or SP step never waits on the host


@pytest.mark.distributed
def test_a_sequence_parallel_group_computes_its_first_ranks_batch_compiled(compiled):
    """Each rank passes other ids: compiled, as eager, every rank gets the first rank's logits; a rank
    passing another shape makes every rank raise, naming both shapes."""
    ranks = compiled(2)
    assert ranks[0]["sp2"]["last_logits"] == ranks[1]["sp2"]["last_logits"]
    for rank, results in enumerate(ranks):
        error = results["sp2_shapes_differ"]["error"]
        assert error is not None and "(1, 8)" in error and "rank 1's" in error and "(1, 9)" in error, (rank, error)


@pytest.mark.distributed
def test_a_context_parallel_training_step_compiles_whole_with_one_process_gradients(compiled):
    """CP=2 forward and backward with labels, ``fullgraph=True``: one graph, no break, the ring's exchanges ops in
    it; loss and every gradient one process's, and eager's."""
    for rank, results in enumerate(compiled(2)):
        got = results["cp2_train"]
        assert got["explain_graphs"] == 1 and got["breaks"] == [], (rank, got["breaks"])
        assert got["graphs"] == 1 and got["collectives"] > 0 and got["host_syncs"] == [], (rank, got)
        assert_within({"loss": got["loss"], "eager_loss": got["eager_loss"]}, atol=TOL, rtol=TOL, where=f"rank {rank}")
        assert_within(got["grads"], atol=TOL, rtol=TOL, where=f"rank {rank} gradients")
        assert_within(got["eager_grads"], atol=TOL, rtol=TOL, where=f"rank {rank} gradients against eager")


@pytest.mark.distributed
def test_lora_at_tp_compiles_whole_with_one_process_gradients(compiled):
    for rank, results in enumerate(compiled(2)):
        got = results["tp2_lora"]
        assert got["explain_graphs"] == 1 and got["breaks"] == [], (rank, got["breaks"])
        assert got["adapters"] == 16, (rank, got["adapters"])
        where = f"tp2_lora rank {rank}"
        assert_within({k: got[k] for k in ("loss", "eager_loss")}, atol=1e-6, rtol=0, where=where)
        assert_within(got["grads"], atol=TOL, rtol=TOL, where=f"{where}: adapter gradients against one process")
        assert_within(got["eager_grads"], atol=TOL, rtol=TOL, where=f"{where}: adapter gradients against eager")


@pytest.mark.distributed
def test_static_cache_generate_with_a_compiled_forward_gives_eager_tokens_without_host_syncs(compiled):
    for rank, results in enumerate(compiled(2)):
        got = results["tp2_static_generate"]
        assert got["tokens"] == got["eager_tokens"], (rank, got)
        assert got["collectives"] > 0, got  # the collectives are in the decode graph, as ops
        assert got["host_syncs"] == [], (rank, got["host_syncs"])


def test_the_host_sync_check_sees_an_item_in_a_graph():
    """The check above can fail: a traced ``.item()`` (scalar outputs captured) is reported."""
    import compile_workers
    import torch

    graphs = []

    def step(x):
        return x * x.sum().item()

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(step, fullgraph=True, backend=compile_workers.recording(graphs, inductor=False))(torch.ones(3))
    torch._dynamo.reset()
    assert compile_workers.graph_facts(graphs)["host_syncs"] == ["call_method item"]


def test_a_group_no_mesh_created_is_named_in_the_error():
    from hf_parallel.distributed import ops

    ops.register(-100)  # what new_group hands a rank outside the group: nothing to register
    with pytest.raises(RuntimeError, match="'7'.*no hf_parallel mesh created"):
        ops.group_named("7")
