"""Head-aligned splits of attention, computed once from the config and shared by q/k/v/o.

Three regimes, for H query heads, K key/value heads and tp ranks:

- ``K % tp == 0``: every rank holds K/tp whole KV groups (and their H/K query heads each).
- ``tp > K`` and ``tp % K == 0``: KV heads are replicated (vLLM's ``num_kv_head_replicas``);
  rank r holds KV head ``r // (tp/K)`` and its share of that group's query heads.
- otherwise: uneven whole groups (DeepSpeed's ``K // tp + (r < K % tp)``); a rank may hold
  none, and then its attention contributes zero (``idle``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import even_sizes, sizes_to_ranges


@dataclass(frozen=True)
class HeadSplit:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_ranges: tuple[tuple[int, int], ...]  # per rank, in heads
    kv_ranges: tuple[tuple[int, int], ...]  # per rank, in heads (may overlap when replicated)

    @property
    def world_size(self) -> int:
        return len(self.q_ranges)

    def local_q(self, rank: int) -> int:
        start, stop = self.q_ranges[rank]
        return stop - start

    def local_kv(self, rank: int) -> int:
        start, stop = self.kv_ranges[rank]
        return stop - start

    def idle(self, rank: int) -> bool:
        return self.local_q(rank) == 0

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 unless KV heads are replicated)."""
        replicated = self.world_size > self.num_kv_heads and self.world_size % self.num_kv_heads == 0
        return self.world_size // self.num_kv_heads if replicated else 1

    def kv_replica_groups(self) -> list[list[int]]:
        """Ranks that hold the same KV head; their KV weight gradients must be summed."""
        groups: dict[tuple[int, int], list[int]] = {}
        for rank, kv in enumerate(self.kv_ranges):
            groups.setdefault(kv, []).append(rank)
        return list(groups.values())


def split_heads(num_heads: int, num_kv_heads: int, head_dim: int, world_size: int) -> HeadSplit:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if world_size > num_kv_heads and world_size % num_kv_heads == 0:
        replicas = world_size // num_kv_heads
        q_in_group = even_sizes(group, replicas)
        kv_ranges, q_ranges = [], []
        for rank in range(world_size):
            kv, replica = divmod(rank, replicas)
            start = kv * group + sum(q_in_group[:replica])
            kv_ranges.append((kv, kv + 1))
            q_ranges.append((start, start + q_in_group[replica]))
        return HeadSplit(num_heads, num_kv_heads, head_dim, tuple(q_ranges), tuple(kv_ranges))
    kv_sizes = even_sizes(num_kv_heads, world_size)
    kv_ranges = sizes_to_ranges(kv_sizes)
    q_ranges = [(start * group, stop * group) for start, stop in kv_ranges]
    return HeadSplit(num_heads, num_kv_heads, head_dim, tuple(q_ranges), tuple(kv_ranges))


def head_split_from_config(config, world_size: int) -> HeadSplit | None:
    """The split for a decoder config, or None when it has no attention heads to align to."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    if not num_heads:
        return None
    num_kv = getattr(text, "num_key_value_heads", None) or num_heads
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    head_dim = getattr(text, "head_dim", None) or hidden // num_heads
    return split_heads(num_heads, num_kv, head_dim, world_size)
