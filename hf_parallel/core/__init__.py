"""The base pieces every layer imports, importing nothing of the package but ``compat/``: layouts
(``layout.py``), tiles of a tensor (``tiles.py``), the dtype maps (``dtypes.py``), checkpoint errors
(``errors.py``), where a model keeps its repeated layers (``layers.py``), the arguments of an experts
forward (``expert_args.py``) and the per-call context (``context.py``)."""
