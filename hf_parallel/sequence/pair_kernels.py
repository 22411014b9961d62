"""The fused kernels one ring-attention chunk pair goes through (``ring.py``): each returns the pair's output and
its log-sum-exp, which the ring's merge needs, and takes the merged output and log-sum-exp back in its backward
(flash attention's), so no pair's scores are ever held.

- ``"cpu"``: torch's fused flash kernel for the CPU (``_scaled_dot_product_flash_attention_for_cpu``), in
  float32, the pair's boolean mask as a float32 bias (float32's minimum where masked).
- ``"cuda"``: the memory-efficient kernel (``_scaled_dot_product_efficient_attention``, the one sdpa picks for
  a masked call; torch's own context parallelism calls it too, without a bias), in the model's dtype (float32
  accumulation inside), the pair's mask as a bias in that dtype, its rows padded to 16 elements as sdpa pads
  them. Its log-sum-exp covers the queries padded to a multiple of 32; the backward takes it back so. The
  backward reads the merged output and its gradient as laid out ``[batch, queries, heads, dim]`` (the
  kernel's own output layout), so they are handed over so. NVIDIA's CUDA only (ROCm's kernel keeps another
  log-sum-exp layout), float16 / float32, and bfloat16 from sm80 on; else written out.
- None: the pair is written out in float32 (``RingPlan.scores``), a tile of queries at a time: soft-capping,
  eager's additive mask over padding, a value head of another size than the keys', a head size or dtype the
  CUDA kernel does not take. It is also the tests' reference.

A masked position gets a finite bias, not -inf, so that a query masked from every key of one pair has a finite
log-sum-exp far below any real one (no weight in the merge) rather than NaN: on CUDA -1e30 (float16's minimum
in float16), as the kernel scales its scores by log2(e) in float32, where the dtype's minimum would overflow to
-inf and a fully masked row's backward would be inf * 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BIAS_ALIGNMENT = 16  # the efficient kernel reads a bias whose rows start at multiples of 16 elements
LSE_ALIGNMENT = 32  # its log-sum-exp covers the queries padded to a multiple of 32
CUDA_MASKED = -1e30  # a masked score's bias on CUDA: finite after the kernel's float32 scaling by log2(e)


def pair_kernel(device: torch.device, softcap, additive: bool, head_dim: int, value_dim: int,
                dtype: torch.dtype) -> str | None:  # fmt: skip
    """Which kernel a plan's pairs go through (None: written out)."""
    if softcap or additive:
        return None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda" or torch.version.hip is not None or head_dim != value_dim or head_dim % 8:
        return None
    if dtype == torch.bfloat16:
        return "cuda" if torch.cuda.get_device_capability(device)[0] >= 8 else None
    return "cuda" if dtype in (torch.float16, torch.float32) else None


def compute_dtype(kind: str | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype a pair's queries, keys and values enter its kernel in: the model's on CUDA, float32 elsewhere."""
    return dtype if kind == "cuda" else torch.float32


def pair_forward(kind: str, q, k, v, mask, causal: bool, scale: float):
    """``(out, lse, rng)`` of one pair: its output and log-sum-exp in float32 (``[b, h, c, d]``, ``[b, h, c]``),
    and what the CUDA kernel's backward takes back (its random-number state, unused without dropout)."""
    if kind == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_bias(mask, q, aligned=False), scale=scale
        )
        return out, lse, None
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _bias(mask, q, aligned=True), True, 0.0, causal, scale=scale
    )
    return out.float(), lse[..., : q.shape[2]], (seed, offset)


def pair_backward(kind: str, grad, q, k, v, out, lse, mask, causal: bool, scale: float, rng):
    """``(d_q, d_k, d_v)`` of one pair in float32, from the merged output's gradient ``grad``, the merged
    output ``out`` and log-sum-exp ``lse`` (float32) of its queries."""
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal,
            attn_mask=_bias(mask, q, aligned=False), scale=scale,
        )  # fmt: skip
    padded = -(-lse.shape[-1] // LSE_ALIGNMENT) * LSE_ALIGNMENT
    d_q, d_k, d_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _queries_major(grad, q.dtype), q, k, v, _bias(mask, q, aligned=True), _queries_major(out, q.dtype),
        F.pad(lse, (0, padded - lse.shape[-1]), value=float("inf")).contiguous(), *rng, 0.0,
        (True, True, True, False), causal, scale=scale,
    )  # fmt: skip
    return d_q.float(), d_k.float(), d_v.float()


def _queries_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[b, h, n, d]`` in ``dtype``, laid out ``[b, n, h, d]`` in memory (the efficient kernel's output layout,
    which its backward assumes for the output and its gradient)."""
    return x.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)


def _bias(mask: torch.Tensor | None, q: torch.Tensor, aligned: bool) -> torch.Tensor | None:
    """A pair's boolean mask ``[b or 1, 1, c, keys]`` as the kernel's additive bias in ``q``'s dtype: zero where
    allowed, a finite minimum where masked; ``aligned``: the efficient kernel's (rows padded to ``BIAS_ALIGNMENT``
    elements, expanded over ``q``'s batch and heads, ``CUDA_MASKED``). Only boolean masks reach a kernel
    (eager's additive ones are written out)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise TypeError(f"a ring pair's kernel takes a boolean mask, not {mask.dtype}")
    keys = mask.shape[-1]
    width = -(-keys // BIAS_ALIGNMENT) * BIAS_ALIGNMENT if aligned else keys
    masked = max(torch.finfo(q.dtype).min, CUDA_MASKED) if aligned else torch.finfo(q.dtype).min
    bias = torch.zeros((*mask.shape[:-1], width), dtype=q.dtype, device=mask.device)
    bias[..., :keys].masked_fill_(~mask, masked)
    bias = bias[..., :keys]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], bias.shape[-1]) if aligned else bias
