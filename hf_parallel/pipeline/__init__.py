"""Pipeline parallelism: the stage split (``split.py``), what a stage holds and the hooks that link
it (``stage.py``), stage-to-stage sends (``p2p.py``), the micro-batched forward behind generate
(``forward.py``), GPipe / 1F1B (``schedule.py``), tied embeddings across the first and last stage
(``tied.py``)."""
