"""Pictures of the mesh, drawn at site build (mkdocs-gen-files) from the mesh code itself: each rank's group in
every dimension comes from ``MeshShape.groups``, and which tokens a rank holds under CP from ``token_layout``,
so a picture cannot drift from what the ranks do. ``docs/guides/choosing-a-layout.md`` shows them."""

from __future__ import annotations

from html import escape

from hf_parallel.distributed.shape import MeshShape
from hf_parallel.sequence.tokens import token_layout, token_range

# what each dimension does, as a row's label says it (only the dimensions a layout has more than one of)
ROWS = {
    "tp": "tp: splits each layer",
    "ulysses": "sp: splits the tokens",
    "cp": "cp: the ring of sp groups",
    "fsdp": "fsdp: shards what a rank keeps",
    "dp_replicate": "replicas: a whole copy each",
    "pp": "pp: runs of layers",
}
COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")
LABEL, CELL, ROW, TOP = 260, 64, 34, 56

# name -> the sizes a picture draws (the layouts the layout guide discusses, on 4 and 8 GPUs)
LAYOUTS = {
    "tp2-fsdp2": dict(tp_size=2, fsdp_size=2),
    "tp2-sp2": dict(tp_size=2, sp_size=2),
    "tp2-fsdp4": dict(tp_size=2, fsdp_size=4),
    "tp2-sp2-fsdp2": dict(tp_size=2, sp_size=2, fsdp_size=2),
}
ZIGZAGS = {"cp2-tokens16": dict(cp_size=2), "sp2-cp2-tokens16": dict(sp_size=2, cp_size=2)}


def _text(x: float, y: float, words: str, size: int = 13, anchor: str = "start", colour: str = "#222") -> str:
    return (f'<text x="{x}" y="{y}" font-family="sans-serif" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{colour}">{escape(words)}</text>')  # fmt: skip


def _svg(width: int, height: int, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">\n' + "\n".join(body) + "\n</svg>\n")  # fmt: skip


def _title(sizes: dict) -> str:
    return " x ".join(f"{name.removesuffix('_size')}={size}" for name, size in sizes.items())


def mesh_svg(sizes: dict) -> str:
    """One row per dimension the layout has, one column per rank: a rank's cell has its group's colour in that
    row (ranks of one colour form one group of it) and reads ``index/size``, its place in the group."""
    shape = MeshShape.requested(**sizes)
    world = shape.world_size
    drawn = {dim: len(shape.groups(dim)[0]) > 1 for dim in ROWS}
    drawn["fsdp"] &= shape.dp_shard > 1  # (its groups hold the sequence ranks even where nothing is sharded)
    dims = [dim for dim in ROWS if drawn[dim]]
    body = [_text(8, 20, f"{_title(sizes)}: {world} GPUs", 15),
            _text(8, 40, "ranks of one colour in a row form one group of that dimension", 12, colour="#555")]
    for column in range(world):
        body.append(_text(LABEL + column * CELL + CELL / 2, TOP - 2, f"rank {column}", 12, "middle"))
    for row, dim in enumerate(dims):
        y = TOP + 6 + row * ROW
        body.append(_text(8, y + 20, ROWS[dim]))
        for index, group in enumerate(shape.groups(dim)):
            for place, rank in enumerate(group):
                x = LABEL + rank * CELL
                body.append(f'<rect x="{x + 2}" y="{y}" width="{CELL - 4}" height="{ROW - 6}" rx="5" '
                            f'fill="{COLOURS[index % len(COLOURS)]}"/>')  # fmt: skip
                body.append(_text(x + CELL / 2, y + 19, f"{place}/{len(group)}", 12, "middle", "#fff"))
    return _svg(LABEL + world * CELL + 8, TOP + 12 + len(dims) * ROW, body)


def token_owners(sizes: dict, tokens: int) -> list[int]:
    """The rank holding each position of a ``tokens``-long sequence (padding included) under ``sizes``:
    the zigzag chunks of ``token_layout``, in the ranks of the first sequence group."""
    shape = MeshShape.requested(**sizes)
    layout = token_layout(tokens, shape.ulysses, shape.cp)
    order = [chunk for group in range(layout.cp) for chunk in layout.chunks_of(group)]
    chunk = layout.chunk or layout.length
    ranks = shape.groups("sp")[0]
    owners = [0] * layout.length
    for member, rank in enumerate(ranks):
        start, stop = token_range(layout.sizes, member)
        for held in range(start, stop):  # a place in the ranks' order -> its position in the sequence
            owners[order[held // chunk] * chunk + held % chunk] = rank
    return owners


def zigzag_svg(sizes: dict, tokens: int) -> str:
    """The sequence as a strip of positions, each in the colour of the rank holding it, the chunks marked."""
    owners = token_owners(sizes, tokens)
    shape, cell = MeshShape.requested(**sizes), 34
    chunk = token_layout(tokens, shape.ulysses, shape.cp).chunk
    body = [_text(8, 20, f"{_title(sizes)}: {tokens} tokens over {shape.world_size} GPUs", 15),
            _text(8, 40, f"{2 * shape.cp} chunks of {chunk}: ring group g holds chunks g and {2 * shape.cp - 1} - g",
                  12, colour="#555")]  # fmt: skip
    for position, rank in enumerate(owners):
        x = 8 + position * cell
        body.append(f'<rect x="{x + 1}" y="56" width="{cell - 2}" height="30" rx="4" '
                    f'fill="{COLOURS[rank % len(COLOURS)]}"/>')  # fmt: skip
        body.append(_text(x + cell / 2, 76, str(position), 12, "middle", "#fff"))
        if position % chunk == 0:
            body.append(f'<line x1="{x}" y1="50" x2="{x}" y2="92" stroke="#222" stroke-width="2"/>')
    body.append(_text(8, 110, "colour: the rank holding the position; each rank gets equal causal work", 12,
                      colour="#555"))  # fmt: skip
    for rank in sorted(set(owners)):
        x = 8 + rank * 90
        body.append(f'<rect x="{x}" y="120" width="16" height="16" rx="3" fill="{COLOURS[rank % len(COLOURS)]}"/>')
        body.append(_text(x + 22, 133, f"rank {rank}", 12))
    return _svg(max(16 + len(owners) * cell, 620), 146, body)


def pictures() -> dict[str, str]:
    """File name under ``img/`` -> SVG text, every picture the docs show."""
    drawn = {f"mesh-{name}.svg": mesh_svg(sizes) for name, sizes in LAYOUTS.items()}
    drawn.update({f"mesh-{name}.svg": zigzag_svg(sizes, 16) for name, sizes in ZIGZAGS.items()})
    return drawn


if __name__ == "<run_path>":  # the site build (mkdocs-gen-files runs this file); the tests import it
    import mkdocs_gen_files

    for file_name, text in pictures().items():
        with mkdocs_gen_files.open(f"img/{file_name}", "w") as f:
            f.write(text)
