"""Devices and wires: where a rank computes, what its groups carry, NCCL's point-to-point rules on CPUs.

The choice of device and backend is tested case by case without the hardware (``devices.py`` is pure
functions of what a process sees). The strict transport (``HF_PARALLEL_P2P_RULES=nccl``, which
``conftest.py`` sets for the whole suite) is shown to refuse what NCCL would hang on, and to let through
what NCCL runs. The GPU itself is ``test_cuda.py``'s."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from hf_parallel.distributed.devices import (
    DeviceBackend,
    backend_for,
    choose_device,
    default_backend,
    group_backend,
    wire_of,
)
from hf_parallel.on_device import check_on_device, left_behind, move_module_state
from hf_parallel.pipeline.schedule import order, paired

CUDA0, CUDA3 = torch.device("cuda", 0), torch.device("cuda", 3)


def test_the_device_is_chosen_from_what_the_process_sees():
    choose = choose_device
    assert choose(requested=None, accelerator=None, device_count=0, local_rank=5) == torch.device("cpu")
    assert choose(requested=None, accelerator="cuda", device_count=8, local_rank=3) == CUDA3
    # one visible device per process (CUDA_VISIBLE_DEVICES set by a scheduler): index 0, not LOCAL_RANK
    assert choose(requested=None, accelerator="cuda", device_count=1, local_rank=5) == CUDA0
    # more ranks than devices: they wrap around, sharing
    assert choose(requested=None, accelerator="cuda", device_count=2, local_rank=3) == torch.device("cuda", 1)
    assert choose(requested="cpu", accelerator="cuda", device_count=8, local_rank=3) == torch.device("cpu")
    assert choose(requested="cuda", accelerator="cuda", device_count=1, local_rank=3) == CUDA0
    assert choose(requested="xpu:1", accelerator="xpu", device_count=2, local_rank=0) == torch.device("xpu", 1)
    # an accelerator with no collective library (Apple's MPS) only when asked for
    assert choose(requested=None, accelerator="mps", device_count=1, local_rank=0) == torch.device("cpu")
    with pytest.raises(ValueError, match="HF_PARALLEL_DEVICE='cuda:2': this process sees 1 cuda device"):
        choose(requested="cuda:2", accelerator="cuda", device_count=1, local_rank=0)
    with pytest.raises(ValueError, match="sees 0 cuda device"):
        choose(requested="cuda", accelerator=None, device_count=0, local_rank=0)


def test_the_backend_and_the_wire_follow_the_device():
    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend(CUDA3) == "cpu:gloo,cuda:nccl"
    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl" and backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for("gloo", "cuda") == "gloo"
    # NCCL carries the GPU's memory; gloo the host's, so a GPU rank over gloo stages through host memory
    assert DeviceBackend(CUDA3, "cpu:gloo,cuda:nccl").wire == CUDA3 and DeviceBackend(CUDA3, "nccl").wire == CUDA3
    assert DeviceBackend(CUDA3, "gloo").wire == torch.device("cpu") == wire_of("gloo", torch.device("cpu"))
    # two ranks on one card (a laptop, a one-GPU test machine): NCCL refuses them, so the groups are gloo's
    assert group_backend("cpu:gloo,cuda:nccl", CUDA0, ["h:cuda:GPU-a", "h:cuda:GPU-a"]) == "gloo"
    assert group_backend("cpu:gloo,cuda:nccl", CUDA0, ["h:cuda:GPU-a", "h:cuda:GPU-b"]) == "cpu:gloo,cuda:nccl"
    assert group_backend("nccl", CUDA0, ["h1:cuda:GPU-a", "h2:cuda:GPU-a"]) == "nccl"  # two hosts' device 0


def test_headers_travel_on_the_host_wherever_the_backend_carries_host_tensors():
    """A message's header (dtype, shape) written or read on the host never waits for the GPU: beside NCCL
    (``cpu:gloo,cuda:nccl``, the default) and over gloo it goes on the CPU; only a backend that carries the
    device's memory alone puts it on the wire."""
    cpu = torch.device("cpu")
    assert DeviceBackend(CUDA3, "cpu:gloo,cuda:nccl").metadata == cpu and DeviceBackend(CUDA3, "gloo").metadata == cpu
    assert DeviceBackend(cpu, "gloo").metadata == cpu
    assert DeviceBackend(CUDA3, "nccl").metadata == CUDA3 and DeviceBackend(CUDA3, "cuda:nccl").metadata == CUDA3


def test_anything_left_off_the_device_is_named():
    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)
            self.register_buffer("inv_freq", torch.ones(2, device="meta"), persistent=False)
            self.cached = torch.ones(3, device="meta")  # a table kept as a plain attribute

    model = nn.Sequential(Rotary())
    assert left_behind(model, torch.device("cpu")) == ["0.inv_freq (meta)", "0.cached (meta)"]
    with pytest.raises(RuntimeError, match=r"2 tensor\(s\) are not on this rank's device cpu: 0.inv_freq \(meta\)"):
        check_on_device(model, torch.device("cpu"))
    model[0].inv_freq, model[0].cached = torch.ones(2), torch.ones(3)
    move_module_state(model, torch.device("cpu"))
    check_on_device(model, torch.device("cpu"))
    everything = {f"0.{n} (cpu)" for n in ("proj.weight", "proj.bias", "inv_freq", "cached")}
    assert set(left_behind(model, torch.device("meta"))) == everything


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_held_send_is_always_one_half_of_a_swap(schedule):
    """A stage holds a send for the next receive only where its neighbour does the mirror image: a
    one-sided batch would wait on NCCL for bytes the other stage sends only after it has received."""
    for stages in range(1, 6):
        for count in range(1, 9):
            for stage in range(stages):
                steps = order(schedule, stage, stages, count)
                for i in paired(schedule, stage, stages, count):
                    kind = steps[i][0]
                    neighbour = stage + 1 if kind == "F" else stage - 1
                    theirs = order(schedule, neighbour, stages, count)
                    j = theirs.index(steps[i + 1])
                    assert theirs[j + 1] == steps[i], (schedule, stages, count, stage, i)
                    assert j in paired(schedule, neighbour, stages, count), (schedule, stages, count, stage, i)
    if schedule == "gpipe":  # stage i+1 takes every input before it sends: nothing to pair
        assert not any(paired("gpipe", s, 4, 8) for s in range(4))
    else:  # 1F1B's steady state is all swaps
        assert paired("1f1b", 0, 2, 4) == {1, 3, 5} and paired("1f1b", 1, 2, 4) == {1, 3, 5}


@pytest.mark.distributed
def test_nccl_rules_refuse_a_deadlock_and_pass_a_swap(tmp_path, monkeypatch):
    import wire_workers
    from distributed import run_ranks

    monkeypatch.setenv("HF_PARALLEL_TIMEOUT", "4")
    os.makedirs(tmp_path / "own")
    with pytest.raises(FileNotFoundError):  # the workers leave without the runner's result files...
        run_ranks(2, wire_workers.under_the_rules, str(tmp_path / "own"), out_dir=str(tmp_path / "runner"))
    results = []
    for rank in range(2):  # ...having written their own
        with open(os.path.join(tmp_path / "own", f"rank{rank}.json")) as f:
            results.append(json.load(f))
    for rank, got in enumerate(results):
        assert got["swap:torch"] == got["swap:nccl"] == [float(1 - rank)], got
        assert got["deadlock"] is not None and got["seconds"] < 30, got
        assert f"rank {rank} sending before it receives (send with rank {1 - rank}) did not complete" in got[
            "deadlock"
        ] and "under NCCL's point-to-point rules" in got["deadlock"], got["deadlock"]
    assert results[1]["order"] == [[1.0, 2.0], [3.0, 4.0]]


@pytest.mark.distributed
def test_an_fsdp_save_makes_one_layer_whole_at_a_time(tiny_paths, tmp_path):
    """The root (embeddings, norm, head) and one decoder layer whole at any moment of a gathered and of a
    per-rank save at FSDP=2, and the checkpoints bitwise the source's (the per-rank one consolidated)."""
    import wire_workers
    from checks import assert_same_checkpoint
    from distributed import run_ranks

    out = str(tmp_path / "saved")
    for got in run_ranks(2, wire_workers.fsdp_save_one_layer_at_a_time, tiny_paths["llama"], out,
                         out_dir=str(tmp_path / "results")):  # fmt: skip
        assert got["modules"] > got["layers"] >= 2 and got["still_whole"] == 0, got
        assert got["peaks"] == {"False": 2, "True": 2}, got  # was: every module
    assert_same_checkpoint(tiny_paths["llama"], os.path.join(out, "False"))
    import hf_parallel

    hf_parallel.consolidate(os.path.join(out, "True"), str(tmp_path / "consolidated"), progress=False)
    assert_same_checkpoint(tiny_paths["llama"], str(tmp_path / "consolidated"))
