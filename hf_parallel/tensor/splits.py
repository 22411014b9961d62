"""How a style's sharded dim splits over the tensor-parallel ranks: head-aligned inside attention,
packed blocks (gate|up, q|k|v), grouped q/k/v, interleaved gate/up pairs, stacked experts; as even
as possible elsewhere. Layout arithmetic only: no hooks, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from ..distributed.mesh import Mesh
from .geometry import is_conv1d
from .gradients import GradientSums
from .heads import HeadSplit, in_units
from ..core.layout import Layout, even_sizes, packed, per_rank, sizes_to_ranges

# torch's grouped_mm (transformers' default experts kernel) needs row strides of a multiple of 16
# bytes: stacked expert weights are split in multiples of 8 elements (Mixtral's 14336 over 3 ranks
# would otherwise leave 4778-element rows)
GROUPED_MM_UNIT = 8


@dataclass(frozen=True)
class ShardContext:
    """What a style needs to know beyond the module: the tensor-parallel ranks it splits over (the
    mesh's ``tp`` dimension), head alignment if in attention, and where gradient sums are kept."""

    mesh: Mesh
    heads: HeadSplit | None = None  # set for modules inside an attention block
    kv_group: object | None = None  # ranks holding the same (replicated) KV head as this rank
    unit: int = 1  # split in multiples of this many elements, where the size allows
    gradients: GradientSums | None = None  # the model's one record of which gradients are summed where

    def even_ranges(self, size: int) -> list[tuple[int, int]]:
        """As even as possible, in whole units (when there are enough of them for every rank)."""
        unit = self.unit if size % self.unit == 0 and size // self.unit >= self.size else 1
        return sizes_to_ranges(even_sizes(size // unit, self.size), unit)

    def unaligned(self, unit: int = 1) -> ShardContext:
        """The same ranks, split without regard to heads (an output that is gathered, an input split
        by the layer itself), in multiples of ``unit``."""
        return replace(self, heads=None, unit=unit)

    @property
    def rank(self) -> int:
        """This rank's index in the tensor-parallel group, which every layout is written in."""
        return self.mesh.tp.rank

    @property
    def size(self) -> int:
        return self.mesh.tp.size

    @property
    def group(self):
        return self.mesh.tp.group


def out_dim(module: nn.Module) -> int:
    return 1 if is_conv1d(module) else 0


def in_dim(module: nn.Module) -> int:
    return 0 if is_conv1d(module) else 1


def split_ranges(size: int, ctx: ShardContext, name: str) -> list[tuple[int, int]]:
    """Per-rank ranges of a dim of ``size`` elements.

    Inside attention the split follows whole heads (q, kv, or per-head fused qkv); elsewhere it
    is as even as possible."""
    heads = ctx.heads
    if heads is None:
        return ctx.even_ranges(size)
    hd = heads.head_dim
    if size == heads.num_heads * hd:
        return in_units(heads.q_ranges, hd)
    if heads.gated_query and size == 2 * heads.num_heads * hd:
        return in_units(heads.q_ranges, 2 * hd)  # per-head [q_h | gate_h] (gated attention's q_proj)
    if size == heads.num_heads:  # one value per query head (GPT-OSS attention sinks)
        return list(heads.q_ranges)
    if size == heads.num_kv_heads * hd:
        return in_units(heads.kv_ranges, hd)
    if size == 3 * heads.num_heads * hd and heads.num_heads == heads.num_kv_heads:
        return in_units(heads.q_ranges, 3 * hd)  # per-head fused [q_h k_h v_h] (GPT-NeoX)
    raise ValueError(
        f"{name}: cannot align a dim of {size} to attention heads "
        f"(heads={heads.num_heads}, kv_heads={heads.num_kv_heads}, head_dim={hd})"
    )


def packed_layout(dim: int, size: int, ctx: ShardContext, name: str, num_blocks: int = 2) -> Layout:
    """q|k|v blocks (sizes from the heads) inside attention, else ``num_blocks`` equal blocks."""
    heads = ctx.heads
    if heads is not None and size == (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim:
        hd = heads.head_dim
        q, kv = in_units(heads.q_ranges, hd), in_units(heads.kv_ranges, hd)
        return packed(dim, [heads.num_heads * hd, heads.num_kv_heads * hd, heads.num_kv_heads * hd], [q, kv, kv])
    if size % num_blocks:
        raise ValueError(f"{name}: packed dim of {size} does not split into {num_blocks} equal blocks")
    block = size // num_blocks
    return packed(dim, [block] * num_blocks, [ctx.even_ranges(block)] * num_blocks)


def interleaved_layout(dim: int, size: int, ctx: ShardContext, name: str) -> Layout:
    """[g0 u0 g1 u1 ...] (GPT-OSS's experts take gate = x[..., ::2], up = x[..., 1::2]): each rank
    holds a contiguous run of whole (gate, up) pairs, so the local tensor interleaves the same way."""
    if size % 2:
        raise ValueError(f"{name}: an interleaved gate/up dim of {size} is odd")
    pairs = ctx.even_ranges(size // 2)  # as the down projection splits the intermediate dim
    return per_rank(dim, [(2 * start, 2 * stop) for start, stop in pairs])


def stacked_dims(experts: nn.Module) -> tuple[int, int]:
    """(out, in) dims of a stacked expert weight: [E, out, in], or [E, in, out] for transformers'
    transposed experts (GPT-OSS)."""
    return (2, 1) if getattr(experts, "is_transposed", False) else (1, 2)


def grouped_qkv_layout(dim: int, size: int, ctx: ShardContext, name: str) -> Layout:
    """A fused projection laid out per KV group as [q heads of the group, k, v] (Falcon, and with
    one head per group BLOOM / GPT-NeoX's per-head [q_h k_h v_h]). Each rank takes its query heads
    of each of its groups plus that group's k and v; the local tensor keeps the same grouped form."""
    heads = ctx.heads
    if heads is None or size != (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim:
        raise ValueError(f"{name}: a dim of {size} is not a grouped q/k/v projection of the attention heads")
    group, hd = heads.num_heads // heads.num_kv_heads, heads.head_dim
    ranges = []
    for (q_start, q_stop), (kv_start, kv_stop) in zip(heads.q_ranges, heads.kv_ranges):
        if (q_start, q_stop) == (kv_start * group, kv_stop * group):  # whole groups: one contiguous run
            pieces = [(kv_start * (group + 2), kv_stop * (group + 2))]
        else:  # one KV group shared with other ranks: some of its query heads, then its k and v
            base = kv_start * (group + 2) - kv_start * group
            pieces = [
                (base + q_start, base + q_stop),
                (base + (kv_start + 1) * group, base + (kv_start + 1) * group + 2),
            ]
        ranges.append(tuple((start * hd, stop * hd) for start, stop in pieces))
    return Layout(dim, tuple(ranges), "grouped")


def dim_layout(dim: int, size: int, ctx: ShardContext, name: str, fused_layout) -> Layout:
    """The split of a linear's sharded dim: by the style's fused layout, else head-aligned / even."""
    if fused_layout is not None:
        return fused_layout(dim, size, ctx, name)
    return per_rank(dim, split_ranges(size, ctx, name))
