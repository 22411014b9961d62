"""``hf-parallel plan --html``: one self-contained page with the text report's facts, read back and compared
with the text; opened in headless Chromium (Debian's, driven by Playwright): it renders, with no console
errors and no request leaving the page."""

import json
import os
from html.parser import HTMLParser

import pytest

CHROMIUM = "/usr/bin/chromium"
# Chromium on a closed network: no background connections (each refused would be logged)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
WHOLE_DOWN_PROJ = {  # llama's plan less down_proj: a matrix held whole on every rank, for the page to flag
    "embed_tokens": "embedding_rowwise", "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "lm_head": "colwise_gather_output",
}  # fmt: skip


class _Page(HTMLParser):
    """The parameter rows' data attributes, the mesh's rank boxes and the bars' widths."""

    def __init__(self):
        super().__init__()
        self.params, self.ranks, self.whole, self.bars = [], 0, [], 0

    def handle_starttag(self, tag, attrs):
        attrs, classes = dict(attrs), dict(attrs).get("class", "").split()
        if tag == "tr" and "param" in classes:
            self.params.append({k[5:]: v for k, v in attrs.items() if k.startswith("data-")})
            if "whole" in classes:
                self.whole.append(attrs["data-name"])
        self.ranks += tag == "td" and "rank" in classes
        self.bars += tag == "div" and "bar" in classes


@pytest.fixture(scope="module")
def page(tiny_paths, tmp_path_factory):
    """The plan of a tiny Llama at TP=2 x FSDP=2 with down_proj left whole, as text and as a page (in this
    process: the CLI's ``--html`` runs in the getting-started test, ``test_docs.py``)."""
    from hf_parallel.commands.plan_html import render
    from hf_parallel.commands.report import plan_facts

    facts = plan_facts(tiny_paths["llama"], 2, tp_plan=WHOLE_DOWN_PROJ, fsdp_size=2)
    out = str(tmp_path_factory.mktemp("plan_html") / "plan.html")
    with open(out, "w") as f:
        f.write(render(facts))
    parsed = _Page()
    with open(out) as f:
        parsed.feed(f.read())
    return "\n".join(facts.lines()), parsed, out


def test_the_page_shows_the_text_reports_facts(page):
    """Every parameter row of the text (name, style, layout, local shapes, bytes per rank) is a row of the page,
    in order; the mesh has a box per rank (TP=2 x FSDP=2: 4); the bars are each TP rank's weights and, under
    FSDP, at rest; the matrices held whole on every rank are exactly the text's replicated 2-D rows."""
    text, parsed, _ = page
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("parameter "))
    rows = lines[header + 1 : next(i for i, line in enumerate(lines) if line.startswith("bytes per rank:"))]
    want = []
    for line in rows:
        shown, nbytes = line.rsplit(" / ", 1)
        words = shown.split()
        name = words[0] + (" " + shown[shown.index("(="):shown.index(")") + 1] if "(=" in shown else "")
        want.append({"name": name, "bytes": json.dumps(json.loads(nbytes)), "shapes": " ".join(words[-2:])})
    got = [{"name": p["name"], "bytes": p["bytes"], "shapes": p["shapes"]} for p in parsed.params]
    assert got == want
    for row, line in zip(parsed.params, rows):
        assert f" {row['style']} " in line and row["layout"] in line, (row, line)
    assert parsed.ranks == 4 and parsed.bars == 2 * 2
    replicated_matrices = [p["name"] for p in parsed.params
                           if p["style"] == "replicated" and "x" in p["shapes"].split()[0]]  # fmt: skip
    assert parsed.whole == replicated_matrices
    assert parsed.whole == [f"model.layers.{n}.mlp.down_proj.weight" for n in range(2)], parsed.whole


def test_the_page_renders_in_headless_chromium(page):
    """Opened from disk in Chromium: no console error, no request beyond the file itself, a row per parameter,
    and a module's row opens onto its parameters."""
    if not os.path.exists(CHROMIUM):
        if os.environ.get("HF_PARALLEL_REQUIRE_BROWSER"):
            pytest.fail(f"{CHROMIUM} is missing, and HF_PARALLEL_REQUIRE_BROWSER is set (CI installs it)")
        pytest.skip(f"no {CHROMIUM} (Debian's chromium package; CI installs it)")
    from playwright.sync_api import sync_playwright

    _, parsed, out = page
    errors, requests = [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        view = browser.new_page()
        view.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        view.on("pageerror", lambda error: errors.append(str(error)))
        view.on("request", lambda request: requests.append(request.url))
        view.goto("file://" + os.path.abspath(out))
        assert view.locator("tr.param").count() == len(parsed.params)
        module = view.locator("details.whole").first
        assert not module.locator("tr.param").first.is_visible()
        module.locator("summary").click()
        assert module.locator("tr.param").first.is_visible()
        browser.close()
    assert errors == [] and requests == ["file://" + os.path.abspath(out)], (errors, requests)
