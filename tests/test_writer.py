"""The safetensors writer: a tensor written whole or as its row blocks one after another gives the
file safetensors itself writes; blocks that do not make the declared tensor are refused."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_parallel.checkpoint.writer import SafetensorsWriter


def test_row_blocks_make_the_same_file_as_the_whole_tensor(tmp_path):
    tensors = {"a": torch.randn(7, 3), "b": torch.arange(5, dtype=torch.int64), "c": torch.tensor(2.5)}
    whole, blocks = tmp_path / "whole.safetensors", tmp_path / "blocks.safetensors"
    specs = {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()}
    for path, split in ((whole, False), (blocks, True)):
        writer = SafetensorsWriter(str(path), specs)
        for key, tensor in tensors.items():
            writer.write(key, iter([tensor[:3], tensor[3:4], tensor[4:]]) if split and tensor.dim() else tensor)
        writer.close()
    save_file(tensors, tmp_path / "reference.safetensors")
    for path in (whole, blocks):
        loaded = load_file(path)
        assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert whole.read_bytes() == blocks.read_bytes()


@pytest.mark.parametrize(
    "pieces, complaint",
    [
        ([torch.zeros(2, 4)], "(or row blocks of it), got (2, 4)"),  # wrong row width
        ([torch.zeros(2, 3, dtype=torch.float64)], "torch.float64"),
        ([torch.zeros(2, 3), torch.zeros(2, 3)], "got 12 of its 9 elements"),  # too many rows
        ([torch.zeros(2, 3)], "got 6 of its 9 elements"),
    ],
)
def test_blocks_that_do_not_make_the_declared_tensor_are_refused(tmp_path, pieces, complaint):
    writer = SafetensorsWriter(str(tmp_path / "x.safetensors"), {"w": ((3, 3), torch.float32)})
    with pytest.raises(RuntimeError, match="w") as error:
        writer.write("w", iter(pieces))
    assert complaint in str(error.value)
