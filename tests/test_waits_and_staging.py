"""What the host waits for, and how a host tensor reaches a GPU, decided without one.

Which point-to-point wait is used where (``p2p.stream_wait``: the device stream's on NCCL inside a step, the
host's on gloo and wherever the caller needs the bytes), the watcher that names a transfer no host waits for
(``faults.Watcher``, with plain callables for the transfers), the process groups' timeouts against NCCL's
watchdog, and the pinned staging ring's chunking (``devices.chunk_plan``, and ``PinnedRing`` run on the CPU,
where its chunks are plain memory and its copies synchronous: the same cuts, offsets, casts and reuse; the
pinned, queued copies themselves are the ``cuda`` tier's)."""

from __future__ import annotations

import time

import pytest
import torch

from hf_parallel.distributed.devices import PinnedRing, chunk_plan, pinned_ring, to_wire
from hf_parallel.distributed.faults import RankFailure, Watcher, group_timeout_seconds
from hf_parallel.distributed.p2p import stream_wait

MIXED = "cpu:gloo,cuda:nccl"


def test_a_step_waits_on_the_stream_only_where_an_accelerators_library_carries_the_bytes():
    # NCCL inside a step: the stream waits, the host goes on
    assert stream_wait(MIXED, {"cuda"}, host=False)
    assert stream_wait("nccl", ["cuda", "cuda"], host=False)
    assert stream_wait("cpu:gloo,xpu:xccl", {"xpu"}, host=False)
    # a save (or any caller that needs the bytes done) holds the host, bounded, whatever the backend
    assert not stream_wait(MIXED, {"cuda"}, host=True)
    # gloo runs on the host: headers beside NCCL, a GPU model over gloo, the CPU
    assert not stream_wait(MIXED, {"cpu"}, host=False)
    assert not stream_wait("gloo", {"cuda"}, host=False)
    assert not stream_wait("gloo", {"cpu"}, host=False)
    # a batch partly on the host, a device no library carries, or nothing at all: the host waits
    assert not stream_wait(MIXED, {"cpu", "cuda"}, host=False)
    assert not stream_wait(MIXED, {"xpu"}, host=False)
    assert not stream_wait("nccl", {"mps"}, host=False)
    assert not stream_wait(MIXED, set(), host=False)


def test_the_groups_outlast_the_bound_only_where_nccls_watchdog_would_end_the_process(monkeypatch):
    monkeypatch.setenv("HF_PARALLEL_TIMEOUT", "600")
    assert group_timeout_seconds("gloo") == 600 == group_timeout_seconds("cpu:gloo")
    assert group_timeout_seconds(MIXED) == 660 == group_timeout_seconds("nccl")
    monkeypatch.setenv("HF_PARALLEL_TIMEOUT", "5")
    assert group_timeout_seconds("gloo") == 5 and group_timeout_seconds(MIXED) == 35


def test_the_watcher_names_the_transfer_that_outlived_the_bound(monkeypatch):
    monkeypatch.setenv("HF_PARALLEL_TIMEOUT", "10")
    watcher = Watcher(period=3600)  # swept by hand here: the thread sleeps
    done = {"late": False, "quick": False}
    watcher.watch(lambda: done["quick"], lambda: "stage 0 (rank 0) sending the hidden states (send with rank 1)")
    watcher.watch(lambda: done["late"], lambda: "stage 1 (rank 1) waiting for the logits (recv with rank 0)")
    now = time.monotonic()
    assert watcher.sweep(now) is None
    watcher.check()  # nothing late yet
    done["quick"] = True
    failure = watcher.sweep(now + 11)
    assert isinstance(failure, RankFailure) and isinstance(failure, TimeoutError)
    assert "stage 1 (rank 1) waiting for the logits (recv with rank 0) did not complete within " in str(failure)
    assert "HF_PARALLEL_TIMEOUT=10s" in str(failure) and "sending" not in str(failure)  # the completed one is gone
    for _ in range(2):  # every later point-to-point call is told
        with pytest.raises(RankFailure, match="waiting for the logits"):
            watcher.check()


def test_the_watcher_thread_reports_by_itself_and_stops_when_nothing_is_pending(monkeypatch):
    monkeypatch.setenv("HF_PARALLEL_TIMEOUT", "0.2")
    watcher = Watcher(period=0.05)
    watcher.watch(lambda: True, lambda: "a transfer that completed")
    deadline = time.monotonic() + 10
    while watcher._thread is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watcher._thread is None and watcher.failure is None  # it left once nothing was pending
    watcher.watch(lambda: False, lambda: "stage 1 (rank 1) waiting for the hidden states (recv with rank 0)")
    while watcher.failure is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(RankFailure, match=r"waiting for the hidden states \(recv with rank 0\) did not complete"):
        watcher.check()


def test_a_failed_transfer_counts_as_done_for_the_watcher(monkeypatch):
    monkeypatch.setenv("HF_PARALLEL_TIMEOUT", "1")

    def aborted():
        raise RuntimeError("NCCL communicator was aborted")  # its waiter hears it from the backend

    watcher = Watcher(period=3600)
    watcher.watch(aborted, lambda: "a transfer")
    assert watcher.sweep(time.monotonic() + 5) is None


def test_the_chunk_plan_cuts_whole_elements_each_a_chunk_but_the_last():
    assert chunk_plan(10, 4, chunk_bytes=16) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_plan(8, 4, chunk_bytes=16) == [(0, 4), (4, 8)]
    assert chunk_plan(3, 2, chunk_bytes=7) == [(0, 3)]  # 7 bytes hold 3 whole bf16 elements
    assert chunk_plan(5, 2, chunk_bytes=7) == [(0, 3), (3, 5)]
    assert chunk_plan(2, 8, chunk_bytes=4) == [(0, 1), (1, 2)]  # an element larger than a chunk: one at a time
    assert chunk_plan(0, 4, chunk_bytes=16) == []
    per = 32 << 20  # bf16 elements in the default 64 MiB chunk
    assert chunk_plan(2 * per + 5, 2) == [(0, per), (per, 2 * per), (2 * per, 2 * per + 5)]


@pytest.mark.parametrize("source_dtype,target_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_the_ring_copies_a_tensor_larger_than_its_chunks_through_two_reused_buffers(source_dtype, target_dtype):
    ring = PinnedRing(torch.device("cpu"), chunks=2, chunk_bytes=24)
    host = torch.randn(7, 5).to(source_dtype)
    out = torch.full((7, 5), float("nan"), dtype=target_dtype)
    assert ring.copy_(out, host) is out
    assert torch.equal(out, host.to(target_dtype))  # every chunk landed at its offset, cast as asked
    assert all(buffer is not None and buffer.numel() == 24 for buffer in ring.buffers)
    first = [buffer.data_ptr() for buffer in ring.buffers]
    ring.copy_(torch.empty(3, 4, dtype=target_dtype), torch.ones(3, 4, dtype=source_dtype))
    assert [buffer.data_ptr() for buffer in ring.buffers] == first  # reused, never grown


def test_the_ring_loads_a_small_tensor_in_a_chunk_and_a_large_one_through_host_memory():
    ring = PinnedRing(torch.device("cpu"), chunks=2, chunk_bytes=64)
    written = []

    def write(into):
        written.append(into)
        into.copy_(torch.arange(into.numel(), dtype=into.dtype).view(into.shape))

    small = ring.load(torch.empty(2, 3), torch.bfloat16, write)  # 12 bytes: written into the chunk itself
    assert torch.equal(small, torch.arange(6.0).view(2, 3))
    assert written[-1].dtype == torch.bfloat16 and written[-1].untyped_storage().data_ptr() in {
        b.data_ptr() for b in ring.buffers if b is not None
    }
    large = ring.load(torch.empty(4, 10), torch.float32, write)  # 160 bytes: three chunks' worth
    assert torch.equal(large, torch.arange(40.0).view(4, 10))
    assert written[-1].untyped_storage().data_ptr() not in {b.data_ptr() for b in ring.buffers}
    with pytest.raises(ValueError, match="contiguous target"):
        ring.copy_(torch.empty(5, 4).t(), torch.ones(4, 5))


def test_a_cpu_rank_stages_nothing():
    assert pinned_ring(torch.device("cpu")) is None
    x = torch.arange(6.0).view(2, 3).t()
    assert torch.equal(to_wire(x, torch.device("cpu")), x) and to_wire(x, torch.device("cpu")).is_contiguous()
