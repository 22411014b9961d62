"""Sequence parallelism (Ulysses): each rank holds a run of every sequence's tokens (``tokens.py``);
around attention an all-to-all trades that split for a split of the heads (``ulysses.py``); the
hooks at the layers, the inputs and the loss are ``shard.py``."""
