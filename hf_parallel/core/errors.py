"""The error for a checkpoint on disk that cannot be read as one."""


class CheckpointError(ValueError):
    """A checkpoint on disk is malformed; the message names the file (and key) at fault."""
