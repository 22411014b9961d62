"""Shared fixtures. Nothing here imports transformers until a test asks for a checkpoint, so the pure
tier (``pytest -m "not distributed"``) pays only for what its tests use."""

import os
import sys

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import tests' helper modules by name

os.environ.setdefault("OMP_NUM_THREADS", "1")
# every point-to-point transfer of every test under NCCL's rules (hf_parallel/distributed/strict.py): a send
# that would wait forever for its receive on GPUs fails here too, inherited by every spawned rank
os.environ.setdefault("HF_PARALLEL_P2P_RULES", "nccl")
# the suite's ranks compute on the CPU, on a GPU machine too (hf_parallel would pick the GPU): one process's
# references are CPU models fed CPU inputs. The cuda tier (test_cuda.py) asks for the GPU itself.
os.environ.setdefault("HF_PARALLEL_DEVICE", "cpu")
# examples a property test draws where it does not set its own: CI (.ci/run) draws 150, an edit-test loop 40
settings.register_profile("ci", max_examples=150)
settings.register_profile("dev", max_examples=40)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_configure(config):
    if os.environ.get("HF_PARALLEL_TEST_COSTS"):  # each test's time, rank groups and launches (suite_costs.py)
        import suite_costs

        config.pluginmanager.register(suite_costs, "suite_costs")


def once_per_world_size(compute):
    """``get(world_size)``: ``compute(world_size)`` on its first call, the same result after
    (spawning a group of ranks is the slow part, so one group runs every case of a test file)."""
    cache = {}

    def get(world_size):
        if world_size not in cache:
            cache[world_size] = compute(world_size)
        return cache[world_size]

    return get


@pytest.fixture(scope="module")
def interpreted():
    """``tensor/fp8_weight_only`` with its Triton source (``fp8_triton``) made for Triton's interpreter, which
    ``triton.jit`` reads when it decorates: both modules reloaded under ``TRITON_INTERPRET=1``, and after. One
    test file shares it, so its load-time checks (``runs_on``, interpreted: seconds each) run once a file; the
    file's tests after its first use run under it too, so those that use it come last."""
    import importlib

    from hf_parallel.quant.kernels import fp8_weight_only

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        importlib.reload(importlib.import_module("hf_parallel.quant.kernels.fp8_triton"))
        yield importlib.reload(fp8_weight_only)
    importlib.reload(importlib.import_module("hf_parallel.quant.kernels.fp8_triton"))
    importlib.reload(fp8_weight_only)


@pytest.fixture(scope="session", autouse=True)
def one_process_references(tmp_path_factory):
    """Where one process's results go once a session, read by every rank that compares with them
    (``references.py``); removed at the end (the real SmolLM2's take gigabytes)."""
    import shutil

    folder = tmp_path_factory.mktemp("references")
    os.environ["HF_PARALLEL_TEST_REFERENCES"] = str(folder)
    yield folder
    os.environ.pop("HF_PARALLEL_TEST_REFERENCES", None)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_paths(tiny_root):
    from tiny_models import ARCHS, make_checkpoint

    return {name: make_checkpoint(name, tiny_root) for name in ARCHS}


def compare_tp_runs(tmp_path_factory, label: str, cases: dict):
    """``get(world_size)`` -> (every rank's ``tp_workers.compare_tp`` results for ``cases``, the
    folder their saves went to): one spawned group per world size runs every case."""
    import tp_workers
    from distributed import run_ranks

    def run(world_size):
        root = str(tmp_path_factory.mktemp(f"{label}{world_size}"))
        save_root = os.path.join(root, "saved")
        return run_ranks(
            world_size, tp_workers.compare_tp, cases, save_root, out_dir=os.path.join(root, "results")
        ), save_root

    return once_per_world_size(run)


@pytest.fixture(scope="session")
def tp_results(tiny_paths, tmp_path_factory):
    from tiny_models import variant_plans

    cases = {name: (path, "auto") for name, path in tiny_paths.items()}
    cases.update({name: (tiny_paths[arch], plan) for name, (arch, plan) in variant_plans().items()})
    return compare_tp_runs(tmp_path_factory, "tp", cases)


@pytest.fixture(scope="session")
def smollm2():
    from hf_parallel.commands.default_model import default_checkpoint

    return default_checkpoint()


def pytest_collection_modifyitems(items):
    """A ``slow`` test (a whole model loaded or compiled) and one that runs the FP8 kernel under Triton's
    interpreter (the ``interpreted`` fixture: its load-time checks and launches take seconds each) leave the
    pure tier for the distributed one, so the edit-test loop (``pytest -m "not distributed"``) stays under a
    minute; CI runs both."""
    for item in items:
        if item.get_closest_marker("slow") or "interpreted" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(scope="session")
def tiny_smollm2(tiny_root, smollm2):
    """SmolLM2's tokenizer around a random 2-layer model: what the cookbook's scripts run on in the tests."""
    from tiny_models import make_tiny_smollm2

    return make_tiny_smollm2(tiny_root, smollm2)
