"""Point-to-point between pipeline stages: the first rank of a stage sends, the first rank of the
next receives and broadcasts within its TP group (MindSpeed's VTP scheme), so adjacent stages may
have different TP sizes: a stage's output is replicated over its TP group, any one copy will do.

Every tensor is preceded by its header (``distributed/headers.py``), so a receiver never guesses
a shape. Sends are asynchronous: a stage goes on with its next micro-batch while the last one is in
flight; ``flush`` waits for them (and keeps their buffers alive until then). A receive that does not
complete within ``HF_PARALLEL_TIMEOUT`` raises ``RankFailure`` naming this stage, the stage it waited
for and what it waited for.

NCCL's rules (``distributed/p2p.py``) hold: a send does not complete until its receive runs, and a
pair's operations run in issue order. Two stages that each send the other something before receiving
(the 1F1B steady state: stage i's forward output and stage i+1's backward gradient; the tied weight's
two gradients) would wait for each other forever, so such a send is *held* (``hold_sends``) and posted
with the next receive in one batch, headers first, then bytes (Megatron's ``send_forward_recv_backward``).

Under ``torch.compile`` the links run eagerly (``torch.compiler.disable``): a stage's forward is
traced in pieces between its receive and its send, which wait on another process.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..distributed import p2p
from ..distributed.devices import to_wire
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
        self._pending: list[p2p.Posted] = []  # sends not yet known complete (they keep their buffers)
        self._held: list[tuple[torch.Tensor, int, str]] = []  # sends to post with the next receive
        self._holding = False
        self.waited = 0.0  # seconds spent blocked on other stages (the pipeline bubble, measured)
        self.wire = mesh.wire  # where messages are sent from and received into: the groups' backend's device
        self.meta = mesh.metadata  # where their headers go: the host, read there without waiting on a GPU

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

    @contextmanager
    def hold_sends(self):
        """Sends made inside go out with the next receive, in one batch (see the module's docstring)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    @torch.compiler.disable
    def send(self, tensor: torch.Tensor, stage: int, what: str, tag: Tag = Tag.FORWARD) -> None:
        """Send ``tensor`` to ``stage``'s first rank, without waiting; only this stage's first rank sends."""
        if not self.leads:
            return
        data = to_wire(tensor.detach(), self.wire)
        pipe = self._pipe(self.mesh.rank, self.leader(stage), tag)
        if pipe is not None:
            pipe.send(header_of(data, self.meta))
            pipe.send(data)
            return
        what = f"stage {self.stage} (rank {self.mesh.rank}) sending {what} to {self._where(stage)}"
        if self._holding:
            self._held.append((data, self.leader(stage), what))
            return
        self._pending += self._post([("send", data, self.leader(stage), what)])

    def _post(self, messages: list[tuple]) -> list[p2p.Posted]:
        """Each message's header, then its bytes, as two batches: a receiver sizes its buffer from the
        header, and a batch's receive of bytes it cannot size yet would hold up the pair. Sends alone are
        not waited for (a stage goes on with its next micro-batch); a batch with a receive waits for its
        headers before it posts the bytes."""
        group = self.mesh.world.group
        headers = [p2p.Op(kind, header_of(t, self.meta) if kind == "send" else t, peer, f"{what} (header)")
                   for kind, t, peer, what in messages]  # fmt: skip
        posted = [p2p.post(headers, group)]
        if any(op.kind == "recv" for op in headers):
            posted.pop().wait()
        data = [p2p.Op(kind, t if kind == "send" else empty_from(header.tensor, self.wire), peer, what)
                for (kind, t, peer, what), header in zip(messages, headers)]  # fmt: skip
        return [*posted, p2p.post(data, group)]

    @torch.compiler.disable
    def recv(self, stage: int, what: str, tag: Tag = Tag.FORWARD) -> torch.Tensor:
        """A tensor from ``stage``'s first rank, on every rank of this stage (broadcast over TP)."""
        waiting = f"stage {self.stage} (rank {self.mesh.rank}) waiting for {what} from {self._where(stage)}"
        start = time.perf_counter()
        out = self._receive(stage, tag, waiting)
        tp = self.mesh.tp
        if tp.group is not None:
            header = header_of(out, self.meta) if self.leads else empty_header(self.meta)
            with collective(f"{waiting} (broadcast of the header from rank {tp.ranks[0]})"):
                dist.broadcast(header, group_src=0, group=tp.group)
            out = out if self.leads else empty_from(header, self.wire)
            with collective(f"{waiting} (broadcast from rank {tp.ranks[0]})"):
                dist.broadcast(out, group_src=0, group=tp.group)
        self.waited += time.perf_counter() - start
        return out.to(self.mesh.device)

    def _receive(self, stage: int, tag: Tag, waiting: str) -> torch.Tensor | None:
        """On this stage's first rank: the tensor from ``stage``'s, with any held sends in the same batches."""
        if not self.leads:
            return None
        source = self.leader(stage)
        pipe = self._pipe(source, self.mesh.rank, tag)
        if pipe is not None:
            self.release()
            header = empty_header(self.meta)
            pipe.recv(header, waiting)
            return pipe.recv(empty_from(header, self.wire), waiting)
        held, self._held = self._held, []
        (posted,) = self._post([*(("send", t, peer, what) for t, peer, what in held),
                                ("recv", empty_header(self.meta), source, waiting)])  # fmt: skip
        posted.wait()
        return posted.ops[-1].tensor

    def release(self) -> None:
        """Post the held sends on their own."""
        held, self._held = self._held, []
        if held:
            self._pending += self._post([("send", t, peer, what) for t, peer, what in held])

    def flush(self) -> None:
        """Wait until every send of this rank has completed."""
        self.release()
        if self.mesh.pipes:
            drain(timeout_seconds(), f"stage {self.stage} (rank {self.mesh.rank}) sending to the next stages")
        pending, self._pending = self._pending, []
        for posted in pending:
            posted.wait()

    @torch.compiler.disable
    def broadcast_from_last(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The last stage's ``tensor`` on every rank of this model replica (header first)."""
        self.release()  # a collective: nothing this rank holds back may be what another rank waits for
        source = self.mesh.stage_ranks(self.num_stages - 1)[0]  # the same rank for every rank of the replica
        mine = to_wire(tensor.detach(), self.wire) if self.mesh.rank == source else None
        what = f"rank {self.mesh.rank} (stage {self.stage}) receiving the last stage's output from rank {source}"
        start = time.perf_counter()
        channel = channel_for(self.mesh.model.group) if self.wire.type == "cpu" else None
        if channel is not None:  # one host: header and bytes in one shared-memory step
            out = channel.broadcast(mine, self.mesh.model.ranks.index(source), what)
            if out is not None:
                self.waited += time.perf_counter() - start
                return out.to(self.mesh.device)
        header = header_of(mine, self.meta) if mine is not None else empty_header(self.meta)
        with collective(what):
            dist.broadcast(header, src=source, group=self.mesh.model.group)
        out = mine if mine is not None else empty_from(header, self.wire)
        with collective(what):
            dist.broadcast(out, src=source, group=self.mesh.model.group)
        self.waited += time.perf_counter() - start
        return out.to(self.mesh.device)
