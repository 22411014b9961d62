"""Kernels for weights held quantized, each an object that says whether it can serve a weight on this
device and dtype, and why not (``base.py``: ``LinearKernel``, ``KERNEL_ROWS``, the dequantizing fallback): the
weight-only FP8 Triton kernel (``fp8_weight_only.py``, its programs in ``fp8_triton.py``, launched through
``triton_launch.py``), cuBLASLt's block-scaled FP8 products (``fp8_scaled_mm.py``), torch's int4 kernel
(``int4_torch.py``), and the helper that runs their load-time checks (``self_check.py``)."""
