"""``hf-parallel plan ... --html OUT``: the dry run as one self-contained page (no script, no network),
for a reader who wants to see where the memory goes rather than read 300 rows.

The page draws the mesh (a box per rank: its data-parallel replica, sequence index and TP index), the
bytes each TP rank holds as bars (and, under FSDP, at rest), and each module as a row that opens onto its
parameters (``<details>``: no script needed). A matrix kept whole on every rank is highlighted with what
that costs. It renders the same ``PlanFacts`` the text report prints, and every parameter row carries its
facts as ``data-`` attributes, so a test reads the page back and compares it with the text.
"""

from __future__ import annotations

import html
import json

from .report import ParamRow, PlanFacts

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #1f2328; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
code, pre { font: 12.5px ui-monospace, monospace; } pre { background: #f6f8fa; padding: .8em; overflow-x: auto; }
.mesh { display: flex; flex-wrap: wrap; gap: 1em; }
.replica { border: 1px solid #d0d7de; border-radius: 6px; padding: .5em; }
.replica table { border-collapse: separate; border-spacing: 4px; }
.rank { width: 5.5em; height: 3em; text-align: center; border-radius: 4px; color: #fff; font-size: 12px; }
.bars td { padding: 2px 6px; } .bar { height: 14px; border-radius: 3px; }
.weights { background: #0969da; } .at-rest { background: #8250df; }
details { border-bottom: 1px solid #eaeef2; padding: 3px 0; } summary { cursor: pointer; }
summary .bytes { color: #57606a; float: right; }
table.params { border-collapse: collapse; margin: .4em 0 .6em 1.5em; font-size: 12.5px; }
table.params td, table.params th { padding: 2px 8px; text-align: left; border-bottom: 1px solid #f0f0f0; }
.whole { background: #fff8c5; } .cost { color: #9a6700; font-weight: 600; }
"""
PALETTE = ("#0969da", "#1a7f37", "#8250df", "#bf3989", "#9a6700", "#cf222e", "#0550ae", "#116329")


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _mesh(facts: PlanFacts) -> str:
    """One box per data-parallel replica; inside, a row per sequence index and a cell per TP rank."""
    shape, boxes = facts.shape, []
    for replica in range(shape.dp):
        rows = []
        for sp in range(shape.sp):
            cells = "".join(
                f'<td class="rank" style="background:{PALETTE[tp % len(PALETTE)]}" '
                f'title="rank {shape.global_rank(0, sp, tp, replica)}: replica {replica}, sequence {sp}, tp {tp}">'
                f"rank {shape.global_rank(0, sp, tp, replica)}<br>tp {tp}</td>"
                for tp in range(facts.tp)
            )
            rows.append(f"<tr>{cells}</tr>")
        boxes.append(f'<div class="replica"><div>replica {replica}</div><table>{"".join(rows)}</table></div>')
    return f'<p>{html.escape(str(shape))} = {shape.world_size} rank(s)</p><div class="mesh">{"".join(boxes)}</div>'


def _bars(facts: PlanFacts) -> str:
    largest = max([*facts.totals, *(facts.at_rest or [])]) or 1
    rows = []
    for rank, total in enumerate(facts.totals):
        kinds = [("weights", total)] + ([("at-rest", facts.at_rest[rank])] if facts.at_rest else [])
        for kind, value in kinds:
            label = "weights" if kind == "weights" else f"at rest under FSDP ({facts.fsdp} ranks a shard)"
            rows.append(
                f'<tr><td>tp rank {rank}</td><td>{label}</td><td style="width:30em"><div class="bar {kind}" '
                f'style="width:{100 * value / largest:.1f}%"></div></td><td>{_bytes(value)}</td></tr>'
            )
    return f'<table class="bars">{"".join(rows)}</table><p>full model: {_bytes(facts.full_bytes)}</p>'


def _is_whole_matrix(row: ParamRow, tp: int) -> bool:
    return tp > 1 and row.replicated and len(row.full_shape) >= 2


def _param_row(row: ParamRow, tp: int) -> str:
    whole = _is_whole_matrix(row, tp)
    data = {"name": row.name, "style": row.style, "layout": row.layout, "bytes": json.dumps(row.nbytes),
            "shapes": " ".join("x".join(map(str, s)) for s in row.shapes)}  # fmt: skip
    attributes = " ".join(f'data-{key}="{html.escape(value)}"' for key, value in data.items())
    cost = f' <span class="cost">whole on all {tp} ranks: {_bytes(row.nbytes[0] * (tp - 1))} more than split</span>'
    return (
        f'<tr class="param{" whole" if whole else ""}" {attributes}><td><code>{html.escape(row.name)}</code>'
        f"{cost if whole else ''}</td><td>{html.escape(row.style)}</td><td>{html.escape(row.layout)}</td>"
        f"<td>{html.escape(data['shapes'])}</td><td>{html.escape(', '.join(map(_bytes, row.nbytes)))}</td>"
        f"<td><code>{html.escape(row.rule)}</code></td></tr>"
    )


def _modules(facts: PlanFacts) -> str:
    """Parameters grouped by their module, in the model's order, each module one expandable row."""
    groups: dict[str, list[ParamRow]] = {}
    for row in facts.rows:
        groups.setdefault(row.name.split(" ")[0].rpartition(".")[0] or "(model)", []).append(row)
    out = []
    for module, rows in groups.items():
        styles = ", ".join(dict.fromkeys(row.style for row in rows))
        held = [sum(row.nbytes[r] for row in rows) for r in range(facts.tp)]
        flag = " whole" if any(_is_whole_matrix(row, facts.tp) for row in rows) else ""
        body = "".join(_param_row(row, facts.tp) for row in rows)
        out.append(
            f'<details class="module{flag}"><summary><code>{html.escape(module)}</code> — {html.escape(styles)}'
            f'<span class="bytes">{" / ".join(map(_bytes, held))}</span></summary><table class="params"><tr>'
            "<th>parameter</th><th>style</th><th>layout</th><th>local shape per rank</th><th>bytes per rank</th>"
            f"<th>rule [source]</th></tr>{body}</table></details>"
        )
    return "".join(out)


def render(facts: PlanFacts) -> str:
    """The page, whole."""
    whole = [row for row in facts.rows if _is_whole_matrix(row, facts.tp)]
    extra = sum(row.nbytes[0] * (facts.tp - 1) for row in whole)
    notes = [*facts.mesh, *([facts.heads] if facts.heads else []), *facts.details]
    title = f"plan for {facts.path} ({facts.model_type}) at tp={facts.tp}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>rules from <code>{html.escape(facts.source)}</code>; {len(facts.rows)} parameters in {facts.tp} tensor-parallel
rank(s). Nothing was run and no weight read (but GPTQ's <code>g_idx</code>, an int32 an input, to find the
groups a shard needs): <code>hf-parallel plan</code> prints the same facts as text.</p>
<h2>Mesh</h2>{_mesh(facts)}
<h2>Bytes per rank</h2>{_bars(facts)}
<h2>Matrices held whole on every rank</h2>
<p class="cost">{len(whole)} matrix(es), {_bytes(extra)} more in all than if they were split</p>
<h2>Modules</h2>{_modules(facts)}
<h2>Notes</h2><pre>{html.escape(chr(10).join(notes)) or "none"}</pre>
</body></html>
"""
