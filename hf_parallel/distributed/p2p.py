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

Every wait is bounded (``work.wait(timeout)``; on NCCL that blocks the host until the transfer is
done or the timeout passes, which is what throttles a save's sender to one message in flight), and a
transfer that does not finish raises ``RankFailure`` naming it. Tensors travel on the mesh's wire
(``devices.py``): an accelerator tensor bound for gloo is staged through pinned host memory. Headers
travel on the host wherever the backend carries host tensors (``"cpu:gloo,cuda:nccl"``), so writing or
reading a shape never waits for a GPU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .faults import RankFailure, collective, timeout_seconds
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


class Posted:
    """Transfers in flight; ``wait`` returns once every one of them completed."""

    def __init__(self, ops: list[Op], works: list):
        self.ops, self.works = ops, works

    def wait(self) -> None:
        for op, work in zip(self.ops, self.works):
            with collective(lambda op=op: f"{op.what} ({op.kind} with rank {op.peer})"):
                if not work.wait(timeout()):
                    raise RuntimeError(f"timed out after {timeout_seconds():g}s")


def post(ops: list[Op], group=None) -> Posted:
    """Start ``ops`` together over ``group`` (the mesh's world group; peers are global ranks): one
    batch, so a pair that exchanges posts both directions here."""
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
    return Posted(ops, works)


def run(ops: list[Op], group=None) -> None:
    """``post(ops, group).wait()``: the transfers done when this returns."""
    post(ops, group).wait()


def send(tensor: torch.Tensor, peer: int, what: str, group=None) -> None:
    """Send ``tensor`` (on the wire) to global rank ``peer`` and wait until it is received."""
    run([Op("send", tensor.contiguous(), peer, what)], group)


def recv(buffer: torch.Tensor, peer: int, what: str, group=None) -> torch.Tensor:
    """Receive into ``buffer`` (contiguous, on the wire) from global rank ``peer``; returns it."""
    run([Op("recv", buffer, peer, what)], group)
    return buffer


__all__ = ["Op", "Posted", "RankFailure", "post", "recv", "run", "send", "strict"]
