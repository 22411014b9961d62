"""Pictures of how each parallel style moves data, drawn at site build (mkdocs-gen-files) from the functions that
move it: a pipeline stage's steps from ``schedule.order``, a weight's split from the styles' own ``layouts`` (what
``hf-parallel plan`` prints), the ring's pairs from ``RingPlan.pairs``, the Ulysses all-to-all's sizes from
``token_sizes`` and ``head_spread``, the experts of each EP rank from ``MoETokenExchange.layouts``; so a picture
cannot drift from what the ranks do. ``gen_mesh_pictures.py`` draws the mesh itself; the guides show both."""

from __future__ import annotations

from html import escape
from itertools import accumulate

import torch
from torch import nn

from hf_parallel.core.layout import sizes_to_ranges
from hf_parallel.distributed.mesh import Mesh
from hf_parallel.distributed.shape import MeshShape
from hf_parallel.pipeline.schedule import order
from hf_parallel.sequence.ring import RingPlan
from hf_parallel.sequence.tokens import token_layout, token_sizes
from hf_parallel.sequence.ulysses import head_spread
from hf_parallel.tensor.experts import MoETokenExchange
from hf_parallel.tensor.heads import split_heads
from hf_parallel.tensor.splits import ShardContext
from hf_parallel.tensor.styles import Colwise, Rowwise

COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")
IDLE, MUTED = "#e8e8e8", "#555"

# what each picture draws: sizes small enough to read, uneven where the code handles unevenness
SCHEDULE = dict(stages=4, count=6)
SPLIT = dict(num_heads=9, head_dim=4, hidden=24, tp=2)  # 9 heads over 2 ranks: 5 and 4
RING = dict(cp=3, tokens=12)
ULYSSES = dict(tokens=10, num_heads=9, num_kv_heads=3, sp=2)
EXPERTS = dict(num_experts=6, ep=4)  # 6 experts over 4 ranks: 2, 2, 1, 1
# an example routing, the one input no function computes: each EP rank's 3 tokens, their top-2 experts
ROUTED = (((0, 1), (0, 4), (1, 5)), ((2, 3), (2, 0), (3, 5)), ((4, 5), (0, 2), (4, 1)), ((1, 0), (3, 2), (5, 4)))
SERVING = dict(tp_size=4)

# where the cells sit (the test reads the pictures back by these)
SLOT, LANE, SCHEDULE_LABEL, SCHEDULE_TOP = 30, 30, 190, 60
RING_LABEL, RING_CELL, RING_ROW, RING_TOP = 170, 170, 76, 76
GRID, ULYSSES_TOP, ULYSSES_LEFT, ULYSSES_GAP = 18, 70, 60, 150
FEATURE = 6  # pixels a feature of a split weight


def _text(x: float, y: float, words: str, size: int = 13, anchor: str = "start", colour: str = "#222") -> str:
    return (f'<text x="{x}" y="{y}" font-family="sans-serif" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{colour}">{escape(words)}</text>')  # fmt: skip


def _box(x: float, y: float, width: float, height: float, fill: str, rx: int = 4, extra: str = "") -> str:
    return f'<rect x="{x}" y="{y}" width="{width}" height="{height}" rx="{rx}" fill="{fill}"{extra}/>'


def _arrow(x1: float, y1: float, x2: float, y2: float) -> str:
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#444" stroke-width="1.5" marker-end="url(#a)"/>'


def _svg(width: int, height: int, body: list[str]) -> str:
    head = ('<defs><marker id="a" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#444"/></marker></defs>')  # fmt: skip
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">\n{head}\n' + "\n".join(body) + "\n</svg>\n")  # fmt: skip


def _colour(rank: int) -> str:
    return COLOURS[rank % len(COLOURS)]


# 1. pipeline schedules


def timeline(schedule: str, stages: int, count: int) -> list[list[tuple[int, str, int]]]:
    """Per stage, its steps as ``(slot, "F"|"B", micro-batch)`` in ``order``'s order, each in the first slot
    where its stage is free and what it waits for is done: a forward, the previous stage's forward of that
    micro-batch; a backward, the next stage's backward of it. One slot a step: the picture shows the order and
    the bubbles it leaves, not the durations (a backward takes about twice a forward)."""
    steps = [order(schedule, stage, stages, count) for stage in range(stages)]
    placed: list[list[tuple[int, str, int]]] = [[] for _ in range(stages)]
    ends: dict[tuple[int, str, int], int] = {}  # (stage, step, micro-batch) -> the slot after it
    while any(len(row) < len(mine) for row, mine in zip(placed, steps)):
        progressed = False
        for stage, row in enumerate(placed):
            if len(row) == len(steps[stage]):
                continue
            step, m = steps[stage][len(row)]
            waits_for = (stage - 1, "F", m) if step == "F" else (stage + 1, "B", m)
            if 0 <= waits_for[0] < stages and waits_for not in ends:
                continue
            slot = max(row[-1][0] + 1 if row else 0, ends.get(waits_for, 0))
            row.append((slot, step, m))
            ends[(stage, step, m)] = slot + 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} over {stages} stages deadlocks: each stage waits for another")
    return placed


def held_activations(steps: list[tuple[str, int]]) -> int:
    """The most micro-batches a stage holds activations of at once (forwards run whose backward has not)."""
    return max(accumulate(1 if step == "F" else -1 for step, _ in steps))


def schedule_svg(schedule: str, stages: int, count: int) -> str:
    """One lane per stage, one column per slot: a forward in its micro-batch's colour, its backward paler;
    grey slots are the bubbles. Each lane says how many activations its stage holds at most."""
    lanes = timeline(schedule, stages, count)
    slots = max(slot for lane in lanes for slot, _, _ in lane) + 1
    how = {"gpipe": "all forwards, then all backwards",
           "1f1b": "a warm-up of stages - stage - 1 forwards, then one forward, one backward"}[schedule]  # fmt: skip
    body = [_text(8, 20, f"{schedule}: {stages} stages x {count} micro-batches", 15),
            _text(8, 40, f"{how}; F3 / B3: micro-batch 3's forward / backward", 12, colour=MUTED)]  # fmt: skip
    for stage, lane in enumerate(lanes):
        y = SCHEDULE_TOP + stage * LANE
        held = held_activations([(step, m) for _, step, m in lane])
        body.append(_text(8, y + 19, f"stage {stage}: holds at most {held}"))
        body += [_box(SCHEDULE_LABEL + slot * SLOT + 1, y, SLOT - 2, LANE - 4, IDLE) for slot in range(slots)]
        for slot, step, m in lane:
            x = SCHEDULE_LABEL + slot * SLOT
            pale = ' fill-opacity="0.45"' if step == "B" else ""
            body.append(_box(x + 1, y, SLOT - 2, LANE - 4, _colour(m), extra=pale))
            body.append(_text(x + SLOT / 2, y + 18, f"{step}{m}", 11, "middle", "#fff" if step == "F" else "#222"))
    bottom = SCHEDULE_TOP + stages * LANE
    body.append(_text(SCHEDULE_LABEL, bottom + 16, "time, one slot a step →", 12, colour=MUTED))
    return _svg(SCHEDULE_LABEL + slots * SLOT + 8, bottom + 26, body)


# 2. column- and row-wise splits


def attention_splits(num_heads: int, head_dim: int, hidden: int, tp: int):
    """The layouts ``colwise`` gives q_proj's weight and ``rowwise`` o_proj's, head-aligned over ``tp`` ranks:
    the styles' own ``layouts`` on meta modules, as ``hf-parallel plan`` computes them."""
    ctx = ShardContext(Mesh.dry_run(tp_size=tp), split_heads(num_heads, num_heads, head_dim, tp))
    q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False, device="meta")
    o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False, device="meta")
    return Colwise().layouts(q_proj, ctx, "q_proj")["weight"], Rowwise().layouts(o_proj, ctx, "o_proj")["weight"]


def _heads(piece: tuple[int, int], head_dim: int) -> str:
    return f"heads {piece[0] // head_dim}-{piece[1] // head_dim - 1}"


def split_svg(num_heads: int, head_dim: int, hidden: int, tp: int) -> str:
    """q_proj's weight ``[out, in]`` cut across its rows (colwise: each rank its heads' output features) beside
    o_proj's cut across its columns (rowwise: each rank its heads' input features, the partial outputs summed);
    a band's height or width is its rank's size in the layout, white lines mark the heads."""
    colwise, rowwise = attention_splits(num_heads, head_dim, hidden, tp)
    unit, top, left, right, features = FEATURE, 76, 24, 330, num_heads * head_dim
    bands, lines, words = [], [], []  # drawn in this order: the lines over the bands, the words over both
    for rank, ((start, stop),) in enumerate(colwise.ranges):
        y, height = top + start * unit, (stop - start) * unit
        bands.append(_box(left, y, hidden * unit, height, _colour(rank), rx=0))
        label = f"rank {rank}: {_heads((start, stop), head_dim)}"
        head = head_dim * unit  # (the words sit inside the band's middle head, clear of the lines)
        middle = y + (stop - start) // head_dim // 2 * head + head / 2 + 4
        words.append(_text(left + hidden * unit / 2, middle, label, 12, "middle", "#fff"))
    for rank, ((start, stop),) in enumerate(rowwise.ranges):
        x, width, under = right + start * unit, (stop - start) * unit, top + hidden * unit + 16
        bands.append(_box(x, top, width, hidden * unit, _colour(rank), rx=0))
        words += [_text(x + width / 2, under, f"rank {rank}", 12, "middle", _colour(rank)),
                  _text(x + width / 2, under + 15, _heads((start, stop), head_dim), 11, "middle", _colour(rank))]
    for head in range(1, num_heads):
        y, x = top + head * head_dim * unit, right + head * head_dim * unit
        lines.append(f'<line x1="{left}" y1="{y}" x2="{left + hidden * unit}" y2="{y}" stroke="#fff"/>')
        lines.append(f'<line x1="{x}" y1="{top}" x2="{x}" y2="{top + hidden * unit}" stroke="#fff"/>')
    low, rows_low = top + features * unit + 20, top + hidden * unit + 56
    body = [_text(8, 20, f"{num_heads} heads of {head_dim} (as many KV heads) over tp={tp}: each rank whole heads", 15),
            _text(left, 48, "colwise (q_proj): by rows, its output features", 12, colour=MUTED),
            _text(right, 48, "rowwise (o_proj): by columns, its input features", 12, colour=MUTED),
            _text(left, 66, f"weight [out={features}, in={hidden}]", 11, colour=MUTED),
            _text(right, 66, f"weight [out={hidden}, in={features}]", 11, colour=MUTED),
            *bands, *lines, *words,
            _text(left, low, colwise.describe(), 12),
            _text(left, low + 16, "x whole on every rank; y stays split by heads", 11, colour=MUTED),
            _text(right, rows_low, rowwise.describe(), 12),
            _text(right, rows_low + 16, "each rank: its heads' part of x times its columns", 11, colour=MUTED),
            _text(right, rows_low + 32, "→ a partial y on every rank; an all-reduce sums them", 11, colour=MUTED),
            _text(right, rows_low + 48, "(the bias is added once, after the sum)", 11, colour=MUTED)]  # fmt: skip
    return _svg(right + max(features * unit, 300) + 16, max(low + 16, rows_low + 48) + 12, body)


# 3. one ring step of context parallelism


def ring_steps(cp: int, tokens: int) -> list[list[tuple[int, list[tuple[int, int]]]]]:
    """Per ring rank, per step: the rank whose key/value chunks it holds then, and the (query chunk, key chunk)
    pairs it computes (``RingPlan.pairs``: causal, so a pair whose keys all follow its queries is skipped)."""
    layout = token_layout(tokens, 1, cp)
    steps = []
    for rank in range(cp):
        plan = RingPlan(layout, Mesh.dry_run(rank=rank, cp_size=cp).cp, None, 1.0, None, None, 1)
        # the blocks move one rank along each step, so at step k they are rank - k's (as ``pairs`` reads them)
        steps.append([((rank - step) % cp, [(qi, ki) for _, qi, _, ki, _ in plan.pairs(step)]) for step in range(cp)])
    return steps


def ring_svg(cp: int, tokens: int) -> str:
    """One row per ring rank (its two zigzag query chunks), one column per step: whose key/value chunks it has
    then, and of the four (query, key) chunk pairs the ones it computes (coloured) and skips (grey)."""
    layout = token_layout(tokens, 1, cp)
    body = [_text(8, 20, f"cp={cp}: {tokens} tokens in {2 * cp} chunks of {layout.chunk}; each step the key/value "
                         "blocks move one rank on", 15),
            _text(8, 40, "a column is one ring step; q3 k1: query chunk 3 against key chunk 1 (grey: all its keys "
                         "come later, skipped)", 12, colour=MUTED)]  # fmt: skip
    for step in range(cp):
        body.append(_text(RING_LABEL + step * RING_CELL + 8, RING_TOP - 10, f"step {step}", 13))
    for rank, row in enumerate(ring_steps(cp, tokens)):
        y = RING_TOP + rank * RING_ROW
        queries = layout.chunks_of(rank)
        body.append(_text(8, y + 20, f"rank {rank}: queries", 13))
        body.append(_text(8, y + 38, f"chunks {queries[0]}, {queries[1]}", 13, colour=_colour(rank)))
        for step, (source, pairs) in enumerate(row):
            x = RING_LABEL + step * RING_CELL + 8
            keys = layout.chunks_of(source)
            body.append(_text(x, y + 12, f"KV of rank {source}: chunks {keys[0]}, {keys[1]}", 11, colour=MUTED))
            for a, qi in enumerate(queries):
                for b, ki in enumerate(keys):
                    computed = (qi, ki) in pairs
                    cx, cy = x + b * 62, y + 20 + a * 24
                    body.append(_box(cx, cy, 58, 20, _colour(source) if computed else IDLE))
                    body.append(_text(cx + 29, cy + 14, f"q{qi} k{ki}", 11, "middle", "#fff" if computed else "#999"))
    return _svg(RING_LABEL + cp * RING_CELL + 8, RING_TOP + cp * RING_ROW, body)


# 4. the Ulysses all-to-all


def ulysses_owners(tokens: int, num_heads: int, num_kv_heads: int, sp: int) -> tuple[list[list[int]], ...]:
    """The rank holding each (head, token) of one attention's queries before the all-to-all (by tokens,
    ``token_sizes``) and after it (by heads, ``head_spread``): ``[head][token] -> rank``, twice."""
    token_ranges = sizes_to_ranges(token_sizes(tokens, sp))
    head_ranges = sizes_to_ranges(head_spread(num_heads, num_kv_heads, sp).q_sizes)

    def owner(ranges, index):
        return next(rank for rank, (start, stop) in enumerate(ranges) if start <= index < stop)

    before = [[owner(token_ranges, token) for token in range(tokens)] for _ in range(num_heads)]
    after = [[owner(head_ranges, head)] * tokens for head in range(num_heads)]
    return before, after


def ulysses_svg(tokens: int, num_heads: int, num_kv_heads: int, sp: int) -> str:
    """The queries as a heads x tokens grid, each cell in its rank's colour: before the all-to-all split by
    tokens (every head), after it by heads (every token); the attention runs between, the reverse after."""
    spread = head_spread(num_heads, num_kv_heads, sp)
    width = tokens * GRID
    body = [_text(8, 20, f"sp={sp}: {tokens} tokens x {num_heads} query heads ({num_kv_heads} key/value heads)", 15),
            _text(8, 40, "rows: heads, columns: tokens; colour: the rank holding it", 12, colour=MUTED)]  # fmt: skip
    sizes = (token_sizes(tokens, sp), spread.q_sizes)
    for panel, (owners, title) in enumerate(zip(ulysses_owners(tokens, num_heads, num_kv_heads, sp),
                                                ("before: its tokens, all heads", "after: all tokens, its heads"))):
        left = ULYSSES_LEFT + panel * (width + ULYSSES_GAP)
        body.append(_text(left, ULYSSES_TOP - 8, title, 12))
        for head, row in enumerate(owners):
            for token, rank in enumerate(row):
                body.append(_box(left + token * GRID + 1, ULYSSES_TOP + head * GRID + 1, GRID - 2, GRID - 2,
                                 _colour(rank), rx=2))  # fmt: skip
        what = ("tokens", "query heads")[panel]
        for rank, size in enumerate(sizes[panel]):
            body.append(_text(left, ULYSSES_TOP + num_heads * GRID + 18 + rank * 16, f"rank {rank}: {size} {what}",
                              12, colour=_colour(rank)))  # fmt: skip
    middle, y = ULYSSES_LEFT + width + ULYSSES_GAP / 2, ULYSSES_TOP + num_heads * GRID / 2
    body += [_arrow(middle - 50, y, middle + 50, y), _text(middle, y - 8, "all-to-all", 12, "middle")]
    kv = ("whole groups" if spread.kv_repeat is None
          else f"one per query head ({spread.kv_repeat} copies of each)")  # fmt: skip
    low = ULYSSES_TOP + num_heads * GRID + 18 + sp * 16 + 6
    body.append(_text(8, low, f"keys and values go the same way: {list(spread.kv_sizes)} heads a rank, {kv}", 12,
                      colour=MUTED))  # fmt: skip
    return _svg(2 * ULYSSES_LEFT + 2 * width + ULYSSES_GAP, low + 12, body)


# 5. expert-parallel token dispatch


def expert_layout(num_experts: int, ep: int):
    """The split ``MoETokenExchange`` gives stacked experts over ``ep`` ranks (whole experts, contiguous)."""
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2, 2, device="meta"))
    ctx = ShardContext(Mesh.dry_run(ep_size=ep, fsdp_size=ep))
    return MoETokenExchange().layouts(experts, ctx, "experts")["gate_up_proj"]


def dispatch(num_experts: int, ep: int, routed) -> list[list[tuple[int, int, int]]]:
    """Per EP rank, the (token, expert, destination rank) pairs it sends, grouped by expert as the exchange's
    stable argsort orders them (so by destination), each to the rank whose layout range holds the expert."""
    ranges = [pieces[0] for pieces in expert_layout(num_experts, ep).ranges]

    def holder(expert):
        return next(rank for rank, (start, stop) in enumerate(ranges) if start <= expert < stop)

    return [sorted(((token, expert, holder(expert)) for token, chosen in enumerate(tokens) for expert in chosen),
                   key=lambda pair: pair[1]) for tokens in routed]  # fmt: skip


def dispatch_svg(num_experts: int, ep: int, routed) -> str:
    """Each EP rank's (token, expert) pairs, in the order it sends them and in the colour of the rank they go to,
    and the table of how many each rank sends each: the all-to-all's split sizes (the combine sends them back)."""
    layout, pairs = expert_layout(num_experts, ep), dispatch(num_experts, ep, routed)
    chip, label, top = 56, 130, 96
    table = label + max(len(row) for row in pairs) * chip + 30
    body = [_text(8, 20, f"ep={ep}: {num_experts} experts, whole, {layout.describe()}", 15),
            _text(8, 40, "each rank routes its own tokens (here an example top-2 routing); t1→E4: its token 1 to "
                         "expert 4", 12, colour=MUTED),
            _text(label, top - 26, "pairs sent, grouped by expert", 12),
            _text(table, top - 26, "pairs sent to rank", 12)]  # fmt: skip
    for rank, ((start, stop),) in enumerate(layout.ranges):
        x = table + rank * 60
        body.append(_box(x, top - 20, 54, 16, _colour(rank), rx=3))
        body.append(_text(x + 27, top - 8, f"{rank}: E{start}-{stop - 1}" if stop - start > 1 else f"{rank}: E{start}",
                          10, "middle", "#fff"))  # fmt: skip
    for source, row in enumerate(pairs):
        y = top + source * 30
        body.append(_text(8, y + 15, f"rank {source}'s tokens"))
        for place, (token, expert, destination) in enumerate(row):
            body.append(_box(label + place * chip, y, chip - 4, 22, _colour(destination)))
            body.append(_text(label + place * chip + (chip - 4) / 2, y + 15, f"t{token}→E{expert}", 11, "middle",
                              "#fff"))  # fmt: skip
        for destination in range(ep):
            sent = sum(1 for _, _, to in row if to == destination)
            body.append(_text(table + destination * 60 + 27, y + 15, str(sent), 13, "middle"))
    low = top + ep * 30 + 16
    body += [_text(8, low, "dispatch: one all-to-all, these counts its split sizes; each rank runs its experts on "
                           "what arrives", 12, colour=MUTED),
             _text(8, low + 18, "combine: the outputs come back by the same table read the other way; the sender "
                                "weights them by", 12, colour=MUTED),
             _text(8, low + 36, "its router's weights and sums each token's k outputs", 12, colour=MUTED)]  # fmt: skip
    return _svg(table + ep * 60 + 8, low + 46, body)


# 6. serving


def serving_svg(sizes: dict) -> str:
    """Rank 0 of the TP group answers HTTP and schedules; every step it broadcasts the new requests and
    cancellations to the other ranks, and all of them run the same batch on their shards. (No function decides
    this beyond ``rank == 0`` in ``serving.server.serve``: the ranks are the mesh's TP group, the rest is words.)"""
    ranks = MeshShape.requested(**sizes).groups("tp")[0]
    leader, followers = ranks[0], ranks[1:]
    body = [_text(8, 20, f"hf-parallel serve at {' x '.join(f'{k[:-5]}={v}' for k, v in sizes.items())}: "
                         f"{len(ranks)} ranks, one batch", 15),
            _text(8, 40, "only rank 0 listens; the others follow in the continuous-batching manager's thread", 12,
                  colour=MUTED),
            _box(8, 66, 110, 40, "#bbb"), _text(63, 91, "clients", 13, "middle"),
            _arrow(120, 86, 176, 86), _text(148, 78, "HTTP", 11, "middle"),
            _box(180, 56, 230, 60, _colour(leader)),
            _text(295, 80, f"rank {leader}: HTTP app + scheduler", 13, "middle", "#fff"),
            _text(295, 98, "its shards, its KV heads' pages", 11, "middle", "#fff")]  # fmt: skip
    for place, rank in enumerate(followers):
        y = 150 + place * 50
        body += [_arrow(295, 118, 500, y + 18), _box(504, y, 220, 38, _colour(rank)),
                 _text(614, y + 16, f"rank {rank}: follows", 13, "middle", "#fff"),
                 _text(614, y + 31, "its shards, its KV heads' pages", 11, "middle", "#fff")]  # fmt: skip
    low = 150 + len(followers) * 50 + 10
    body += [_text(8, 150, "each step: the new requests and", 12, colour=MUTED),
             _text(8, 166, "cancellations, broadcast over the", 12, colour=MUTED),
             _text(8, 182, "TP group; every rank runs the same", 12, colour=MUTED),
             _text(8, 198, "batch and the same collectives", 12, colour=MUTED)]  # fmt: skip
    return _svg(732, max(low, 210), body)


def pictures() -> dict[str, str]:
    """File name under ``img/`` -> SVG text, every picture of how the styles move data."""
    return {
        "pp-1f1b.svg": schedule_svg("1f1b", **SCHEDULE),
        "pp-gpipe.svg": schedule_svg("gpipe", **SCHEDULE),
        "tp-colwise-rowwise.svg": split_svg(**SPLIT),
        "cp-ring-steps.svg": ring_svg(**RING),
        "sp-ulysses-all-to-all.svg": ulysses_svg(**ULYSSES),
        "ep-token-dispatch.svg": dispatch_svg(**EXPERTS, routed=ROUTED),
        "serve-rank0-followers.svg": serving_svg(SERVING),
    }


if __name__ == "<run_path>":  # the site build (mkdocs-gen-files runs this file); the tests import it
    import mkdocs_gen_files

    for file_name, text in pictures().items():
        with mkdocs_gen_files.open(f"img/{file_name}", "w") as f:
            f.write(text)
