"""Assertions shared by tests."""

import os

import torch
from safetensors import safe_open


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    from hf_parallel.checkpoint.loading import checkpoint_files

    out = {}
    for key, file in checkpoint_files(path).items():
        with safe_open(file, framework="pt") as f:
            out[key] = f.get_tensor(key)
    return out


def assert_like_one_process(result: dict, rank: int, tol: float = 1e-5) -> None:
    """One rank's ``tp_workers.compare_tp`` result: logits and every gradient's slice within ``tol``."""
    assert result["logits"] < tol, f"rank {rank}: logits differ by {result['logits']}"
    assert not result["missing_grads"], f"rank {rank}: no gradient for {result['missing_grads']}"
    assert result["grads"] < tol, f"rank {rank}: gradients differ by {result['grads']}"


def assert_steps_like_one_process(ranks: list[dict], case: str, want: dict, saved: str, tol: float = 1e-5) -> None:
    """``training_workers.train``'s ``case`` on every rank against ``training_workers.one_process``: the losses,
    clipped global gradient norms (clipping acting on every step) and the saved final weights within ``tol``."""
    import training_workers

    for rank, results in enumerate(ranks):
        got = results[case]
        assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) < tol, (rank, got, want)
        assert max(abs(a - b) for a, b in zip(got["norms"], want["norms"])) < tol, (rank, got, want)
    assert min(want["norms"]) > training_workers.MAX_NORM  # clipping acted on every step
    assert training_workers.saved_against(want["weights"], saved) < tol


def assert_same_checkpoint(source: str, saved: str) -> None:
    """Key for key, dtype for dtype, bit for bit."""
    want, got = read_checkpoint(source), read_checkpoint(saved)
    assert sorted(got) == sorted(want), f"keys differ: missing {set(want) - set(got)}, extra {set(got) - set(want)}"
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), f"{key} differs after save"
    assert os.path.isfile(os.path.join(saved, "config.json"))
    leftovers = [n for n in os.listdir(saved) if n.endswith(".tmp")]
    assert not leftovers, leftovers
