"""Head-aligned splits of attention, computed once from the config and shared by q/k/v/o.

For H query heads in K key/value groups (g = H/K query heads per group) over tp ranks:

- ``tp <= K``: whole groups, as evenly as possible (DeepSpeed's ``K // tp + (r < K % tp)``);
  each rank keeps whole KV heads and all of their query heads.
- ``tp > K``: every rank holds exactly one KV head, replicated over the ranks that share its
  group (vLLM's ``num_kv_head_replicas``, generalised to ``tp`` not divisible by K: groups get
  ``tp // K`` or one more replicas), and the group's query heads are split among those replicas.

No rank is ever left without heads (9 heads / 3 KV groups over 4 ranks gives 2, 1, 3, 3 query
heads), so every rank runs the unmodified attention code and the same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.layout import even_sizes, sizes_to_ranges


@dataclass(frozen=True)
class HeadSplit:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_ranges: tuple[tuple[int, int], ...]  # per rank, in heads
    kv_ranges: tuple[tuple[int, int], ...]  # per rank, in heads (equal ranges: a replicated KV head)
    gated_query: bool = False  # q_proj holds [q_h | gate_h] per head: 2 x head_dim rows a head

    @property
    def world_size(self) -> int:
        return len(self.q_ranges)

    def local_q(self, rank: int) -> int:
        start, stop = self.q_ranges[rank]
        return stop - start

    def local_kv(self, rank: int) -> int:
        start, stop = self.kv_ranges[rank]
        return stop - start

    def kv_replica_groups(self) -> list[list[int]]:
        """Ranks holding the same KV head (more than one: their KV weight gradients must be summed)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for rank, kv in enumerate(self.kv_ranges):
            groups.setdefault(kv, []).append(rank)
        return [ranks for ranks in groups.values() if len(ranks) > 1]


def in_units(ranges, unit: int) -> list[tuple[int, int]]:
    """Head ranges as element ranges, ``unit`` elements per head."""
    return [(start * unit, stop * unit) for start, stop in ranges]


def split_heads(num_heads: int, num_kv_heads: int, head_dim: int, world_size: int) -> HeadSplit:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    if world_size > num_heads:
        raise ValueError(
            f"tp={world_size} exceeds num_attention_heads={num_heads}: every rank needs at least one attention head"
        )
    group = num_heads // num_kv_heads
    if world_size <= num_kv_heads:
        kv_ranges = sizes_to_ranges(even_sizes(num_kv_heads, world_size))
        q_ranges = [(start * group, stop * group) for start, stop in kv_ranges]
        return HeadSplit(num_heads, num_kv_heads, head_dim, tuple(q_ranges), tuple(kv_ranges))
    kv_ranges, q_ranges = [], []
    for kv, replicas in enumerate(even_sizes(world_size, num_kv_heads)):
        for start, stop in sizes_to_ranges(even_sizes(group, replicas)):
            kv_ranges.append((kv, kv + 1))
            q_ranges.append((kv * group + start, kv * group + stop))
    return HeadSplit(num_heads, num_kv_heads, head_dim, tuple(q_ranges), tuple(kv_ranges))
