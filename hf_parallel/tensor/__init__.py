"""Tensor (and expert) parallelism: layouts (``layout.py``), head-aligned and packed splits
(``heads.py``, ``splits.py``), gradient sums, parallel styles (``styles.py``, ``experts.py``,
``registry.py``), plan rules and where plans come from (plans/ files, transformers, discovery), and a
plan applied to a model (``parallelize.py``)."""
