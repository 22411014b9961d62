"""Sequence parallelism (Ulysses): each rank holds a run of every sequence's tokens; around attention
an all-to-all trades that split for a split of the heads (``ulysses.py``); inputs, positions and
the loss are handled in ``shard.py``."""

from .shard import check_sequence_parallel, parallelize_sequence, sequence_loss

__all__ = ["check_sequence_parallel", "parallelize_sequence", "sequence_loss"]
