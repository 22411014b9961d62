"""The gradient sums a split computation needs, bucketed while backward goes on (``distributed/buckets.py``,
``tensor/gradients.py``): against every rank's gradients summed, in the cases where a bucket could go wrong."""

import pytest
from compare import assert_within
from distributed import run_ranks

pytestmark = pytest.mark.distributed


def test_bucketed_sums_equal_every_ranks_gradients_summed(tmp_path):
    """64-byte buckets: a plain backward, three micro-batches summed once, an optimizer-style hook seeing the sum,
    a clean backward after one that raised (gradients zeroed to None and in place), reentrant checkpointing, and
    ``torch.autograd.grad`` (no accumulation: summed in the hook)."""
    import gradient_workers

    for rank, out in enumerate(run_ranks(2, gradient_workers.bucketed_gradient_sums, out_dir=str(tmp_path))):
        assert max(out.values()) < 1e-5, (rank, out)
        assert len(out) == 7, out


def test_ranks_whose_buckets_pair_different_gradients_are_refused_by_name(tmp_path):
    import gradient_workers

    for rank, out in enumerate(run_ranks(2, gradient_workers.crosswise_buckets, out_dir=str(tmp_path))):
        assert out["error"] and "bucketed different gradients" in out["error"], (rank, out)


def test_fsdp_micro_batches_reduce_per_micro_batch_or_once(tiny_root, tmp_path):
    """FSDP reduce-scatters every micro-batch by default (the memory of a shard); ``reduce_once=True`` once, in the
    last (``keep_gathered``: the parameters whole between them): the same gradients, one process's."""
    import gradient_workers
    from tiny_models import make_checkpoint

    path = make_checkpoint("llama", tiny_root)
    for rank, out in enumerate(run_ranks(2, gradient_workers.fsdp_step_variants, path, out_dir=str(tmp_path))):
        for name, records in out.items():
            assert_within(records, atol=1e-5, rtol=1e-5, where=f"{name} rank {rank}")
