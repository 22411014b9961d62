"""Point-to-point transfers under NCCL's rules, whatever the backend.

NCCL is the contract: between two ranks, operations run in the order they were issued; a send does
not complete until its receive runs (a large one, at least: nothing buffers it); tags are ignored.
So two ranks that exchange post both directions in one batch (``post`` with a send and a receive:
``batch_isend_irecv``, Megatron's ``send_forward_recv_backward``), or one of them receives first by a
fixed order. gloo buffers every send and matches by tag, so code that breaks these rules passes on
CPUs and hangs on GPUs: here no tag is passed (messages match by order, as on NCCL), and
``HF_PARALLEL_P2P_RULES=nccl`` swaps in a transport that imposes the rules on gloo (``strict.py``):
a send completes only once its receive has run, each pair's operations run one after another in
issue order, a batch progresses together. The whole test suite runs under it (the pipeline's hidden
states too where shared memory is off), so this class of hang fails on a CPU, with the stuck operation
named. (Shared-memory pipes between stages on one host are a transport of their own, used on CPUs only.)

A wait is the host's where the host runs the transfer (gloo): bounded (``work.wait(timeout)``), and a
transfer that does not finish raises ``RankFailure`` naming it. On an accelerator's library (NCCL) a wait
inside a step is the device stream's (``work.wait()``: the stream waits for the transfer, the host goes
on queueing kernels), so a pipeline step's receives and flushes of bytes on NCCL do not hold the host;
each such transfer is watched (``faults.Watcher``), which names one still running after
``HF_PARALLEL_TIMEOUT``, and the next point-to-point call raises it. A caller that needs a transfer done
before it goes on asks for a host wait (``host=True``; ``send``, ``recv`` and ``run`` always do): bounded
on NCCL too, it is what throttles a save's sender to one message in flight (NCCL's watchdog times an
operation from when it is queued). ``stream_wait`` makes the choice. Tensors travel on the mesh's wire
(``devices.py``): an accelerator tensor bound for gloo is copied to host memory first. Headers travel on
the host wherever the backend carries host tensors (``"cpu:gloo,cuda:nccl"``), so writing or reading a
shape never waits for a GPU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from .devices import COLLECTIVE_BACKENDS, backend_for
from .faults import WATCHER, RankFailure, collective, timeout_seconds
from .strict import post_strictly

RULES_ENV = "HF_PARALLEL_P2P_RULES"


@dataclass
class Op:
    """One side of a transfer: send ``tensor`` to ``peer`` or receive into it from ``peer`` (global
    ranks); ``tensor`` is contiguous, on the wire (a header: on the mesh's ``metadata`` device).
    ``what`` names it in a RankFailure."""

    kind: str  # "send" | "recv"
    tensor: torch.Tensor
    peer: int
    what: str

    def __post_init__(self):
        if self.kind not in ("send", "recv"):
            raise ValueError(f"a point-to-point operation is 'send' or 'recv', not {self.kind!r}")


def strict() -> bool:
    """Whether NCCL's point-to-point rules are imposed on this process's transfers."""
    rule = os.environ.get(RULES_ENV, "")
    if rule not in ("", "nccl"):
        raise ValueError(f"{RULES_ENV}={rule!r}: the one rule set hf_parallel imposes is 'nccl'")
    return rule == "nccl"


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_seconds())


def stream_wait(backend: str, device_types: Iterable[str], host: bool) -> bool:
    """Whether waiting for transfers of tensors on ``device_types`` over a group of ``backend``
    (``init_process_group``'s string) is a stream wait: where each travels on its accelerator's
    collective library (NCCL, XCCL) and the caller does not need them done on the host (``host``).
    gloo moves host tensors on the host, which waits for them anyway."""
    kinds = set(device_types)
    return not host and bool(kinds) and all(
        kind in COLLECTIVE_BACKENDS and backend_for(backend, kind) == COLLECTIVE_BACKENDS[kind] for kind in kinds
    )


class Posted:
    """Transfers in flight; ``wait`` returns once every one of them completed, or, for a stream wait
    (``stream``), once the device's current stream waits for them; those are watched meanwhile."""

    def __init__(self, ops: list[Op], works: list, stream: bool = False):
        self.ops, self.works, self.stream = ops, works, stream
        if stream:
            for work, what in _named(ops, works):
                WATCHER.watch(work.is_completed, what)

    def wait(self) -> None:
        WATCHER.check()
        for op, work in zip(self.ops, self.works):
            with collective(lambda op=op: f"{op.what} ({op.kind} with rank {op.peer})"):
                if self.stream:
                    work.wait()  # no timeout: NCCL orders the current stream after the transfer and returns
                elif not work.wait(timeout()):
                    raise RuntimeError(f"timed out after {timeout_seconds():g}s")


def _named(ops: list[Op], works: list) -> list[tuple[object, Callable[[], str]]]:
    """Each work with the words for what it carries: one work per operation, or one for a whole batch
    (NCCL coalesces one); the words hold no tensor (the watched work itself keeps its own until it is found
    completed, at the watcher's next sweep)."""
    said = [(op.what, op.kind, op.peer) for op in ops]

    def words(parts):
        return lambda: " and ".join(f"{what} ({kind} with rank {peer})" for what, kind, peer in parts)

    if len(works) == len(ops):
        return [(work, words([part])) for work, part in zip(works, said)]
    return [(work, words(said)) for work in works]


def post(ops: list[Op], group=None, host: bool = False) -> Posted:
    """Start ``ops`` together over ``group`` (the mesh's world group; peers are global ranks): one
    batch, so a pair that exchanges posts both directions here. ``host``: their ``wait`` holds the host
    until they are done, whatever the backend (else ``stream_wait`` decides)."""
    WATCHER.check()
    if strict():
        return Posted(ops, post_strictly(ops, group))
    with collective(lambda: " and ".join(f"{op.what} ({op.kind} with rank {op.peer})" for op in ops)):
        if len(ops) == 1:
            op = ops[0]
            works = [(dist.isend if op.kind == "send" else dist.irecv)(op.tensor, op.peer, group=group)]
        else:
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor, op.peer, group=group)
                 for op in ops]
            )  # fmt: skip
    kinds = {op.tensor.device.type for op in ops}
    return Posted(ops, works, kinds != {"cpu"} and stream_wait(str(dist.get_backend(group)), kinds, host))


def run(ops: list[Op], group=None) -> None:
    """``post(ops, group, host=True).wait()``: the transfers done when this returns."""
    post(ops, group, host=True).wait()


def send(tensor: torch.Tensor, peer: int, what: str, group=None) -> None:
    """Send ``tensor`` (on the wire) to global rank ``peer`` and wait until it is received."""
    run([Op("send", tensor.contiguous(), peer, what)], group)


def recv(buffer: torch.Tensor, peer: int, what: str, group=None) -> torch.Tensor:
    """Receive into ``buffer`` (contiguous, on the wire) from global rank ``peer``; returns it."""
    run([Op("recv", buffer, peer, what)], group)
    return buffer


__all__ = ["Op", "Posted", "RankFailure", "post", "recv", "run", "send", "stream_wait", "strict"]
