"""Ranks that stop answering: every collective is bounded in time and fails with what this rank was doing.

Where the host waits for an operation (gloo: it runs there), the wait itself is bounded by
``HF_PARALLEL_TIMEOUT``. Where it does not (a point-to-point transfer inside a step on NCCL, whose wait
only orders the device's stream, so the host runs ahead), a ``Watcher`` thread knows the transfer and
names it once it has run past the timeout; NCCL's own watchdog, which ends the process without naming
anything hf_parallel knows, is given a longer timeout (``group_timeout_seconds``) so that the name comes
first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable

HOST_LIBRARIES = ("gloo", "mpi")  # a group carried by these alone runs every operation on the host
WATCHDOG_MARGIN_SECONDS = 30.0  # at least this much between the watcher's report and NCCL's watchdog


class RankFailure(TimeoutError):
    """A collective did not complete: a peer rank died, hangs, or issued a different collective.
    From this rank's side each is a collective that did not finish in time, hence TimeoutError."""


def timeout_seconds() -> float:
    """The bound on any one collective (``HF_PARALLEL_TIMEOUT``, default 600 s)."""
    return float(os.environ.get("HF_PARALLEL_TIMEOUT", "600"))


def group_timeout_seconds(backend: str) -> float:
    """The timeout a process group of ``backend`` (``init_process_group``'s string: ``"gloo"``,
    ``"cpu:gloo,cuda:nccl"``) is made with: ``HF_PARALLEL_TIMEOUT`` where the host runs every operation
    (gloo's timeout is what bounds its waits), a margin more where an accelerator's library carries some
    (NCCL's watchdog aborts at the group's timeout; the ``Watcher`` names a transfer at the bound)."""
    libraries = {part.rpartition(":")[2] for part in backend.split(",")}
    bound = timeout_seconds()
    return bound if libraries <= set(HOST_LIBRARIES) else bound + max(WATCHDOG_MARGIN_SECONDS, bound / 10)


@contextmanager
def collective(what):
    """Turn the backend's error for a failed collective (gloo: "Timed out waiting 3000ms for recv",
    "Connection reset by peer") into a RankFailure that says what this rank was doing and why.
    ``what``: the words, or a function giving them (built only on failure: the hot path pays nothing)."""
    try:
        yield
    except RuntimeError as error:
        text = str(error).strip()
        backend = text.splitlines()[0] if text else type(error).__name__
        what = what() if callable(what) else what
        raise RankFailure(
            f"hf_parallel: {what} failed: another rank died, hangs past HF_PARALLEL_TIMEOUT="
            f"{timeout_seconds():g}s, or issued a different collective (backend: {backend})"
        ) from error


class Watcher:
    """Operations the host does not wait for, checked by a daemon thread every ``period`` seconds while
    any is pending. The first still running ``HF_PARALLEL_TIMEOUT`` after it was posted becomes a
    RankFailure naming it: logged at once (the host may be stuck behind it on the device) and raised by
    ``check``, which this rank's next point-to-point call makes."""

    def __init__(self, period: float = 1.0):
        self.period = period
        self.failure: RankFailure | None = None
        self._lock = threading.Lock()
        self._pending: list[tuple[float, Callable[[], bool], Callable[[], str]]] = []  # (deadline, done, what)
        self._thread: threading.Thread | None = None

    def watch(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        """Watch an operation posted now: ``done()`` says whether it completed, ``what()`` names it."""
        with self._lock:
            self._pending.append((time.monotonic() + timeout_seconds(), done, what))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="hf_parallel-watcher", daemon=True)
                self._thread.start()

    def check(self) -> None:
        """Raise the failure the watcher found, if any (every later call too: a peer is gone)."""
        if self.failure is not None:
            raise self.failure

    def sweep(self, now: float) -> RankFailure | None:
        """Forget the completed operations; the failure, once one is past its deadline at ``now``."""
        with self._lock:
            self._pending = [entry for entry in self._pending if not _completed(entry[1])]
            late = next((what for deadline, _, what in self._pending if deadline <= now), None)
        if late is not None and self.failure is None:
            self.failure = RankFailure(
                f"hf_parallel: {late()} did not complete within HF_PARALLEL_TIMEOUT={timeout_seconds():g}s: "
                "another rank died, hangs, or issued a different operation"
            )
            logging.getLogger("hf_parallel").error("%s", self.failure)
        return self.failure

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            self.sweep(time.monotonic())
            with self._lock:
                if not self._pending or self.failure is not None:
                    self._thread = None
                    return

    def _forget_in_child(self) -> None:
        """After a fork: the parent's thread and pending operations are not this process's."""
        self._lock, self._pending, self._thread = threading.Lock(), [], None


def _completed(done: Callable[[], bool]) -> bool:
    try:
        return done()
    except RuntimeError:  # the operation failed: whoever waits for it is told by the backend
        return True


WATCHER = Watcher()  # this process's: point-to-point transfers on an accelerator's library (``p2p.py``)
if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=WATCHER._forget_in_child)
