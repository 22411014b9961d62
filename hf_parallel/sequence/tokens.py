"""Which tokens each rank of the sequence group holds: one owner for the split, the dry run and ``verify``.

Ulysses alone (``cp == 1``): a sequence of S tokens over sp ranks, the first ``S % sp`` ranks one token
more, so no padding is needed; only a sequence shorter than sp is padded (at its end) to one token per rank.

With a ring of ``cp`` Ulysses groups (context parallelism), causal attention would leave the first
group idle while the last one attends to everything; so the (padded) sequence is cut into ``2 cp``
equal chunks and group ``g`` holds chunks ``g`` and ``2 cp - 1 - g`` (zigzag, as ring-flash-attention
and Megatron balance it): every group then does the same attention work. The sequence is padded at
its end to a multiple of ``2 cp`` chunks of at least one token per Ulysses rank; within a group its
two chunks are split over the Ulysses ranks as above. The groups' chunks in group order
(``TokenLayout.chunks_of``) are the permutation that puts the sequence in the ranks' order
(``shard.SequenceSplit.call`` makes it on the device); everything per token (hidden states,
positions, labels) follows it, and gathered outputs are put back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.layout import even_sizes, sizes_to_ranges


@dataclass(frozen=True)
class TokenLayout:
    """One sequence length's split over the sequence group (``cp`` groups of ``ulysses`` ranks, cp-major)."""

    tokens: int  # the real sequence length
    sizes: tuple[int, ...]  # tokens per rank of the sequence group, in group order
    cp: int = 1
    chunk: int = 0  # tokens per zigzag chunk (cp > 1)

    @property
    def length(self) -> int:
        """The padded length (padding at the end)."""
        return sum(self.sizes)

    def chunks_of(self, group: int) -> tuple[int, int]:
        """The two zigzag chunks ring group ``group`` holds, in the order it holds them."""
        return group, 2 * self.cp - 1 - group


def token_layout(tokens: int, ulysses: int, cp: int = 1) -> TokenLayout:
    """The split of ``tokens`` over ``cp`` groups of ``ulysses`` ranks (37 over Ulysses 4: 10, 9, 9, 9;
    37 over cp 2: padded to 40, chunks of 10, group 0 holds positions 0-9 and 30-39)."""
    if cp == 1:
        return TokenLayout(tokens, token_sizes(tokens, ulysses))
    chunks = 2 * cp
    chunk = -(-max(tokens, cp * ulysses) // chunks)  # two chunks per group hold at least one token per rank
    return TokenLayout(tokens, tuple(even_sizes(2 * chunk, ulysses)) * cp, cp, chunk)


def token_sizes(tokens: int, sp: int) -> tuple[int, ...]:
    """Tokens per rank of a sequence of ``tokens`` (37 over 4: 10, 9, 9, 9; 3 over 4: 1 each, padded)."""
    return tuple(even_sizes(max(tokens, sp), sp))


def token_range(sizes, rank: int) -> tuple[int, int]:
    """``rank``'s (start, stop) in the (padded, reordered) sequence."""
    return sizes_to_ranges(sizes)[rank]
