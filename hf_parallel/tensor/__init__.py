"""Tensor (and expert) parallelism: layouts, head-aligned splits, parallel styles, plan rules and
where plans come from (plans/ files, transformers, discovery), and applying a plan to a model."""
