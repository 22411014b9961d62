"""The real SmolLM2-135M-Instruct (9 heads / 3 KV heads): same greedy tokens at every TP size."""

import os

import pytest
import torch
import tp_workers
from checks import assert_same_checkpoint
from distributed import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def reference_tokens(smollm2):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    ids = tokenizer.apply_chat_template(
        tp_workers.PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_generates_the_same_tokens_as_transformers(smollm2, reference_tokens, world_size, tmp_path):
    save_dir = str(tmp_path / "saved") if world_size == 2 else None
    ranks = run_ranks(
        world_size, tp_workers.generate_tokens, smollm2, NEW_TOKENS, save_dir, out_dir=str(tmp_path / "results")
    )
    assert len(reference_tokens) == NEW_TOKENS
    for rank, result in enumerate(ranks):
        assert result["tokens"] == reference_tokens, f"rank {rank} generated other tokens"
    full_bytes = os.path.getsize(os.path.join(smollm2, "model.safetensors"))
    if world_size > 1:  # each rank holds roughly its share, not the model (norms stay replicated)
        for result in ranks:
            assert result["local_bytes"] < full_bytes / world_size * 1.1
    if save_dir is not None:
        assert_same_checkpoint(smollm2, save_dir)
