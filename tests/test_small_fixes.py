"""Keywords transformers users pass, and the embedded default converted once when ranks ask at once."""

import os
import subprocess
import sys

import pytest

import hf_parallel


def test_unknown_from_pretrained_keywords_are_refused_by_name(tiny_paths):
    with pytest.raises(TypeError, match=r"does not define: context_parallel_size\. hf_parallel takes tp_plan"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], context_parallel_size=2)
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], rms_norm_eps=1e-3)
    assert model.config.rms_norm_eps == 1e-3  # a config attribute still overrides the checkpoint's


@pytest.mark.parametrize(
    "keywords, complaint",
    [
        (dict(push_to_hub=True), r"save_pretrained\(push_to_hub=...\): hf_parallel writes to disk only"),
        (dict(state_dict={}), r"save_pretrained\(state_dict=...\): hf_parallel saves the model's own shards"),
        (dict(safe_serialization=False), "writes safetensors only"),
        (dict(colour="blue"), "unexpected keyword argument 'colour'"),
    ],
)
def test_save_keywords_that_mean_nothing_here_are_refused_before_writing(tiny_paths, tmp_path, keywords, complaint):
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"])
    with pytest.raises(TypeError, match=complaint):
        model.save_pretrained(str(tmp_path / "out"), **keywords)
    assert not (tmp_path / "out").exists()


def test_transformers_save_keywords_that_make_sense_are_accepted(tiny_paths, tmp_path):
    from checks import assert_same_checkpoint

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"])
    model.save_pretrained(str(tmp_path), is_main_process=True, safe_serialization=True, save_original_format=True)
    assert_same_checkpoint(tiny_paths["llama"], str(tmp_path))


@pytest.mark.distributed
@pytest.mark.slow
def test_the_default_model_is_converted_once_when_ranks_ask_at_once(tmp_path):
    env = {**os.environ, "HF_PARALLEL_CACHE": str(tmp_path)}
    code = "from hf_parallel.commands.default_model import default_checkpoint; print(default_checkpoint())"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    assert sum(err.count("converting the embedded SmolLM2") for _, err in outputs) == 1, outputs
    assert {out.strip() for out, _ in outputs} == {str(tmp_path / "smollm2-135m-instruct")}
    assert os.path.isfile(tmp_path / "smollm2-135m-instruct" / "model.safetensors")
