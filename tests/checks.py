"""Assertions shared by tests."""

import os

import torch
from compare import assert_close, assert_within
from safetensors import safe_open


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    from hf_parallel.checkpoint.loading import checkpoint_files

    out = {}
    for key, file in checkpoint_files(path).items():
        with safe_open(file, framework="pt") as f:
            out[key] = f.get_tensor(key)
    return out


def assert_like_one_process(result: dict, rank: int, tol: float = 1e-5, where: str = "") -> None:
    """One rank's ``tp_workers.compare_tp`` result: logits and every parameter's gradient slice within ``tol``
    (absolute, and of that tensor's scale); a NaN, or a gradient one side lacks, fails."""
    where = f"{where} rank {rank}".strip()
    assert_within({"logits": result["logits"]}, atol=tol, rtol=tol, where=where)
    assert_within(result["grads"], atol=tol, rtol=tol, where=f"{where} gradients")


def assert_steps_like_one_process(ranks: list[dict], case: str, want: dict, saved: str, tol: float = 1e-5) -> None:
    """``training_workers.train``'s ``case`` on every rank against ``training_workers.one_process``: every
    gradient this rank holds after the first backward (before clipping and any step), the losses, clipped global
    gradient norms (clipping acting on every step) and the saved final weights within ``tol``."""
    import training_workers

    for rank, results in enumerate(ranks):
        got = results[case]
        assert_within(got["first_grads"], atol=tol, rtol=tol, where=f"{case} rank {rank}: first gradients")
        assert_close(got["losses"], want["losses"], atol=tol, rtol=tol, what=f"{case} rank {rank}: losses")
        assert_close(got["norms"], want["norms"], atol=tol, rtol=tol, what=f"{case} rank {rank}: norms")
    assert min(want["norms"]) > training_workers.MAX_NORM  # clipping acted on every step
    assert_within(training_workers.saved_against(want["weights"], saved), atol=tol, rtol=tol, where=f"{case} saved")


def assert_same_checkpoint(source: str, saved: str, held: torch.dtype | None = None) -> None:
    """Key for key, dtype for dtype, bit for bit. ``held``: the dtype the saved model was loaded in, below the
    source's float32: its plain weights and biases are saved as held (transformers' own save writes what the model
    holds), so those are the source's rounded to it; every quantized part (codes, scales, zero points) bitwise."""
    want, got = read_checkpoint(source), read_checkpoint(saved)
    assert sorted(got) == sorted(want), f"keys differ: missing {set(want) - set(got)}, extra {set(got) - set(want)}"
    for key in want:
        if held is not None and want[key].dtype == torch.float32 and key.endswith((".weight", ".bias")):
            want[key] = want[key].to(held)
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), f"{key} differs after save"
    assert os.path.isfile(os.path.join(saved, "config.json"))
    leftovers = [n for n in os.listdir(saved) if n.endswith(".tmp")]
    assert not leftovers, leftovers
