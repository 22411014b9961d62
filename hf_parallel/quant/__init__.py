"""Quantized checkpoints: one module a format (its config, key names, scale layout and slice reader:
``scaled_fp8.py``, ``compressed_tensors.py``, ``mxfp4.py``, ``gptq_awq.py``; ``formats.py`` dispatches),
the weights held as stored (``kept.py``, ``kept_linear.py``, ``kept_experts.py``) and the kernels that
multiply them (``kernels/``). Imports only ``core/`` and ``compat/``: no process group, no checkpoint file."""
