"""The loader's own weight copies are advised onto transparent huge pages (mmap views never are)."""

import os
import sys

import pytest
import torch

import hf_parallel
from hf_parallel.checkpoint import hugepages

THP = "/sys/kernel/mm/transparent_hugepage/enabled"
pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not os.path.exists(THP) or "[never]" in open(THP).read(),
    reason="needs Linux with transparent huge pages enabled",
)


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (``hg``: MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, stop = (int(x, 16) for x in head.split("-"))
                inside = start <= address < stop
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise LookupError(hex(address))


def interior(tensor: torch.Tensor) -> int:
    """An address inside the tensor's first whole 2 MiB page."""
    return -tensor.data_ptr() % hugepages.HUGE_PAGE + tensor.data_ptr()


def test_large_owned_tensors_are_advised_and_stay_plain_tensors():
    big = hugepages.empty((3, 1 << 20), torch.float32, torch.device("cpu"))
    assert big.shape == (3, 1 << 20) and big.dtype == torch.float32 and big.is_contiguous()
    assert "hg" in vm_flags(interior(big))
    big.fill_(2.5)
    assert float(big.sum()) == 2.5 * 3 * (1 << 20)
    small = hugepages.empty((7,), torch.int64, torch.device("cpu"))  # no whole huge page inside: left alone
    assert small.shape == (7,)


def test_the_loader_advises_its_copies_not_its_views(tmp_path):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    as_is = hf_parallel.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    cast = hf_parallel.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    view, copy = as_is.lm_head.weight, cast.lm_head.weight  # 8 MiB in the file; the bf16 one is a copy
    assert "hg" not in vm_flags(interior(view))  # the safetensors mapping of the file, untouched
    assert "hg" in vm_flags(interior(copy))
    assert torch.equal(copy, view.to(torch.bfloat16))
