"""Layouts: reading each rank's index and assembling is the identity, for any shape and split."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_parallel.tensor.heads import split_heads
from hf_parallel.core.layout import chunks, even_sizes, packed, per_rank, replicated, sizes_to_ranges


def read(full, layout, rank):
    pieces = [full[index] for index in layout.index(tuple(full.shape), rank)]
    return torch.cat(pieces, dim=layout.dim) if layout.dim is not None else pieces[0]


def gather(shards, layout, full_shape, box):
    """``box`` of the full tensor from the shards, run by run, as the save's ``gather_block`` does."""
    box = tuple(box)
    if layout.dim is None:
        return shards[0][tuple(slice(a, b) for a, b in box)]
    dim, (box_start, box_stop) = layout.dim, box[layout.dim]
    parts = []
    for rank, start, stop, local_start in layout.holders(box_start, box_stop):
        own = box[:dim] + ((local_start, local_start + stop - start),) + box[dim + 1 :]
        parts.append(shards[rank][tuple(slice(a, b) for a, b in own)])
    covered = sum(part.shape[dim] for part in parts)
    assert covered == box_stop - box_start  # the runs tile the box along dim exactly
    return torch.cat(parts, dim) if parts else torch.empty([b - a for a, b in box])


def round_trip(full, layout):
    shards = [read(full, layout, r) for r in range(layout.world_size)]
    for r, shard in enumerate(shards):
        assert tuple(shard.shape) == layout.local_shape(tuple(full.shape), r)
    return gather(shards, layout, tuple(full.shape), [(0, n) for n in full.shape])


shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, world_size=st.integers(1, 5), data=st.data())
def test_chunks_round_trip(shape, world_size, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    full = torch.randn(shape)
    assert torch.equal(round_trip(full, chunks(dim, even_sizes(shape[dim], world_size))), full)


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(st.integers(0, 6), min_size=1, max_size=4), world_size=st.integers(1, 5), rest=st.integers(1, 3))
def test_packed_round_trip(blocks, world_size, rest):
    full = torch.randn(sum(blocks), rest)
    layout = packed(0, blocks, [sizes_to_ranges(even_sizes(b, world_size)) for b in blocks])
    assert torch.equal(round_trip(full, layout), full)
    # every rank's local tensor is its piece of block 0, then of block 1, ...
    for rank in range(world_size):
        expected = []
        offset = 0
        for b in blocks:
            start, stop = sizes_to_ranges(even_sizes(b, world_size))[rank]
            expected.append(full[offset + start : offset + stop])
            offset += b
        assert torch.equal(read(full, layout, rank), torch.cat(expected))


@settings(max_examples=200, deadline=None)
@given(kv=st.integers(1, 8), group=st.integers(1, 4), world_size=st.integers(1, 32), head_dim=st.integers(1, 3))
def test_head_splits_cover_every_head_once_per_group(kv, group, world_size, head_dim):
    if world_size > kv * group:
        return
    split = split_heads(kv * group, kv, head_dim, world_size)
    q = per_rank(0, [(a * head_dim, b * head_dim) for a, b in split.q_ranges])
    k = per_rank(0, [(a * head_dim, b * head_dim) for a, b in split.kv_ranges])
    full_q, full_k = torch.randn(kv * group * head_dim, 2), torch.randn(kv * head_dim, 2)
    assert torch.equal(round_trip(full_q, q), full_q)
    assert torch.equal(round_trip(full_k, k), full_k)
    assert sum(split.local_q(r) for r in range(world_size)) == kv * group  # query heads are never duplicated
    for rank in range(world_size):
        q0, q1 = split.q_ranges[rank]
        k0, k1 = split.kv_ranges[rank]
        assert q1 > q0  # no rank is idle
        assert k0 * group <= q0 and q1 <= k1 * group  # its query heads belong to the KV heads it holds


def test_replicated_round_trip():
    full = torch.randn(3, 4)
    assert torch.equal(round_trip(full, replicated(3)), full)


def test_smollm2_heads_at_tp4_replicate_one_group():
    split = split_heads(9, 3, 64, 4)
    assert [split.local_q(r) for r in range(4)] == [2, 1, 3, 3]
    assert split.kv_ranges == ((0, 1), (0, 1), (1, 2), (2, 3))
    assert split.kv_replica_groups() == [[0, 1]]


def test_uneven_whole_groups_when_tp_does_not_divide_kv_heads():
    split = split_heads(9, 3, 64, 2)
    assert split.q_ranges == ((0, 6), (6, 9)) and split.kv_ranges == ((0, 2), (2, 3))


def test_more_ranks_than_heads_is_a_clear_error():
    import pytest

    with pytest.raises(ValueError, match="tp=5 exceeds num_attention_heads=4"):
        split_heads(4, 2, 8, 5)


def test_kv_heads_replicate_when_tp_exceeds_them():
    split = split_heads(8, 2, 4, 4)
    assert split.kv_ranges == ((0, 1), (0, 1), (1, 2), (1, 2))
    assert split.q_ranges == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert split.kv_replica_groups() == [[0, 1], [2, 3]]


@settings(max_examples=300, deadline=None)
@given(shape=shapes, world_size=st.integers(1, 5), data=st.data())
def test_any_block_of_the_full_tensor_comes_back_from_the_shards(shape, world_size, data):
    """What the save asks for: any box of the full tensor (a row block, one expert), rebuilt from
    each holder's run only, for chunked, packed and head-replicated (overlapping) layouts."""
    dim = data.draw(st.integers(0, len(shape) - 1))
    blocks = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
    shape[dim] = max(shape[dim], world_size) if data.draw(st.booleans()) else sum(blocks)
    size = shape[dim]
    if size == sum(blocks):
        layout = packed(dim, blocks, [sizes_to_ranges(even_sizes(b, world_size)) for b in blocks])
    else:  # every rank a run, neighbours may share their edge elements (replicated KV heads)
        cuts = sizes_to_ranges(even_sizes(size, world_size))
        layout = per_rank(dim, [(max(0, a - data.draw(st.integers(0, 1))), b) for a, b in cuts])
    full = torch.randn(shape)
    shards = [read(full, layout, r) for r in range(world_size)]
    box = []
    for n in shape:
        start = data.draw(st.integers(0, n))
        box.append((start, data.draw(st.integers(start, n))))
    assert torch.equal(gather(shards, layout, tuple(shape), box), full[tuple(slice(a, b) for a, b in box)])


def test_replicated_kv_heads_are_sent_once_by_the_lowest_rank():
    layout = per_rank(0, [(0, 4), (0, 4), (4, 8)])  # two ranks hold KV head 0
    assert layout.holders(0, 8) == [(0, 0, 4, 0), (2, 4, 8, 0)]
    assert layout.holders(2, 6) == [(0, 2, 4, 2), (2, 4, 6, 0)]
    gate_up = packed(0, [4, 4], [[(0, 2), (2, 4)]] * 2)  # gate|up, each split in two
    assert gate_up.holders(1, 7) == [(0, 1, 2, 1), (1, 2, 4, 0), (0, 4, 6, 2), (1, 6, 7, 2)]
