"""Cross-entropy over a vocabulary split by rows on a group (Megatron's vocab-parallel cross-entropy), a chunk of
tokens at a time: TRL's fused LM head (``training/fused_head.py``) and the tiled loss (``sequence/tiled_loss.py``)
score tokens through it.

Each rank computes its rows' logits ``z_r = h W_r^T`` and the softmax statistics are combined over the group:
the max by an all-gather (a constant: it only steadies the exponentials), the sums of ``exp(z - m)`` (and of
``exp(z - m) z`` for the entropy) and the target's logit (held by one rank, zero elsewhere) by all-reduces whose
backward is the identity, and ``h`` enters through ``copy_to``, whose backward sums the ranks' parts of its
gradient. So ``log p(y) = z_y - log sum_v exp(z_v)`` is one process's, gradients included; a rank holds its
rows' logits of one chunk of tokens at a time.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..distributed import comm


def transformed(z: torch.Tensor, logit_scale: float, softcap: float | None, temperature: float = 1.0) -> torch.Tensor:
    """TRL's logits transform: scaled, soft-capped, divided by the temperature."""
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


TOKENS_PER_CHUNK = 1024  # tokens scored at once: their logits ([tokens, V/tp], fp32) are all a rank holds


def vocab_parallel(
    hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
    outputs=("log_probs",), *, group, start: int, vocab: int, tokens_per_chunk: int | None = None,
):  # fmt: skip
    """TRL's ``ChunkedLogProbFunction`` fields (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)
    per token, from this rank's vocabulary rows ``[start, start + len(weight))`` of ``vocab``, computed in the
    dtype TRL computes in (autocast's, else the hidden states'). Tokens go ``tokens_per_chunk`` at a time
    (default ``TOKENS_PER_CHUNK``);
    with gradients, each chunk is recomputed in backward (activation checkpointing), so a rank never holds
    more than one chunk's logits, as TRL's kernel does not."""
    hidden = comm.copy_to(hidden, group)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    score = functools.partial(
        _score, weight=weight.to(dtype), bias=None if bias is None else bias.to(dtype), temperature=temperature,
        softcap=final_logit_softcapping, logit_scale=logit_scale, outputs=outputs, group=group, start=start,
        vocab=vocab,
    )  # fmt: skip
    step = tokens_per_chunk or TOKENS_PER_CHUNK
    recompute = torch.is_grad_enabled() and len(hidden) > step
    parts = []
    for first in range(0, max(len(hidden), 1), step):
        chunk = hidden[first : first + step].to(dtype), targets[first : first + step]
        parts.append(checkpoint(score, *chunk, use_reentrant=False) if recompute else score(*chunk))
    return tuple(None if field[0] is None else torch.cat(field) for field in zip(*parts))


def _score(hidden, targets, *, weight, bias, temperature, softcap, logit_scale, outputs, group, start, vocab):
    """``vocab_parallel`` on one chunk of tokens."""
    size = torch.distributed.get_world_size(group)
    z = transformed(F.linear(hidden, weight, bias).float(), logit_scale, softcap, temperature)
    local = targets - start
    owned = (local >= 0) & (local < z.shape[-1])
    with torch.no_grad():
        m = comm.all_gather(z.amax(-1, keepdim=True), -1, [1] * size, group).amax(-1)
    e = torch.exp(z - m.unsqueeze(-1))
    sum_exp = comm.reduce_from(e.sum(-1), group)
    log_z = m + torch.log(sum_exp)
    target_z = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = comm.reduce_from(torch.where(owned, target_z, torch.zeros_like(target_z)), group)
    log_probs = target_logit - log_z
    entropy = log_sum_sq_probs = mean_logits = is_top1 = None
    if "entropy" in outputs:
        entropy = log_z - comm.reduce_from((e * z).sum(-1), group) / sum_exp
    if "log_sum_sq_probs" in outputs:
        log_sum_sq_probs = (torch.log(comm.reduce_from((e * e).sum(-1), group)) - 2 * torch.log(sum_exp)).detach()
    if "mean_logits" in outputs:
        mean_logits = (comm.reduce_from(z.sum(-1), group) / vocab).detach()
    if "is_top1" in outputs:  # argmax takes the first maximum: a tie with an earlier token is not top-1
        with torch.no_grad():
            before = torch.arange(z.shape[-1], device=z.device) < local.unsqueeze(-1)
            max_before = z.masked_fill(~before, -math.inf).amax(-1, keepdim=True)
            max_before = comm.all_gather(max_before, -1, [1] * size, group).amax(-1)
            is_top1 = (target_logit >= m) & (target_logit > max_before)
    return log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1
