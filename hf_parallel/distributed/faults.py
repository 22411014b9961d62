"""Ranks that stop answering: every collective is bounded in time and fails with what this rank was doing."""

from __future__ import annotations

import os
from contextlib import contextmanager


class RankFailure(TimeoutError):
    """A collective did not complete: a peer rank died, hangs, or issued a different collective.
    From this rank's side each is a collective that did not finish in time, hence TimeoutError."""


def timeout_seconds() -> float:
    """The bound on any one collective (``HF_PARALLEL_TIMEOUT``, default 600 s)."""
    return float(os.environ.get("HF_PARALLEL_TIMEOUT", "600"))


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
