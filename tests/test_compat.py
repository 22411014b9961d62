"""The dependency boundary (``hf_parallel/compat``): every internal hf_parallel uses is checked, a missing
or changed one fails loudly naming the dependency and versions, and seams go in when their library is
imported, in whatever order."""

import subprocess
import sys
import textwrap
import time

import pytest

from hf_parallel import compat
from hf_parallel.compat import DependencyChanged, Seam


def test_every_internal_of_the_installed_dependencies_checks_in_under_a_second():
    compat.check_all()  # first: the dependencies' own imports (the Trainer's is seconds), not timed
    compat._RESOLVED.clear()
    start = time.perf_counter()
    checked = compat.check_all()
    assert time.perf_counter() - start < 1.0
    assert {seam.dependency for seam in checked} == {"transformers", "peft", "accelerate", "torch", "trl", "triton"}
    # each module that touches an internal goes through a seam of its dependency
    wheres = {seam.where for seam in checked}
    for expected in (
        "transformers.trainer:Trainer._clip_grad_norm",
        "transformers.core_model_loading:rename_source_key",
        "transformers.integrations.moe:grouped_mm_experts_forward",
        "peft.tuners.lora.layer:LoraLayer.update_layer",
        "accelerate.accelerator:Accelerator.prepare_data_loader",
        "trl.trainer.utils:add_fused_lm_head",
        "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_unsharded_param",
        "triton.compiler.compiler:CompiledKernel.__getitem__",
    ):
        assert expected in wheres, expected


@pytest.mark.parametrize(
    "seam, complaint",
    [
        (Seam("transformers", "transformers.trainer:Trainer._clip_grad_norm_renamed", "(clipping)"),
         "is gone (no '_clip_grad_norm_renamed')"),
        (Seam("transformers", "transformers.no_such_module:thing", "(x)"), "cannot be imported"),
        (Seam("peft", "peft.tuners.lora.layer:LoraLayer.update_layer", "(x)", parameters=("adapter_name", "rank")),
         "no longer takes rank"),
        (Seam("transformers", "transformers.trainer:Trainer._clip_grad_norm", "(x)", reads=("_our_flag",)),
         "no longer reads _our_flag"),
    ],
)  # fmt: skip
def test_a_changed_internal_fails_naming_dependency_versions_and_place(seam, complaint):
    import transformers

    with pytest.raises(DependencyChanged) as error:
        seam.get()
    message = str(error.value)
    assert complaint in message
    assert seam.where in message
    installed = transformers.__version__ if seam.dependency == "transformers" else compat.installed_version("peft")
    assert f"{seam.dependency} {installed}:" in message
    assert f"tested with {seam.dependency} {compat.TESTED[seam.dependency]}.*" in message


def test_a_replaced_trainer_step_that_is_gone_fails_instead_of_being_skipped():
    from hf_parallel.training import trainer as seams

    class Trainer:  # a Trainer whose release renamed the step
        pass

    missing = Seam("transformers", "transformers.trainer:Trainer._a_step_renamed_away", "(x)")
    with pytest.raises(DependencyChanged, match="is gone"):
        seams._replace_step(Trainer, missing, lambda self: None)


def test_pinned_versions_are_the_tested_ones():
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("no source tree beside the tests")
    project = tomllib.loads(pyproject.read_text())["project"]
    specs = project["dependencies"] + [s for extra in project["optional-dependencies"].values() for s in extra]
    for dependency, tested in compat.TESTED.items():
        major, minor = tested.split(".")
        spec = next(s for s in specs if s.split("[")[0].split(">")[0].split("=")[0].strip() == dependency)
        assert f">={tested}" in spec and f"<{major}.{int(minor) + 1}" in spec, spec


def _fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def test_a_seam_goes_in_when_its_module_is_first_imported(tmp_path):
    (tmp_path / "late_dependency.py").write_text("VALUE = 1\n")
    (tmp_path / "changed_dependency.py").write_text("VALUE = 1\n")
    out = _fresh(f"""
        import importlib.util, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from hf_parallel.compat import DependencyChanged, Seam, when_imported
        seen = []
        when_imported("late_dependency", lambda: seen.append(sys.modules["late_dependency"].VALUE))
        assert importlib.util.find_spec("late_dependency") is not None and seen == []  # found, not imported
        import late_dependency
        when_imported("late_dependency", lambda: seen.append(2))  # already imported: at once
        gone = Seam("torch", "changed_dependency:RENAMED", "(x)")
        when_imported("changed_dependency", gone.get)
        failures = []
        for attempt in range(2):  # a failing check fails every import, never once then silently
            try:
                import changed_dependency
            except DependencyChanged as error:
                failures.append("RENAMED" in str(error))
        print(seen, failures)
    """)
    assert out == "[1, 2] [True, True]"


@pytest.mark.slow  # loads whole models: outside the pure tier
def test_an_inference_load_imports_neither_the_trainer_peft_nor_the_kernel(tiny_root):
    """A load and a generate (FP8 kept, on CPU) import neither the Trainer, peft nor the FP8 kernel's Triton
    source (``fp8_triton``: Triton costs a process about 80 MiB; torch's own dynamo imports Triton where it is
    installed, torch's cost); the training and report modules import no peft either; importing the Trainer
    afterwards puts its seams in (on one rank only the resume of a checkpoint written over several ranks acts;
    the model declares no placement of its own), and peft's. One fresh interpreter for all (seconds each)."""
    from tiny_models import make_fp8_checkpoint

    path = make_fp8_checkpoint("llama_fp8", tiny_root)
    out = _fresh(f"""
        import os, sys, torch
        os.environ.pop("TRITON_INTERPRET", None)
        import hf_parallel
        model = hf_parallel.AutoModelForCausalLM.from_pretrained({path!r}, keep_quantized=True)
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        kinds = sorted({{type(m.kernel).__name__ for m in model.modules() if hasattr(m, "kept_weight")}})
        heavy = ("transformers.trainer", "peft", "hf_parallel.quant.kernels.fp8_triton")
        loaded = sorted(m for m in heavy if m in sys.modules)
        import hf_parallel.api, hf_parallel.training.step, hf_parallel.training.trainer, hf_parallel.commands.report
        peft_by_training = "peft" in sys.modules
        import importlib.util
        assert importlib.util.find_spec("peft") is not None  # asking whether peft is installed changes nothing
        from transformers import Trainer
        import peft
        print(kinds, loaded, peft_by_training, hasattr(Trainer._clip_grad_norm, "__wrapped__"),
              model.is_distributed_loading_by_transformers, hasattr(peft.PeftModel.save_pretrained, "__wrapped__"))
    """)
    assert out == "['DequantizedKernel'] [] False True False True", out
