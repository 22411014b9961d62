"""Training state as tiles: every rank's boxes place its local tensor (TP pieces, FSDP's rows of
them) in the full tensor exactly, for any split; so any layout reads back exactly its pieces."""

import itertools
import os
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from hf_parallel.compat.torch import fsdp_rows
from hf_parallel.core.layout import as_slices, chunks, even_sizes, packed, per_rank, sizes_to_ranges
from hf_parallel.training.state_tiles import _segments


class FsdpShard:
    """What ``_segments`` reads of FSDP's DTensor: the TP shard's shape, its placement, and this rank's rows along
    the placement's dim (0; experts with fewer rows than ranks: 1)."""

    def __init__(self, tp_shard: torch.Tensor, rank: int, size: int, dim: int = 0):
        chunk = -(-tp_shard.shape[dim] // size)
        self.shape, self.placements = tp_shard.shape, (SimpleNamespace(dim=dim),)
        start = min(rank * chunk, tp_shard.shape[dim])
        self.rows = tp_shard.narrow(dim, start, min(chunk, tp_shard.shape[dim] - start))

    def to_local(self):
        return self.rows


def layouts(shape, world_size, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    kind = data.draw(st.sampled_from(["chunks", "packed", "replicated_heads"]))
    if kind == "chunks":
        return chunks(dim, even_sizes(shape[dim], world_size))
    if kind == "packed":  # two blocks (gate|up) of shape[dim] // 2 and the rest
        blocks = [shape[dim] // 2, shape[dim] - shape[dim] // 2]
        return packed(dim, blocks, [sizes_to_ranges(even_sizes(b, world_size)) for b in blocks])
    pieces = sizes_to_ranges(even_sizes(shape[dim], max(1, world_size // 2)))  # each piece on two ranks
    return per_rank(dim, [pieces[rank * len(pieces) // world_size] for rank in range(world_size)])


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), tp=st.integers(1, 4), fsdp=st.integers(1, 3),
       data=st.data())  # fmt: skip
def test_each_ranks_boxes_place_its_local_tensor_in_the_full_one(shape, tp, fsdp, data):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    layout = layouts(shape, tp, data)
    dim = data.draw(st.integers(0, min(1, len(shape) - 1)))  # the dim FSDP shards along
    for tp_rank in range(tp):
        tp_shard = layout.extract(full, tp_rank)
        for fsdp_rank in range(fsdp):
            param = FsdpShard(tp_shard, fsdp_rank, fsdp, dim) if fsdp > 1 else tp_shard
            local = param.to_local() if fsdp > 1 else tp_shard
            assert local.shape[dim] == len(range(*fsdp_rows(tp_shard.shape[dim], local.shape[dim], fsdp_rank, fsdp)
                                                 .indices(tp_shard.shape[dim])))  # fmt: skip
            mesh = {"tp": SimpleNamespace(rank=tp_rank), "fsdp": SimpleNamespace(rank=fsdp_rank, size=fsdp)}
            covered = torch.zeros(local.shape, dtype=torch.int64)
            for runs in itertools.product(*_segments(param, SimpleNamespace(layout=layout), mesh)):
                full_box = tuple((f, f + n) for f, _, n in runs)
                local_box = tuple((at, at + n) for _, at, n in runs)
                assert torch.equal(full[as_slices(full_box)], local[as_slices(local_box)])
                covered[as_slices(local_box)] += 1
            assert bool((covered == 1).all()), covered


@pytest.fixture(scope="module")
def llama(tiny_root):
    from tiny_models import make_checkpoint

    return make_checkpoint("llama", tiny_root)


def _trained(path: str, optimizer_class, steps: int = 2):
    import hf_parallel
    from training_workers import training_batch

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    for step in range(steps):
        model(**training_batch(model.config.vocab_size, step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_training_state_comes_back_bit_for_bit(llama, tmp_path):
    """One safetensors file a rank (no pickle); a fresh model and optimizer read back every bit."""
    from hf_parallel import load_training_state, save_training_state

    model, optimizer = _trained(llama, torch.optim.AdamW)
    save_training_state(model, optimizer, str(tmp_path))
    assert os.listdir(tmp_path) == ["training-state-rank-00000-of-00001.safetensors"]
    fresh, fresh_optimizer = _trained(llama, torch.optim.AdamW, steps=0)
    load_training_state(fresh, fresh_optimizer, str(tmp_path))
    for (name, want), got in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(want, got), name
    want, got = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert want["param_groups"] == got["param_groups"] and want["state"].keys() == got["state"].keys()
    for index, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, got["state"][index][key]), (index, key)


def test_what_cannot_be_resharded_is_refused_naming_both_layouts(llama, tmp_path):
    """Adafactor's factored moments have shapes of their own: they resume at the layout that wrote
    them (here, bit for bit), and elsewhere are refused naming both layouts; other trainable
    parameters than the checkpoint's are refused by name."""
    from safetensors.torch import load_file, save_file

    from hf_parallel import load_training_state, save_training_state
    from hf_parallel.checkpoint.training_state import LAYOUT_KEY, StateError, written_layout

    model, optimizer = _trained(llama, torch.optim.Adafactor)
    save_training_state(model, optimizer, str(tmp_path))
    here = written_layout(str(tmp_path))
    fresh, fresh_optimizer = _trained(llama, torch.optim.Adafactor, steps=0)
    load_training_state(fresh, fresh_optimizer, str(tmp_path))
    want, got = optimizer.state_dict()["state"][0], fresh_optimizer.state_dict()["state"][0]
    assert torch.equal(got["row_var"], want["row_var"])
    (file,) = [os.path.join(tmp_path, name) for name in os.listdir(tmp_path)]
    with safe_open(file, "pt") as handle:
        metadata = handle.metadata()
    save_file(load_file(file), file, metadata={**metadata, LAYOUT_KEY: "tp=2 x fsdp=2"})  # as if written there
    with pytest.raises(StateError, match=r"'row_var'.*written at tp=2 x fsdp=2 cannot be resharded to this model's "
                       + re.escape(here)):  # fmt: skip
        load_training_state(fresh, fresh_optimizer, str(tmp_path))
    frozen, frozen_optimizer = _trained(llama, torch.optim.Adafactor, steps=0)
    frozen.lm_head.weight.requires_grad_(False)
    with pytest.raises(StateError, match=r"not in the model: lm_head\.weight"):
        load_training_state(frozen, None, str(tmp_path))


def test_consolidate_writes_the_optimizer_state_one_process_would_save(llama, tmp_path):
    """``hf-parallel consolidate`` of a checkpoint's training state: transformers' optimizer.pt, equal to
    the optimizer's own ``state_dict()``; into another directory only (in place is refused)."""
    from hf_parallel import consolidate, save_training_state

    model, optimizer = _trained(llama, torch.optim.AdamW)
    checkpoint, out = str(tmp_path / "checkpoint-2"), str(tmp_path / "out")
    save_training_state(model, optimizer, checkpoint)
    model.save_pretrained(checkpoint)
    consolidate(checkpoint, out, progress=False)
    assert "optimizer.pt" in os.listdir(out) and not [f for f in os.listdir(out) if f.startswith("training-state")]
    written, want = torch.load(os.path.join(out, "optimizer.pt"), weights_only=True), optimizer.state_dict()
    assert written["param_groups"] == want["param_groups"] and written["state"].keys() == want["state"].keys()
    for index, entry in want["state"].items():
        assert entry.keys() == written["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(value, written["state"][index][key]), (index, key)
    with pytest.raises(ValueError, match="not in place"):
        consolidate(checkpoint, checkpoint, progress=False)


def test_python_numbers_in_optimizer_state_come_back(llama, tmp_path):
    """transformers' Adafactor counts its steps in Python ints: kept as numbers, read back as numbers."""
    from transformers.optimization import Adafactor

    from hf_parallel import load_training_state, save_training_state

    def adafactor(params, lr):
        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)

    model, optimizer = _trained(llama, adafactor)
    assert isinstance(optimizer.state_dict()["state"][0]["step"], int)
    save_training_state(model, optimizer, str(tmp_path))
    fresh, fresh_optimizer = _trained(llama, adafactor, steps=0)
    load_training_state(fresh, fresh_optimizer, str(tmp_path))
    want, got = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert want.keys() == got.keys()
    for index, entry in want.items():
        for key, value in entry.items():
            same = torch.equal(value, got[index][key]) if isinstance(value, torch.Tensor) else value == got[index][key]
            assert same and type(value) is type(got[index][key]), (index, key)
