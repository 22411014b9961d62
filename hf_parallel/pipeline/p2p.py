"""Point-to-point between pipeline stages: the first rank of a stage sends, the first rank of the
next receives and broadcasts within its TP group (MindSpeed's VTP scheme), so adjacent stages may
have different TP sizes: a stage's output is replicated over its TP group, any one copy will do.

Every tensor is preceded by its header (``distributed/headers.py``), so a receiver never guesses
a shape. Sends are asynchronous (``isend``): a stage goes on with its next micro-batch while the
last one is in flight; ``flush`` waits for them (and keeps their buffers alive until then). A
receive that does not complete within ``HF_PARALLEL_TIMEOUT`` raises ``RankFailure`` naming this
stage, the stage it waited for and what it waited for.

Under ``torch.compile`` the links run eagerly (``torch.compiler.disable``): a stage's forward is
traced in pieces between its receive and its send, which wait on another process.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..distributed.faults import collective, timeout_seconds
from ..distributed.headers import empty_from, empty_header, header_of
from ..distributed.mesh import Mesh
from ..distributed.shm import channel_for, drain
from ..distributed.tags import Tag


class StageLink:
    """This rank's links to the stages before and after its own."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.stage, self.num_stages = mesh.stage, mesh.num_stages
        self.leads = mesh.tp.rank == 0  # the stage's first rank: the one that talks to other stages
        self._pending: list = []  # (work, buffer) of sends not yet known complete
        self.waited = 0.0  # seconds spent blocked on other stages (the pipeline bubble, measured)
        self.wire = mesh.device  # where messages are sent from and received into: the groups' device

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def leader(self, stage: int) -> int:
        """The rank of ``stage`` this rank talks to: its TP group's first, at this rank's SP index
        (every stage has the same SP size, so a stage's token shards go to the same shards)."""
        return self.mesh.shape.global_rank(stage, self.mesh.sp.rank, 0, self.mesh.replica)

    def _where(self, stage: int) -> str:
        return f"stage {stage} (rank {self.leader(stage)})"

    def _pipe(self, sender: int, receiver: int, tag: Tag):
        """The shared-memory pipe for hidden states and their gradients between stages on one host."""
        return self.mesh.pipes.get((sender, receiver)) if tag in (Tag.FORWARD, Tag.BACKWARD) else None

    @torch.compiler.disable
    def send(self, tensor: torch.Tensor, stage: int, what: str, tag: Tag = Tag.FORWARD) -> None:
        """Send ``tensor`` to ``stage``'s first rank, without waiting; only this stage's first rank sends."""
        if not self.leads:
            return
        data = tensor.detach().to(self.wire).contiguous()
        pipe = self._pipe(self.mesh.rank, self.leader(stage), tag)
        if pipe is not None:
            pipe.send(header_of(data, self.wire))
            pipe.send(data)
            return
        for buffer in (header_of(data, self.wire), data):
            with collective(f"stage {self.stage} (rank {self.mesh.rank}) sending {what} to {self._where(stage)}"):
                work = dist.isend(buffer, dst=self.leader(stage), tag=tag)
            self._pending.append((work, buffer, what, stage))

    @torch.compiler.disable
    def recv(self, stage: int, what: str, tag: Tag = Tag.FORWARD) -> torch.Tensor:
        """A tensor from ``stage``'s first rank, on every rank of this stage (broadcast over TP)."""
        waiting = f"stage {self.stage} (rank {self.mesh.rank}) waiting for {what} from {self._where(stage)}"
        start = time.perf_counter()
        header = self._take(empty_header(self.wire), stage, tag, waiting)
        out = self._take(empty_from(header, self.wire), stage, tag, waiting)
        self.waited += time.perf_counter() - start
        return out.to(self.mesh.device)

    def _take(self, buffer: torch.Tensor, stage: int, tag: int, waiting: str) -> torch.Tensor:
        """Fill ``buffer`` on this stage's first rank from ``stage``'s, then on the rest of its TP group."""
        pipe = self._pipe(self.leader(stage), self.mesh.rank, tag)
        if pipe is not None and self.leads:
            pipe.recv(buffer, waiting)
        elif self.leads:
            with collective(waiting):
                dist.recv(buffer, src=self.leader(stage), tag=tag)
        tp = self.mesh.tp
        if tp.group is not None:
            with collective(f"{waiting} (broadcast from rank {tp.ranks[0]})"):
                dist.broadcast(buffer, group_src=0, group=tp.group)
        return buffer

    def flush(self) -> None:
        """Wait until every send of this rank has completed."""
        if self.mesh.pipes:
            drain(timeout_seconds(), f"stage {self.stage} (rank {self.mesh.rank}) sending to the next stages")
        pending, self._pending = self._pending, []
        for work, _, what, stage in pending:
            with collective(f"stage {self.stage} (rank {self.mesh.rank}) sending {what} to {self._where(stage)}"):
                work.wait()

    @torch.compiler.disable
    def broadcast_from_last(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The last stage's ``tensor`` on every rank of this model replica (header first)."""
        source = self.mesh.stage_ranks(self.num_stages - 1)[0]  # the same rank for every rank of the replica
        mine = tensor.detach().to(self.wire).contiguous() if self.mesh.rank == source else None
        what = f"rank {self.mesh.rank} (stage {self.stage}) receiving the last stage's output from rank {source}"
        start = time.perf_counter()
        channel = channel_for(self.mesh.model.group) if self.wire.type == "cpu" else None
        if channel is not None:  # one host: header and bytes in one shared-memory step
            out = channel.broadcast(mine, self.mesh.model.ranks.index(source), what)
            if out is not None:
                self.waited += time.perf_counter() - start
                return out.to(self.mesh.device)
        header = header_of(mine, self.wire) if mine is not None else empty_header(self.wire)
        with collective(what):
            dist.broadcast(header, src=source, group=self.mesh.model.group)
        out = mine if mine is not None else empty_from(header, self.wire)
        with collective(what):
            dist.broadcast(out, src=source, group=self.mesh.model.group)
        self.waited += time.perf_counter() - start
        return out.to(self.mesh.device)
