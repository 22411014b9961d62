"""Pages generated at build time from the code, so they cannot drift from it (mkdocs-gen-files): the CLI from
its parser, every registered style from the registry, every shipped plan from ``plans/``, every error message
the package can raise (read from its source), a plot under each benchmark table (drawn from the table), and
the changelog."""

from __future__ import annotations

import ast
import html
import io
import re
import tomllib
from pathlib import Path

import mkdocs_gen_files

from hf_parallel.commands.cli import build_parser
from hf_parallel.tensor.registry import STYLES

ROOT = Path(__file__).resolve().parent.parent


def cli_page() -> str:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    parts = ["# CLI\n", "Generated from `hf_parallel.commands.cli.build_parser`.\n"]
    parts += ["```text", parser.format_help(), "```"]
    for name, sub in subparsers.choices.items():
        parts += [f"\n## `hf-parallel {name}`\n", "```text", sub.format_help(), "```"]
    return "\n".join(parts) + "\n"


def _first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split()) or "-"


def styles_page() -> str:
    rows = ["# Styles\n", "Every `ParallelStyle` registered when the package is imported (`hf_parallel.STYLES`), "
            "by the name plans use. A plan maps module (or parameter) patterns to these names; "
            "`hf_parallel.register_style` adds one.\n", "| name | class | what it does |", "|---|---|---|"]  # fmt: skip
    for name, style in sorted(STYLES.items()):
        doc = _first_paragraph(type(style).__doc__).replace("|", "\\|")
        rows.append(f"| `{name}` | `{type(style).__name__}` | {doc} |")
    return "\n".join(rows) + "\n"


def plans_page() -> str:
    parts = ["# Shipped plans\n", "Every file in `plans/` (installed as `hf_parallel.plans`): the model types it "
             "serves, its rules, and the comment that says why.\n"]  # fmt: skip
    for entry in sorted((ROOT / "plans").glob("*.toml")):
        text = entry.read_text()
        data = tomllib.loads(text)
        comment = " ".join(line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#"))
        parts += [f"## `{entry.name}`\n", f"{comment}\n", f"model types: {', '.join(data['model_types'])}\n",
                  "| pattern | style |", "|---|---|"]  # fmt: skip
        parts += [f"| `{pattern}` | `{style}` |" for pattern, style in data["rules"].items()]
        if data.get("optional"):
            parts.append(f"\noptional (only some variants have them): {', '.join(map(repr, data['optional']))}")
        parts.append("")
    return "\n".join(parts) + "\n"


ERRORS = ("Error", "Failure", "Exit", "Changed", "Warning")  # the classes a message is raised or warned with


def _template(node: ast.expr) -> str:
    """A message as its source builds it: literal text, and each interpolated expression as ``{expr}``."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else f"{{{ast.unparse(v.value)}}}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _template(node.left) + _template(node.right)
    return "{" + ast.unparse(node) + "}"


def _markdown_text(text: str) -> str:
    """``text`` shown as written in a table cell: HTML escaped, Markdown's own characters backslashed (a
    message's ``x[0]`` is not a link, its ``**kwargs`` not emphasis)."""
    text = html.escape(text, quote=False)
    return "".join("\\" + c if c in "\\`*_[]|{}#" else c for c in text)


def errors_page() -> str:
    """Every exception (and warning) the package constructs with a message, module by module, with the message
    as its source writes it: what a user can meet, and (in the message) what to do about it."""
    parts = ["# Errors\n", "Every exception and warning `hf_parallel` raises with a message, read from its source when "
             "this site is built: `{...}` is filled in at run time (a file, a key, a size). Refusals come before any "
             "weight is read or any file written; each names the parameter, file or rule at fault and what to do. "
             "`CheckpointError` is a `ValueError`; `RankFailure` a `TimeoutError`. The [bad input](bad-input.md) "
             "page shows the common cases as a user meets them.\n"]  # fmt: skip
    package = ROOT / "hf_parallel"
    for path in sorted(package.rglob("*.py")):
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            named = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith(ERRORS)
            if named and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp)):
                message = _markdown_text(" ".join(_template(node.args[0]).split()))
                found.append((node.lineno, node.func.id, message))
        if found:
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            parts += [f"## `{module}`\n", "| line | raised as | message |", "|---|---|---|"]
            parts += [f"| {line} | `{kind}` | {message} |" for line, kind, message in sorted(found)]
            parts.append("")
    return "\n".join(parts) + "\n"


def _number(cell: str) -> float | None:
    found = re.match(r"\**([\d,]*\.?\d+)", cell.strip())
    return float(found.group(1).replace(",", "")) if found else None


def _plot(title: str, table: list[str]) -> bytes | None:
    """A table's numeric rows as grouped bars, each row scaled to its largest value (the rows mix units), the
    columns its implementations; None for a table with fewer than two numeric rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header = [cell.strip() for cell in table[0].strip("|").split("|")][1:]
    rows = []
    for line in table[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        values = [_number(cell) for cell in cells[1 : len(header) + 1]]
        if sum(v is not None for v in values) >= 2:
            rows.append((cells[0], [v or 0.0 for v in values]))
    if len(rows) < 2 or len(header) < 2:
        return None
    figure, axes = plt.subplots(figsize=(9, 0.5 + 0.45 * len(rows) * len(header) / 2))
    width = 0.8 / len(header)
    for column, name in enumerate(header):
        scaled = [values[column] / (max(values) or 1) for _, values in rows]
        axes.barh([r + column * width for r in range(len(rows))], scaled, height=width, label=name)
    axes.set_yticks([r + 0.4 - width / 2 for r in range(len(rows))], [label[:48] for label, _ in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("each row scaled to its largest value (lower is better for times and memory)", fontsize=8)
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=7, loc="lower right")
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    return buffer.getvalue()


def benchmarks_page() -> str:
    """``docs/benchmarks.md`` with a plot drawn under each of its tables, from that table."""
    out, table, title, count = [], [], "", 0
    for line in [*(ROOT / "docs" / "benchmarks.md").read_text().splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            out += table
            png = _plot(title, table)
            if png is not None:
                with mkdocs_gen_files.open(f"img/benchmark-{count}.png", "wb") as f:
                    f.write(png)
                out += ["", f"![{title}: the table above, each row scaled](img/benchmark-{count}.png)"]
                count += 1
            table = []
        title = line.lstrip("# ").strip() if line.startswith("#") else title
        out.append(line)
    return "\n".join(out) + "\n"


PAGES = {
    "benchmarks.md": benchmarks_page,
    "reference/errors.md": errors_page,
    "reference/cli.md": cli_page,
    "reference/styles.md": styles_page,
    "reference/plans.md": plans_page,
    "changelog.md": lambda: (ROOT / "CHANGELOG.md").read_text(),
}
for page, write in PAGES.items():
    text = write()
    with mkdocs_gen_files.open(page, "w") as f:
        f.write(text)
