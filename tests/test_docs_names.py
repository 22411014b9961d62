"""The docs name only what exists: every ``HF_PARALLEL_*`` variable, file path, dotted ``hf_parallel.*`` name,
CLI flag and ``from_pretrained`` keyword a page names is one the code has (a page that drifts from the code fails here,
not in a reader's terminal)."""

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # (the changelog names what was)
SOURCES = [*sorted((ROOT / "hf_parallel").rglob("*.py")), *sorted((ROOT / "scripts").rglob("*"))]
PATH_ROOTS = [ROOT, ROOT / "hf_parallel", ROOT / "tests", ROOT / "benchmarks"]
COMMAND = re.compile(r"(?:hf-parallel|-m hf_parallel)\s+(generate|serve|plan|verify|consolidate)\b([^`\n]*)")
NOT_OURS = {"is_trainable"}  # peft's PeftModel.from_pretrained


def _pages_text() -> dict[Path, str]:
    return {page: page.read_text() for page in PAGES}


def test_every_environment_variable_named_is_read_by_the_code():
    """The package's variables by the package (or scripts/), the suite's own (``HF_PARALLEL_TEST_*``) by tests/."""
    code = "\n".join(path.read_text(errors="ignore") for path in SOURCES if path.is_file())
    suite = "\n".join(path.read_text() for path in sorted((ROOT / "tests").glob("*.py")) if path != Path(__file__))
    for page, text in _pages_text().items():
        for name in set(re.findall(r"HF_PARALLEL_[A-Z0-9_]*[A-Z0-9]", text)):
            where = suite if name.startswith("HF_PARALLEL_TEST_") else code
            assert name in where, f"{page.relative_to(ROOT)} names {name}, which nothing reads"


def test_every_file_named_exists():
    files = {path.name for path in _sources(ROOT)}
    for page, text in _pages_text().items():
        for name in set(re.findall(r"`([\w./-]+\.(?:py|sh|toml))`", text)):
            if "/" in name:
                found = any((root / name).exists() for root in PATH_ROOTS)
            else:
                found = name in files or any((root / name).exists() for root in PATH_ROOTS)
            assert found, f"{page.relative_to(ROOT)} names {name}, which does not exist"


def test_every_cli_flag_named_is_the_commands():
    from hf_parallel.commands.cli import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    flags = {name: {flag for action in sub._actions for flag in action.option_strings}
             for name, sub in commands.choices.items()}  # fmt: skip
    for page, text in _pages_text().items():
        for command, rest in COMMAND.findall(text):
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
                assert flag in flags[command], f"{page.relative_to(ROOT)}: hf-parallel {command} has no {flag}"


@pytest.mark.parametrize("name", ["from_pretrained"])
def test_every_keyword_named_is_taken(name):
    from hf_parallel import api

    taken = set(inspect.signature(getattr(api, name)).parameters)
    for page, text in _pages_text().items():
        for call in re.findall(rf"{name}\(([^()]*(?:\([^()]*\)[^()]*)*)\)", text):
            for keyword in set(re.findall(r"(?<![\w.])([a-z_]+)\s*=(?!=)", call)) - NOT_OURS:
                assert keyword in taken, f"{page.relative_to(ROOT)}: {name} takes no {keyword}= ({call[:80]})"


def _what_ran_where(page: Path) -> list[list[str]]:
    """The rows of a page's "What ran where" table (its cells)."""
    text = page.read_text().split("## What ran where", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # (the header row left out)


def test_what_ran_where_names_a_test_for_each_feature_in_its_tier():
    """README's and the docs index's table are the same, and each feature's cell names tests that exist in
    the tier its column is: a test file of the CPU suite; a case or test of ``test_cuda.py`` (the ``cuda``
    tier), or "not yet run"."""
    import test_cuda

    rows = _what_ran_where(ROOT / "README.md")
    assert rows and rows == _what_ran_where(ROOT / "docs" / "index.md")
    cuda_source = (ROOT / "tests" / "test_cuda.py").read_text()
    cuda_names = {*test_cuda.CASES, *test_cuda.FOUR_RANKS, *re.findall(r"^def (test_\w+)", cuda_source, re.M)}
    for feature, cpu, gpu, nccl in rows:
        files = re.findall(r"`(test_\w+\.py)`", cpu)
        assert files, f"{feature}: no CPU test named"
        for name in files:
            assert re.search(r"^def test_", (ROOT / "tests" / name).read_text(), re.M), (feature, name)
        cases = re.findall(r"`test_cuda\.py::(\w+)`", gpu)
        assert cases or gpu == "not yet run", (feature, gpu)
        assert set(cases) <= cuda_names, (feature, set(cases) - cuda_names)
        assert nccl == "not yet run" or re.search(r"`test_\w+\.py", nccl), (feature, nccl)


def _sources(root: Path) -> list[Path]:
    """The repository's Python files under ``root``, not the build's copies."""
    return [path for path in root.rglob("*.py") if not {"build", ".git"} & set(path.relative_to(ROOT).parts)]


def test_the_architecture_tree_names_every_module_and_only_those():
    """Every module of the package is in the tree (as often as its name is used: two ``base.py``, two
    mentions), and every module the page names exists."""
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    modules = [path.name for path in _sources(ROOT / "hf_parallel") if path.name not in ("__init__.py", "__main__.py")]
    mentions = {name: len(re.findall(rf"(?<![\w/]){re.escape(name)}\b", architecture)) for name in set(modules)}
    assert not {n for n in modules if mentions[n] < modules.count(n)}, "modules the architecture page leaves out"
    named = set(re.findall(r"\b([a-z_0-9]+\.py)\b", architecture)) - {"__init__.py", "__main__.py"}
    assert named <= {path.name for path in _sources(ROOT)}, named - set(modules)


def _measured(page: Path) -> list[str]:
    """The rows of a page's table of measurements (headed ``| what | where | compared with | result |``)."""
    text = page.read_text()
    table = text[text.index("| what | where | compared with | result |") :].split("\n\n", 1)[0]
    return [line.strip() for line in table.splitlines()]


def test_the_benchmarks_page_opens_with_the_readmes_measurements():
    """The summary at the top of the benchmarks page and the README's "Measured" table are the same rows."""
    rows = _measured(ROOT / "README.md")
    assert len(rows) > 3 and rows == _measured(ROOT / "docs" / "benchmarks.md")


def test_every_dotted_name_under_hf_parallel_exists():
    """``hf_parallel.memory.weights_held``, ``hf_parallel.clip_grad_norm_``: each dotted name a page gives is a
    module of the package, a name that module defines, or one the package exports (read from the sources, so
    nothing is imported)."""
    package = ROOT / "hf_parallel"
    exported = set(re.findall(r'^\s+"(\w+)": "\.', (package / "__init__.py").read_text(), re.M))
    for page, text in _pages_text().items():
        for dotted in set(re.findall(r"\bhf_parallel(?:\.[A-Za-z_]\w*)+", text)):
            parts, where = dotted.split(".")[1:], package
            while parts and ((where / parts[0]).is_dir() or (where / f"{parts[0]}.py").is_file()):
                where = where / parts.pop(0)
            if not parts:
                continue  # a module or a package
            assert len(parts) == 1, f"{page.relative_to(ROOT)} names {dotted}: no module {'.'.join(parts[:-1])}"
            if where == package:
                assert parts[0] in exported, f"{page.relative_to(ROOT)} names {dotted}, which hf_parallel lacks"
                continue
            source = where / "__init__.py" if where.is_dir() else where.with_suffix(".py")
            defined = rf"^(?:def|class) {parts[0]}\b|^{parts[0]}\s*[:=]"
            assert re.search(defined, source.read_text(), re.M), f"{page.relative_to(ROOT)} names {dotted}: not defined"
