"""The safetensors writer: a tensor written whole or as its row blocks one after another gives the
file safetensors itself writes; blocks that do not make the declared tensor are refused."""

import os

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


def test_a_tensor_that_is_not_contiguous_is_written_as_its_values(tmp_path):
    """Its contiguous copy is held until its bytes are written (a buffer over a temporary freed first wrote
    the allocator's bookkeeping into the file: a kept quantized weight's scale columns, cut from a row)."""
    tensors = {"columns": torch.randn(40, 50)[:, 7:19], "transposed": torch.randn(30, 20).T, "float8":
               torch.randn(16, 24).to(torch.float8_e4m3fn)[:, 8:]}  # fmt: skip
    path = tmp_path / "strided.safetensors"
    writer = SafetensorsWriter(str(path), {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()})
    for key, tensor in tensors.items():
        writer.write(key, tensor)
    writer.close()
    loaded = load_file(path)
    for key, tensor in tensors.items():
        assert torch.equal(loaded[key].view(torch.uint8), tensor.contiguous().view(torch.uint8)), key


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


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_direct_file_writes_every_byte_across_windows(tmp_path, monkeypatch, direct, where):
    """Window after window through the aligned buffer, the last one padded then cut: the file holds
    exactly the bytes written, straight to the disk (O_DIRECT), through the page cache
    (HF_PARALLEL_DIRECT_IO=0), and on tmpfs (which refuses O_DIRECT before Linux 6.6)."""
    from hf_parallel.checkpoint import writer

    root = tmp_path if where == "disk" else "/dev/shm"
    if not os.path.isdir(root):
        pytest.skip("no /dev/shm")
    monkeypatch.setenv("HF_PARALLEL_DIRECT_IO", direct)
    monkeypatch.setattr(writer, "WINDOW", 3 * writer.ALIGN)
    pieces = [os.urandom(n) for n in (5, 4096, 3 * 4096, 1, 20000, 7)]
    path = os.path.join(str(root), f"hf_parallel-test-direct-{os.getpid()}-{direct}")
    try:
        out = writer.DirectFile(path, size_hint=10**9)
        for piece in pieces:
            out.write(piece)
        out.close()
        assert open(path, "rb").read() == b"".join(pieces)
        if direct == "0":
            assert not out.direct
        elif where == "disk" and hasattr(os, "O_DIRECT"):
            assert out.direct
    finally:
        if os.path.exists(path):
            os.remove(path)


def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    """O_DIRECT accepted at open but refused at the first write (EINVAL, as some file systems do):
    the file is reopened without it and every byte still lands."""
    import errno
    import fcntl

    from hf_parallel.checkpoint import writer

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    real = os.pwrite

    def refusing(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(writer.os, "pwrite", refusing)
    monkeypatch.setattr(writer, "WINDOW", 2 * writer.ALIGN)
    data = os.urandom(3 * writer.ALIGN + 11)
    out = writer.DirectFile(str(tmp_path / "f"), size_hint=len(data))
    out.write(data)
    out.close()
    assert not out.direct and (tmp_path / "f").read_bytes() == data
