"""Errors hf_parallel raises about what is on disk."""


class CheckpointError(ValueError):
    """A checkpoint on disk is malformed; the message names the file (and key) at fault."""
