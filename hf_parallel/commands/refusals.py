"""Bad input under torchrun answered with one line from rank 0, not a traceback on every rank.

A refusal (a layout the world cannot hold, a plan that cannot split a model, a checkpoint that is not one) is
raised alike on every rank, before anything is computed. Rank 0 prints it as ``hf-parallel CMD: message`` and
exits 1, and torchrun stops the others. A rank refusing alone (a file only its node cannot read) prints its
line with its rank after a grace period, in which torchrun stops it if rank 0 refused too. Anything else is
a bug and keeps its traceback; ``HF_PARALLEL_TRACEBACK=1`` keeps it for refusals too."""

from __future__ import annotations

import os
import sys
import time

# what a refusal raises: ValueError (CheckpointError and the training state's StateError among them), an
# unsupported combination, a path that is not there or cannot be read (transformers' OSError for a directory
# without a config, a hub id not found offline)
REFUSALS = (ValueError, NotImplementedError, OSError)
GRACE_SECONDS = 3.0  # torchrun checks its ranks every 0.1 s


def answered_once(command: str, run, args) -> int:
    """``run(args)``'s exit status, or 1 after a refusal printed once (see the module docstring)."""
    try:
        return run(args) or 0
    except REFUSALS as error:
        if os.environ.get("HF_PARALLEL_TRACEBACK") == "1":
            raise
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            time.sleep(GRACE_SECONDS)
        who = f" (rank {rank})" if rank else ""
        print(f"hf-parallel {command}{who}: {error}", file=sys.stderr, flush=True)
        return 1
