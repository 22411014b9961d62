"""Ulysses attention: around the model's own attention function, an all-to-all trades the sequence
split for a head split and back, through transformers' attention registry (no model code patched).

Each rank enters with ``[batch, heads, seq/sp, dim]`` (its tokens, every head TP left it) and the
configured function (sdpa, eager, ...) runs on ``[batch, heads/sp, seq, dim]``: all tokens, a
slice of the heads, with the mask the model built for the whole sequence. Heads need not divide:
the first ``heads % sp`` ranks take one more query head. Key/value heads follow their query heads:
when both counts divide by sp each rank takes whole groups as they are; otherwise each rank
receives, for every one of its query heads, that head's key/value head (replicated where ranks
share a group), and its attention runs with one query head per key/value head: the module's
``num_key_value_groups`` is 1 for that inner call alone, and restored after it (a module without one,
GPT-2's, repeats nothing anyway). Attention sinks (gpt-oss's one logit per head, ``s_aux``) follow
their heads: each rank computes with its heads' sinks.

Under context parallelism the all-to-all runs inside each Ulysses group (adjacent ranks), and the
attention over the group's tokens and every other group's is ``ring.py``'s instead of the configured
function; the model's masks are then built under this name too, as descriptions (``masks.py``).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..compat.transformers import attention_function, register_attention, register_mask
from ..core.context import current_call
from ..distributed import comm
from ..core.layout import even_sizes, sizes_to_ranges
from .decode import decode_attention
from .masks import describe_mask
from .ring import ring_attention

NAME = "hf_parallel_ulysses"


@dataclass(frozen=True)
class HeadSpread:
    """How one attention's local heads spread over the sequence-parallel ranks."""

    q_sizes: tuple[int, ...]  # query heads per SP rank
    kv_sizes: tuple[int, ...]  # key/value heads each SP rank receives
    kv_repeat: int | None  # None: whole groups; else each key/value head is sent once per query head of its group


@lru_cache(maxsize=None)
def head_spread(num_heads: int, num_kv_heads: int, sp: int) -> HeadSpread:
    q_sizes = tuple(even_sizes(num_heads, sp))
    if num_heads % sp == 0 and num_kv_heads % sp == 0:
        return HeadSpread(q_sizes, tuple(even_sizes(num_kv_heads, sp)), None)
    return HeadSpread(q_sizes, q_sizes, num_heads // num_kv_heads)


def _inner_function(module, name: str):
    if name == "eager":  # the model's own eager function (Gemma 2's soft-capping, ...)
        return sys.modules[type(module).__module__].eager_attention_forward
    return attention_function(name)


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """Registered as ``hf_parallel_ulysses``: the call's token split comes from its context."""
    sequence = current_call().sequence
    if sequence.decoding:  # the new tokens whole on every rank, against the KV cache split over the group
        return decode_attention(module, query, key, value, attention_mask, sequence.cache, **kwargs), None
    ulysses = sequence.split.ulysses
    group, seq = ulysses.group, sequence.sizes[: ulysses.size]  # every Ulysses group's ranks hold the same sizes
    spread = head_spread(query.shape[1], key.shape[1], len(seq))
    query = comm.all_to_all(query, 1, 2, spread.q_sizes, seq, group)
    if spread.kv_repeat is not None:  # one key/value head per query head is sent (an int repeat: expand, no index)
        key, value = key.repeat_interleave(spread.kv_repeat, 1), value.repeat_interleave(spread.kv_repeat, 1)
    key = comm.all_to_all(key, 1, 2, spread.kv_sizes, seq, group)
    value = comm.all_to_all(value, 1, 2, spread.kv_sizes, seq, group)
    if sequence.split.cp is not None:  # context parallelism: this group's tokens against every group's
        heads = sizes_to_ranges(spread.q_sizes)[ulysses.rank]
        out = ring_attention(module, query, key, value, attention_mask, sequence, heads, **kwargs)
        return comm.all_to_all(out, 1, 2, seq, spread.q_sizes, group), None
    if attention_mask is not None and attention_mask.shape[-1] < query.shape[2]:
        attention_mask = _mask_padding(attention_mask, query.shape[2])
    inner = _inner_function(module, sequence.split.inner)
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # attention sinks (gpt-oss: one logit per head): this rank's heads' own
        start, stop = sizes_to_ranges(spread.q_sizes)[ulysses.rank]
        kwargs = {**kwargs, "s_aux": sinks[start:stop]}
    with _for_these_heads(module, spread.kv_repeat is not None, sinks, kwargs.get("s_aux")):
        out, _ = inner(module, query, key, value, attention_mask, **kwargs)
    # [batch, seq, heads/sp, dim] -> [batch, seq/sp, heads, dim]; attention weights stay with the heads' ranks
    return comm.all_to_all(out, 1, 2, seq, spread.q_sizes, group), None


@contextlib.contextmanager
def _for_these_heads(module, one_per_group: bool, sinks, own_sinks):
    """For the inner call alone, ``module`` as the rank's slice of heads sees it: one query head per key/value
    head (``one_per_group``: its ``num_key_value_groups`` is 1), and the rank's own sinks where the model's
    attention function reads them from the module rather than from ``s_aux`` (gpt-oss's eager). Set and
    restored: torch.compile traces this, not a copy of the module."""
    groups = getattr(module, "num_key_value_groups", None) if one_per_group else None
    held = [name for name, param in module._parameters.items() if sinks is not None and param is sinks]
    try:
        if groups is not None:
            module.num_key_value_groups = 1
        for name in held:  # a view of the parameter, so its gradient reaches it (summed over the group as any)
            module._parameters[name] = own_sinks
        yield
    finally:
        if groups is not None:
            module.num_key_value_groups = groups
        for name in held:
            module._parameters[name] = sinks


def _mask_padding(mask: torch.Tensor, length: int) -> torch.Tensor:
    """A [.., queries, keys] mask for a sequence padded at its end to ``length``: no real token
    attends to padding; padding tokens attend to everything (their rows are dropped later)."""
    allow, block = (True, False) if mask.dtype == torch.bool else (0.0, torch.finfo(mask.dtype).min)
    real = mask.shape[-1]
    padded = torch.nn.functional.pad(mask, (0, length - real, 0, length - mask.shape[-2]), value=allow)
    padded[..., : mask.shape[-2], real:] = block
    return padded


register_attention(NAME, ulysses_attention)
register_mask(NAME, describe_mask)  # built under context parallelism alone (``SequenceSplit.masks``)
