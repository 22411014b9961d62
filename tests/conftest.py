import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import tests' helper modules by name

from distributed import run_ranks  # noqa: E402
from tiny_models import ARCHS, make_checkpoint, variant_plans  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_paths(tiny_root):
    return {name: make_checkpoint(name, tiny_root) for name in ARCHS}


@pytest.fixture(scope="session")
def tp_results(tiny_paths, tmp_path_factory):
    """One spawned group per world size runs every architecture (spawning is the slow part)."""
    import workers

    cache = {}

    def get(world_size):
        if world_size not in cache:
            root = str(tmp_path_factory.mktemp(f"tp{world_size}"))
            save_root = os.path.join(root, "saved")
            cases = {name: (path, "auto") for name, path in tiny_paths.items()}
            cases.update({name: (tiny_paths[arch], plan) for name, (arch, plan) in variant_plans().items()})
            ranks = run_ranks(world_size, workers.compare_tp, cases, save_root, out_dir=os.path.join(root, "results"))
            cache[world_size] = (ranks, save_root)
        return cache[world_size]

    return get


@pytest.fixture(scope="session")
def smollm2():
    from hf_parallel.default_model import default_checkpoint

    return default_checkpoint()
