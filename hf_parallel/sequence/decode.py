"""Decoding under sequence and context parallelism: the KV cache stays split over the sequence group.

The prompt's forward (prefill) runs split as any forward: each rank's attention modules write their own
tokens' keys and values (every head tensor parallelism left the rank) into the rank's ``SequenceCache``,
before the Ulysses all-to-all. Each decode step then runs whole on every rank: the new tokens are few, so
they are not split, and no all-to-all runs. Their keys and values go into one rank's cache (the ranks take
turns, step by step), and attention is flash-decoding over the group (``decode_attention``): each rank
attends the new queries to the keys it holds and gives a partial output with its log-sum-exp; the
partials, gathered, merge exactly as ring attention's do (``ring.merge``), and attention sinks enter once.

Memory: the cache is split over the group (the prompt's S / (sp x cp) tokens per rank, and its share of
the new ones); no rank holds the whole. Per step and layer: one all-gather of ``[batch, heads, new,
head_dim + 1]``. The model builds its own mask for the new tokens' rows over every position
(``[batch, 1, new, S]``: padding, sliding windows), which each rank reads at the positions it holds.
"""

from __future__ import annotations

import contextlib

import torch

from ..compat.transformers import dynamic_cache_class
from ..distributed import comm
from .ring import MASKED, _allowed, merge, with_sinks
from .tokens import token_range

NOWHERE = 2**62  # the position of a padding token the prefill held: after every query, so never attended


class SequenceCache(dynamic_cache_class()):
    """transformers' ``DynamicCache`` of one rank of the sequence group: the keys and values of the
    positions it holds (``positions``, on the device). Its lengths are the whole sequence's, as the model
    and ``generate`` read them (positions, mask sizes)."""

    def __init__(self, split):
        super().__init__()
        self.split = split
        self.length = 0  # tokens of the whole sequence seen before the forward in progress
        self.steps = 0  # decode steps run (whose turn it is to keep the new keys)
        self.positions: torch.Tensor | None = None  # [held]: the global position of each held key
        self.broken: str | None = None  # why a forward failed part-way (some layers updated, not others)

    @property
    def decoding(self) -> bool:
        """The next forward decodes (a prompt is cached): it runs whole, the cache's attention is gathered."""
        return self.length > 0

    @property
    def holds_new_tokens(self) -> bool:
        """Whether this rank's cache takes the keys of the decode step in progress (turn by turn)."""
        return self.steps % self.split.size == self.split.rank

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length + query_length, 0

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Prefill: this rank's tokens' keys and values, kept. Decode: kept only on the rank whose turn it is;
        every rank returns what it holds."""
        if self.broken:
            raise RuntimeError(f"this sequence-parallel KV cache is unusable: a forward failed part-way "
                               f"({self.broken}); start generation again")
        if not self.decoding or self.holds_new_tokens:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        return layer.keys, layer.values

    def crop(self, max_length: int):
        raise NotImplementedError(
            "a sequence-parallel KV cache cannot be cropped (assisted or speculative decoding): each rank holds "
            "other positions; generate without an assistant"
        )

    @contextlib.contextmanager
    def forward(self, sequence, tokens: int):
        """Around one forward of ``tokens`` tokens (``sequence``: its ``SequenceCall``, whose layout places a
        prefill's tokens): the positions held once the forward's keys are in, then the lengths moved on. A
        forward that fails part-way leaves the cache unusable, said so by name at its next use."""
        device = self.split.device
        decoding = self.decoding
        if not decoding:
            order = torch.arange(sequence.layout.length, device=device)
            if sequence.order is not None:
                order = order.index_select(0, sequence.order)
            start, stop = token_range(sequence.sizes, self.split.rank)
            held = order[start:stop]
            self.positions = torch.where(held < tokens, held, NOWHERE)
        elif self.holds_new_tokens:
            self.positions = torch.cat([self.positions, torch.arange(tokens, device=device) + self.length])
        try:
            yield
        except BaseException as error:
            self.broken = f"{type(error).__name__}: {error}"[:200]
            raise
        self.length += tokens
        self.steps += 1 if decoding else 0


def decode_attention(module, query, key, value, attention_mask, cache: SequenceCache, **kwargs):
    """``query [b, h, n, d]``: the new tokens' queries (every head the rank's module has, the same on every
    rank of the group); ``key``/``value [b, hk, held, d]``: this rank's cache (values may be narrower: MLA).
    The attention of the new tokens to every position, as one process computes it: this rank's partial,
    then all of them merged. Returns ``[b, n, h, d]``, as transformers' attention functions do."""
    group, size = cache.split.group, cache.split.size
    scale = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    b, h, n, d = query.shape
    kv_heads = key.shape[1]  # each key/value head serves h / kv_heads query heads: grouped, not repeated
    grouped = query.float().reshape(b, kv_heads, h // kv_heads * n, d)
    scores = (torch.matmul(grouped, key.float().transpose(-1, -2)) * scale).view(b, kv_heads, h // kv_heads, n, -1)
    if kwargs.get("softcap"):
        scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
    scores = scores.masked_fill(~_allowed_keys(attention_mask, cache, n).unsqueeze(1), MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).view(b, kv_heads, h // kv_heads * n, -1)
    out, lse = torch.matmul(weights, value.float()).view(b, h, n, value.shape[-1]), lse.view(b, h, n)
    partials = comm.all_gather(torch.cat([out, lse.unsqueeze(-1)], -1).unsqueeze(0), 0, [1] * size, group)
    out, lse = None, None
    for partial in partials:
        out, lse = merge(out, lse, partial[..., :-1], partial[..., -1])
    if kwargs.get("s_aux") is not None:
        out, lse = with_sinks(out, lse, kwargs["s_aux"])
    return out.transpose(1, 2).to(query.dtype)


def _allowed_keys(mask, cache: SequenceCache, queries: int) -> torch.Tensor:
    """``[b or 1, 1, n, held]``: which of the held keys each new query may see: at or before its position
    (never a padding token of the prefill), and what the model's mask over every position allows there."""
    query_positions = torch.arange(queries, device=cache.positions.device) + cache.length
    allowed = cache.positions.view(1, 1, 1, -1) <= query_positions.view(1, 1, -1, 1)
    if mask is None:
        return allowed
    columns = cache.positions.clamp(max=mask.shape[-1] - 1)
    return allowed & _allowed(mask.index_select(-1, columns))
