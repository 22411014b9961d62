"""Imports are paid for when used: ``import hf_parallel`` and ``hf-parallel --help`` load neither torch
nor transformers, and the pure modules (layouts, the mesh's shape, the token split) no transformers."""

import ast
import subprocess
import sys

import pytest


def _loaded_after(code: str) -> set[str]:
    """The heavy packages a fresh interpreter holds after running ``code``."""
    probe = (
        code
        + "\nimport sys; print(sorted({m for m in ('torch', 'transformers', 'numpy', 'peft') if m in sys.modules}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "import hf_parallel",
        "from hf_parallel.commands.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
        "from hf_parallel.distributed.shape import MeshShape; MeshShape.requested(tp_size=2, sp_size=2)",
    ],
)
def test_entry_points_import_neither_torch_nor_transformers(code):
    assert _loaded_after(code) == set()


def test_pure_modules_import_no_transformers():
    code = "import hf_parallel.core.layout, hf_parallel.sequence.tokens, hf_parallel.tensor.heads"
    assert "transformers" not in _loaded_after(code)


def test_public_names_resolve_lazily():
    import hf_parallel

    for name in hf_parallel.__all__:
        assert getattr(hf_parallel, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        hf_parallel.nonexistent  # noqa: B018


def _contract_layers() -> list[set[str]]:
    """The layers of ``pyproject.toml``'s import contract, top first, each a set of module names."""
    import tomllib
    from pathlib import Path

    config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [{name.strip() for name in layer.split("|")} for layer in layers]


def test_the_import_contract_names_every_sub_package_and_top_level_module():
    """A module added beside the others is placed in a layer, so the contract checks it too."""
    import pkgutil

    import hf_parallel

    found = {f"hf_parallel.{m.name}" for m in pkgutil.iter_modules(hf_parallel.__path__) if m.name != "plans"}
    named = set().union(*_contract_layers())
    assert found == named, f"not in the contract: {sorted(found - named)}; gone: {sorted(named - found)}"


def test_imports_point_down_the_layers_and_close_no_cycle():
    """``lint-imports`` keeps pyproject.toml's contracts: each layer imports only those below it (a lazy
    import inside a function counts; one under ``TYPE_CHECKING`` does not) and no two modules of one
    package, nor two sub-packages, import each other in a cycle."""
    import shutil
    from pathlib import Path

    lint = shutil.which("lint-imports")
    assert lint is not None, "import-linter is a test dependency (pyproject.toml's test extra)"
    root = Path(__file__).parents[1]
    done = subprocess.run([lint, "--no-cache", str(root / "pyproject.toml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 kept, 0 broken" in done.stdout
