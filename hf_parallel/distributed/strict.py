"""NCCL's point-to-point rules imposed on gloo (``HF_PARALLEL_P2P_RULES=nccl``): a test transport, not a mock.

The bytes move over gloo as they always do; what changes is when a transfer counts as done:
- **a pair's operations run in issue order**: each peer has one worker thread, which runs this rank's
  batches with that peer one after another, as NCCL's stream for the pair does (NCCL runs a batch on the
  group's communicator, whose stream also orders it against batches with other peers; hf_parallel waits for
  every batch of several operations before it posts the next, so that stricter order adds no hang);
- **a send completes only when its receive has run**: the receiver acknowledges each message once it
  has it, and the sender's operation (and so everything queued behind it for that peer) waits for the
  acknowledgement;
- **tags are ignored**: every message of a pair travels on one tag, so messages match by order;
- **a batch progresses together**: a batch's sends and receives with a peer are all posted before any
  of them is waited for (``batch_isend_irecv``, NCCL's group calls).
Two ranks that both send before they receive therefore wait for each other until the timeout, and
the ``RankFailure`` names each stuck operation, where gloo alone would have let them through.
"""

from __future__ import annotations

import datetime
import queue
import threading
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .faults import RankFailure, timeout_seconds

if TYPE_CHECKING:
    from .p2p import Op

DATA, ACK = 0, 1  # gloo tags: the messages themselves (in order, as NCCL matches them), their receipts


class _Pair:
    """This rank's operations with one peer, run in issue order by one thread."""

    def __init__(self, peer: int, group):
        self.peer, self.group = peer, group
        self.items: queue.Queue = queue.Queue()
        self.failed: BaseException | None = None
        threading.Thread(target=self._serve, name=f"hf_parallel-p2p-{peer}", daemon=True).start()

    def submit(self, ops: list[Op]) -> Future:
        future: Future = Future()
        self.items.put((ops, future))
        return future

    def _serve(self) -> None:
        while True:
            ops, future = self.items.get()
            if self.failed is not None:  # a pair whose stream is stuck runs nothing after it
                future.set_exception(self.failed)
                continue
            try:
                _run_together(ops, self.peer, self.group)
                future.set_result(None)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
                self.failed = error
                future.set_exception(error)


def _run_together(ops: list[Op], peer: int, group) -> None:
    """One batch with ``peer``, progressing together: every message and every receipt this rank expects
    posted first, then each message received and acknowledged, then every receipt waited for."""
    works = [(dist.isend if op.kind == "send" else dist.irecv)(op.tensor, peer, group=group, tag=DATA) for op in ops]
    expected = {i: dist.irecv(torch.zeros(1, device="cpu"), peer, group=group, tag=ACK) for i, op in enumerate(ops)
                if op.kind == "send"}  # fmt: skip
    receipts = []
    for op, work in zip(ops, works):
        if op.kind == "recv":
            _wait(work, op, "the message")
            receipt = torch.ones(1, device="cpu")  # it has run: its sender may complete
            receipts.append((op, dist.isend(receipt, peer, group=group, tag=ACK)))
    for i, receipt in expected.items():
        _wait(works[i], ops[i], "its receive to take the bytes")
        _wait(receipt, ops[i], "its receive (NCCL: a send completes when its receive runs)")
    for op, receipt in receipts:
        _wait(receipt, op, "the peer to take the receipt")


def _wait(work, op: Op, waiting_for: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout_seconds()))
    except RuntimeError as error:
        raise RankFailure(
            f"hf_parallel: {op.what} ({op.kind} with rank {op.peer}) did not complete within "
            f"HF_PARALLEL_TIMEOUT={timeout_seconds():g}s under NCCL's point-to-point rules, waiting for "
            f"{waiting_for}: the peer never ran the matching operation, or ran another one first "
            f"(backend: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__})"
        ) from error


_PAIRS: dict[tuple, _Pair] = {}  # (group's name, peer) -> the pair: NCCL orders a pair's operations per communicator
_LOCK = threading.Lock()


def _pair(peer: int, group) -> _Pair:
    key = (getattr(group, "group_name", None), peer)
    with _LOCK:
        if key not in _PAIRS or _PAIRS[key].group is not group:  # a group made anew under a name used before
            _PAIRS[key] = _Pair(peer, group)
        return _PAIRS[key]


class _Done:
    """A batch's part with one peer, as the work ``Posted`` waits on."""

    def __init__(self, future: Future, ops: list[Op]):
        self.future, self.ops = future, ops

    def wait(self, limit) -> bool:
        # the pair's thread bounds each of its waits (two per operation) by the timeout: its own error comes first
        margin = (2 * len(self.ops) + 1) * limit.total_seconds() + 5
        if not wait([self.future], timeout=margin).done:  # (its own error, a RankFailure, is a TimeoutError too)
            op = self.ops[0]
            raise RankFailure(
                f"hf_parallel: {op.what} ({op.kind} with rank {op.peer}) did not start within {margin:g}s under "
                f"NCCL's point-to-point rules (HF_PARALLEL_TIMEOUT={timeout_seconds():g}s): the operations queued "
                "before it with that rank never completed"
            )
        self.future.result()
        return True


def post_strictly(ops: list[Op], group=None) -> list[_Done]:
    """Each of ``ops`` queued on its peer's pair; returns the work ``p2p.Posted`` waits on, one per op."""
    by_peer: dict[int, list[Op]] = {}
    for op in ops:
        by_peer.setdefault(op.peer, []).append(op)
    done = {peer: _Done(_pair(peer, group).submit(mine), mine) for peer, mine in by_peer.items()}
    return [done[op.peer] for op in ops]
