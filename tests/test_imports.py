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
    code = "import hf_parallel.tensor.layout, hf_parallel.sequence.tokens, hf_parallel.tensor.heads"
    assert "transformers" not in _loaded_after(code)


def test_public_names_resolve_lazily():
    import hf_parallel

    for name in hf_parallel.__all__:
        assert getattr(hf_parallel, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        hf_parallel.nonexistent  # noqa: B018
