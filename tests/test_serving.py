"""Serving a split model: what transformers' continuous batching does on it."""

import pytest
from distributed import run_ranks

pytestmark = pytest.mark.distributed


def test_continuous_batching_is_refused_by_name_on_a_split_model(tiny_root, tmp_path):
    """At TP=2 transformers' paged cache is sized for every KV head and a rank holds fewer: generate_batch
    returned empty outputs. Each entry point is refused by name on every rank instead."""
    import serving_workers
    from tiny_models import make_checkpoint

    path = make_checkpoint("llama", tiny_root)
    for rank, out in enumerate(run_ranks(2, serving_workers.continuous_batching, path, out_dir=str(tmp_path))):
        for entry, error in out.items():
            assert "continuous batching" in error and "split over 2 ranks" in error, (rank, entry, error)
