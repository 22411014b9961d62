"""Training a parallel model: ``train_step`` (``step.py``), the data-parallel dimensions with FSDP2
(``data_parallel.py``), the global gradient norm (``clipping.py``), transformers' Trainer
(``trainer.py``) and per-rank state for resuming (``resume.py``)."""
