"""Training a parallel model: one step over micro-batches for every layout (``step.py``)."""
