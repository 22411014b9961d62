"""The docs site: it builds with ``--strict`` (a broken link, a missing page or a reference that no longer
resolves fails), its generated reference pages say what the code says, and the getting-started page's
commands marked ``<!-- ci: run -->`` run as written on this machine."""

import argparse
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUIET = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}  # a plugin's notice, not a warning


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **QUIET}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page.read_text())))


@pytest.mark.distributed  # not in the pure tier: a build process of a few seconds (the full run has it)
def test_the_site_builds_strict_with_its_reference_generated_from_the_code(site):
    """Every guide and reference page is there; the CLI page carries every subcommand's flags (from the
    parser), the styles and plans pages every registered style and shipped plan file, the errors page a
    message as its source writes it, the API page the docstrings, the benchmarks page a plot per table, the layout
    page the mesh pictures, the cookbook every example script."""
    from hf_parallel.commands.cli import build_parser
    from hf_parallel.tensor.registry import STYLES

    cli = _text(site / "reference" / "cli" / "index.html")
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    for name, sub in commands.choices.items():
        assert f"hf-parallel {name}" in cli
        for action in sub._actions:
            if action.help == argparse.SUPPRESS:  # an earlier spelling kept working, not shown
                continue
            assert all(flag in cli for flag in action.option_strings), (name, action.option_strings)
    styles = _text(site / "reference" / "styles" / "index.html")
    assert all(name in styles for name in STYLES)
    plans = _text(site / "reference" / "plans" / "index.html")
    assert all(path.name in plans for path in (ROOT / "plans").glob("*.toml"))
    errors = _text(site / "reference" / "errors" / "index.html")
    assert "is stored quantized with no" in errors and "hf_parallel.quant.formats" in errors
    assert 'ep_plan="auto"' in _text(site / "reference" / "api" / "index.html")
    plots = sorted((site / "img").glob("benchmark-*.png"))  # one under each benchmark table, from the table
    assert len(plots) >= 8 and all(plot.name in (site / "benchmarks" / "index.html").read_text() for plot in plots)
    layout = (site / "guides" / "choosing-a-layout" / "index.html").read_text()  # the mesh pictures, drawn at build
    drawn = sorted(path.name for path in (site / "img").glob("mesh-*.svg"))
    assert len(drawn) == 6 and all(f"img/{name}" in layout for name in drawn), drawn
    cookbook = re.sub(r"\s", "", _text(site / "cookbook" / "index.html"))  # each script shown whole (highlighted:
    for script in sorted((ROOT / "examples").glob("*.py")):  # compared without the spaces its markup adds)
        assert re.sub(r"\s", "", script.read_text().splitlines()[-1]) in cookbook, script.name
    for guide in ("inference", "serving", "tensor-parallel", "moe", "sequence-and-context", "pipeline", "training",
                  "fine-tuning", "quantized", "checkpoints", "compiling", "gpus", "multi-node", "hybrids"):
        assert (site / "guides" / guide / "index.html").is_file(), guide


def test_the_readme_is_short_and_names_no_tracker_numbers():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert readme.splitlines()[3:5] == [
        "bash scripts/run-default.sh   # fresh machine: set up, then generate with the embedded SmolLM2-135M-Instruct "
        "at TP=2 under torchrun",
        "bash .ci/run                  # fresh machine: set up, then run the test suite (what CI runs)",
    ]
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]
    for page in pages:
        assert not re.search(r"\b[Ii]ssues? #?\d", page.read_text()), page


def _getting_started_commands() -> list[str]:
    text = (ROOT / "docs" / "getting-started.md").read_text()
    return re.findall(r"<!-- ci: run -->\n```bash\n(.*?)\n```", text, re.S)


@pytest.mark.distributed
def test_the_getting_started_commands_run_as_written(tmp_path):
    """The first TP=2 generation, the plan (and its page), verify: each command as the page writes it."""
    commands = _getting_started_commands()
    assert len(commands) == 3
    outputs = []
    for command in commands:
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])  # its console scripts
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path}
        done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600, env=env)  # fmt: skip
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
        outputs.append(done.stdout)
    generated, planned, verified = outputs
    assert "tokens in" in generated, generated
    assert "bytes per rank" in planned and "memory per rank" in planned and (tmp_path / "plan.html").is_file(), planned
    assert "PASS" in verified, verified


def test_the_mesh_pictures_show_the_meshs_groups_and_the_zigzag():
    """The pictures drawn at site build (``docs/gen_mesh_pictures.py``, from the mesh code): at TP=2 x FSDP=2 the
    TP row's colours pair ranks (0, 1) and (2, 3), the FSDP row's (0, 2) and (1, 3); at TP=2 x SP=2 x FSDP=2, FSDP
    shards over the SP ranks too (4 ranks a group); under CP=2 rank 0 holds the first and last quarter."""
    import importlib.util
    from collections import defaultdict

    spec = importlib.util.spec_from_file_location("gen_mesh_pictures", ROOT / "docs" / "gen_mesh_pictures.py")
    pictures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pictures)

    def rows(svg: str) -> list[list[tuple[int, ...]]]:
        cells = defaultdict(lambda: defaultdict(list))  # row's y -> colour -> ranks
        for x, y, colour in re.findall(r'<rect x="([\d.]+)" y="(\d+)" width="[\d.]+" height="\d+" rx="5" '
                                       r'fill="(#\w+)"/>', svg):  # fmt: skip
            cells[int(y)][colour].append((float(x) - pictures.LABEL - 2) // pictures.CELL)
        return [sorted(tuple(int(r) for r in ranks) for ranks in row.values()) for _, row in sorted(cells.items())]

    assert rows(pictures.mesh_svg(dict(tp_size=2, fsdp_size=2))) == [[(0, 1), (2, 3)], [(0, 2), (1, 3)]]
    assert rows(pictures.mesh_svg(dict(tp_size=2, sp_size=2))) == [[(0, 1), (2, 3)], [(0, 2), (1, 3)]]  # no FSDP row
    tp, sp, fsdp = rows(pictures.mesh_svg(dict(tp_size=2, sp_size=2, fsdp_size=2)))
    assert tp == [(0, 1), (2, 3), (4, 5), (6, 7)] and sp == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert fsdp == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert pictures.token_owners(dict(cp_size=2), 16) == [0] * 4 + [1] * 8 + [0] * 4
    assert pictures.token_owners(dict(sp_size=2, cp_size=2), 16) == [0] * 4 + [2] * 4 + [3] * 4 + [1] * 4
    assert set(pictures.pictures()) == {f"mesh-{name}.svg" for name in [*pictures.LAYOUTS, *pictures.ZIGZAGS]}


# the hub ids the recipes name, and the copies of their config.json the suite holds (no hub here)
RECIPE_CONFIGS = {
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
}
RECIPE_FIGURE = re.compile(r"`hf-parallel plan (\S+) ([^`]*)` → weights \*\*([\d.]+) GiB\*\*"
                           r"(?:, a training step \*\*([\d.]+) GiB\*\*)? per GPU")  # fmt: skip


@pytest.mark.distributed  # not in the pure tier: seven plans of real-size configs, about ten seconds
def test_the_recipes_figures_are_what_plan_prints(capsys):
    """Each GB figure of the recipes page is what ``hf-parallel plan`` prints for its command, on the model's
    public config.json (tests/model_configs), rounded as the page rounds it."""
    from hf_parallel.commands.cli import main

    figures = RECIPE_FIGURE.findall((ROOT / "docs" / "guides" / "recipes.md").read_text())
    assert len(figures) >= 6, figures
    for model, flags, weights, step in figures:
        main(["plan", str(ROOT / "tests" / "model_configs" / RECIPE_CONFIGS[model]), *flags.split()])
        (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("memory per rank")]
        mib = {k: float(v.replace(",", "")) for k, v in re.findall(r"(weights|training step ~) ([\d,.]+) MiB", line)}
        assert f"{mib['weights'] / 1024:.1f}" == weights, (model, flags, line)
        if step:
            assert f"{mib['training step ~'] / 1024:.1f}" == step, (model, flags, line)


def test_the_parallel_pictures_show_what_the_styles_do():
    """The pictures of how each style moves data (``docs/gen_parallel_pictures.py``) read back as the code computes
    it: each lane of the 1F1B and GPipe pictures is that stage's ``schedule.order``, no forward before the previous
    stage's nor backward before the next's; the colwise / rowwise bands are 9 heads over 2 ranks as ``split_heads``
    cuts them (5 and 4); the ring's coloured pairs are ``RingPlan.pairs``'s, every causal pair once over the steps;
    the Ulysses grids split by ``token_sizes`` then ``head_spread``; each dispatched pair goes to its expert's rank."""
    import importlib.util
    from collections import defaultdict

    from hf_parallel.core.layout import even_sizes, sizes_to_ranges
    from hf_parallel.distributed.mesh import Mesh
    from hf_parallel.pipeline.schedule import order
    from hf_parallel.sequence.ring import RingPlan
    from hf_parallel.sequence.tokens import token_layout, token_sizes
    from hf_parallel.sequence.ulysses import head_spread
    from hf_parallel.tensor.heads import split_heads

    spec = importlib.util.spec_from_file_location("gen_parallel_pictures", ROOT / "docs" / "gen_parallel_pictures.py")
    pictures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pictures)
    drawn = pictures.pictures()

    def texts(svg: str, words: str) -> list[tuple[float, float, str, tuple[str, ...]]]:
        """(x, y, colour, the groups of ``words``) of each text that reads ``words``."""
        found = re.findall(r'<text x="([\d.]+)" y="([\d.]+)"[^>]*fill="(#\w+)">' + words + "</text>", svg)
        return [(float(x), float(y), colour, tuple(rest)) for x, y, colour, *rest in found]

    def owner(sizes, index: int) -> int:
        return next(rank for rank, (start, stop) in enumerate(sizes_to_ranges(sizes)) if start <= index < stop)

    stages, count = pictures.SCHEDULE["stages"], pictures.SCHEDULE["count"]
    for schedule in ("1f1b", "gpipe"):
        lanes = defaultdict(list)  # y -> (slot, step)
        for x, y, _, (step, m) in texts(drawn[f"pp-{schedule}.svg"], r"([FB])(\d+)"):
            lanes[y].append((int((x - pictures.SCHEDULE_LABEL) // pictures.SLOT), (step, int(m))))
        lanes = [sorted(lane) for _, lane in sorted(lanes.items())]
        assert [[step for _, step in lane] for lane in lanes] == [order(schedule, s, stages, count)
                                                                  for s in range(stages)]  # fmt: skip
        slot = {(stage, step): at for stage, lane in enumerate(lanes) for at, step in lane}
        for (stage, (step, m)), at in slot.items():
            waits_for = (stage - 1, ("F", m)) if step == "F" else (stage + 1, ("B", m))
            assert waits_for not in slot or slot[waits_for] < at, (schedule, stage, step, m)
    for stage in range(stages):  # 1F1B holds the warm-up and one more; GPipe every micro-batch
        assert f"stage {stage}: holds at most {min(stages - stage, count)}" in drawn["pp-1f1b.svg"]
        assert f"stage {stage}: holds at most {count}" in drawn["pp-gpipe.svg"]

    split, bands = pictures.SPLIT, drawn["tp-colwise-rowwise.svg"]
    heads = split_heads(split["num_heads"], split["num_heads"], split["head_dim"], split["tp"])
    features = [(stop - start) * split["head_dim"] for start, stop in heads.q_ranges]
    rects = [tuple(map(float, r)) for r in re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)" '
                                                        r'height="([\d.]+)" rx="0"', bands)]  # fmt: skip
    colwise = [height / pictures.FEATURE for x, _, height in rects if x == rects[0][0]]
    rowwise = [width / pictures.FEATURE for x, width, _ in rects if x != rects[0][0]]
    assert colwise == rowwise == features == [20, 16]
    assert "chunks(dim=0, sizes=[20,16])" in bands and "chunks(dim=1, sizes=[20,16])" in bands

    cp, tokens = pictures.RING["cp"], pictures.RING["tokens"]
    layout, computed = token_layout(tokens, 1, cp), defaultdict(set)
    for x, y, colour, (qi, ki) in texts(drawn["cp-ring-steps.svg"], r"q(\d+) k(\d+)"):
        rank = int((y - pictures.RING_TOP) // pictures.RING_ROW)
        step = int((x - pictures.RING_LABEL) // pictures.RING_CELL)
        if colour == "#fff":  # white on the sending rank's colour: computed; grey: skipped
            computed[rank, step].add((int(qi), int(ki)))
    for rank in range(cp):
        plan = RingPlan(layout, Mesh.dry_run(rank=rank, cp_size=cp).cp, None, 1.0, None, None, 1)
        for step in range(cp):
            assert computed[rank, step] == {(qi, ki) for _, qi, _, ki, _ in plan.pairs(step)}, (rank, step)
        met = sorted(pair for step in range(cp) for pair in computed[rank, step])
        assert met == sorted((q, k) for q in layout.chunks_of(rank) for k in range(2 * cp) if k <= q)

    u = pictures.ULYSSES
    width = u["tokens"] * pictures.GRID
    cells = re.findall(r'<rect x="([\d.]+)" y="([\d.]+)" width="[\d.]+" height="[\d.]+" rx="2" fill="(#\w+)"', drawn[
        "sp-ulysses-all-to-all.svg"])  # fmt: skip
    q_sizes = head_spread(u["num_heads"], u["num_kv_heads"], u["sp"]).q_sizes
    for x, y, colour in cells:
        after, column = divmod(float(x) - pictures.ULYSSES_LEFT, width + pictures.ULYSSES_GAP)
        token, head = int(column // pictures.GRID), int((float(y) - pictures.ULYSSES_TOP) // pictures.GRID)
        rank = owner(q_sizes, head) if after else owner(token_sizes(u["tokens"], u["sp"]), token)
        assert colour == pictures.COLOURS[rank], (after, token, head)
    assert len(cells) == 2 * u["tokens"] * u["num_heads"]

    e = pictures.EXPERTS
    chips = re.findall(r'fill="(#\w+)"/>\n<text[^>]*>t(\d+)→E(\d+)</text>', drawn["ep-token-dispatch.svg"])
    assert f"chunks(dim=0, sizes=[{','.join(map(str, even_sizes(e['num_experts'], e['ep'])))}])" in drawn[
        "ep-token-dispatch.svg"]  # fmt: skip
    for colour, _, expert in chips:
        assert colour == pictures.COLOURS[owner(even_sizes(e["num_experts"], e["ep"]), int(expert))]
    sent = [(int(t), int(x)) for _, t, x in chips]
    assert sent == [pair for routed in pictures.ROUTED
                    for pair in sorted(((t, x) for t, chosen in enumerate(routed) for x in chosen), key=lambda p: p[1])]

    assert "rank 0: HTTP app + scheduler" in drawn["serve-rank0-followers.svg"]
    assert all(f"rank {rank}: follows" in drawn["serve-rank0-followers.svg"] for rank in (1, 2, 3))
    assert set(drawn) == {"pp-1f1b.svg", "pp-gpipe.svg", "tp-colwise-rowwise.svg", "cp-ring-steps.svg",
                          "sp-ulysses-all-to-all.svg", "ep-token-dispatch.svg", "serve-rank0-followers.svg"}
