"""The fused kernels one ring-attention chunk pair goes through (``ring.py``): each returns the pair's output and
its log-sum-exp, which the ring's merge needs, and takes the merged output and log-sum-exp back in its backward
(flash attention's), so no pair's scores are ever held.

- ``"cpu"``: torch's fused flash kernel for the CPU (``_scaled_dot_product_flash_attention_for_cpu``), in
  float32, the pair's boolean mask as a float32 bias.
- ``"cuda"``: the memory-efficient kernel (``_scaled_dot_product_efficient_attention``, the one torch's own
  context parallelism calls for pairs with a bias), in the model's dtype (float32 accumulation inside), the
  pair's mask as a bias in that dtype, its rows padded to 16 elements as sdpa pads them; the log-sum-exp it
  returns is padded to 32 queries, and handed back so.
- None: the pair is written out in float32 (``RingPlan.scores``): soft-capping, eager's additive mask over
  padding, a value head narrower or wider than the keys' or a head size the CUDA kernel refuses. It is also
  the tests' reference.

A masked position gets the dtype's finite minimum, not -inf: a query masked from every key of one pair has a
log-sum-exp at that minimum (no weight in the merge), not NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BIAS_ALIGNMENT = 16  # the efficient kernel reads a bias whose rows start at multiples of 16 elements
LSE_ALIGNMENT = 32  # its log-sum-exp covers the queries padded to a multiple of 32


def pair_kernel(device: torch.device, softcap, additive: bool, head_dim: int, value_dim: int) -> str | None:
    """Which kernel a plan's pairs go through (None: written out)."""
    if softcap or additive:
        return None
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and head_dim == value_dim and head_dim % 8 == 0:
        return "cuda"
    return None


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
        grad.to(q.dtype).contiguous(), q, k, v, _bias(mask, q, aligned=True), out.to(q.dtype).contiguous(),
        F.pad(lse, (0, padded - lse.shape[-1])).contiguous(), *rng, 0.0, (True, True, True, False), causal,
        scale=scale,
    )  # fmt: skip
    return d_q.float(), d_k.float(), d_v.float()


def _bias(mask: torch.Tensor | None, q: torch.Tensor, aligned: bool) -> torch.Tensor | None:
    """A pair's mask ``[b or 1, 1, c, keys]`` as the kernel's additive bias in ``q``'s dtype: zero where allowed,
    the dtype's finite minimum where masked (an additive mask as it is); ``aligned``: rows padded to
    ``BIAS_ALIGNMENT`` elements and the bias expanded over ``q``'s batch and heads (the efficient kernel's)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        bias = mask.to(q.dtype)
    else:
        keys = mask.shape[-1]
        width = -(-keys // BIAS_ALIGNMENT) * BIAS_ALIGNMENT if aligned else keys
        bias = torch.zeros((*mask.shape[:-1], width), dtype=q.dtype, device=mask.device)
        bias[..., :keys].masked_fill_(~mask, torch.finfo(q.dtype).min)
        bias = bias[..., :keys]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], bias.shape[-1]) if aligned else bias
