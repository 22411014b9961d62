"""Checkpoints on disk: each rank reads its slice of every tensor (safetensors, per-expert keys,
distributed saves at any world size); saves gather in bounded blocks and write atomically, as
standard checkpoints or per-rank files with a manifest that ``consolidate`` turns back into one."""
