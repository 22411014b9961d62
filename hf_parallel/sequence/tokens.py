"""Which tokens each sequence-parallel rank holds: one owner for the split, the dry run and ``verify``.

A sequence of S tokens over sp ranks: the first ``S % sp`` ranks one token more, so no padding is
needed; only a sequence shorter than sp is padded (at its end) to one token per rank.
"""

from __future__ import annotations

from ..tensor.layout import even_sizes, sizes_to_ranges


def token_sizes(tokens: int, sp: int) -> tuple[int, ...]:
    """Tokens per rank of a sequence of ``tokens`` (37 over 4: 10, 9, 9, 9; 3 over 4: 1 each, padded)."""
    return tuple(even_sizes(max(tokens, sp), sp))


def token_range(sizes, rank: int) -> tuple[int, int]:
    """``rank``'s (start, stop) in the (padded) sequence."""
    return sizes_to_ranges(sizes)[rank]
