"""What the suite spends, per test and per file: a pytest plugin and the table docs/contributing.md shows.

``HF_PARALLEL_TEST_COSTS=costs.jsonl pytest tests`` (tests/conftest.py registers this plugin when it is set)
appends one JSON line per test to that file: its wall time (setup, call and teardown), the rank groups it ran through
``distributed.run_ranks`` (their world sizes), and the child interpreters it started (a torchrun counted with
its ranks). ``python tests/suite_costs.py FILE.jsonl [--before LOG]`` prints the per-file and per-world-size
tables; ``LOG``, the output of an earlier ``pytest --durations=0`` run, adds each file's minutes then.
Nothing here changes what a test runs: it reads ``distributed.GROUPS`` and counts ``subprocess.Popen``s."""

from __future__ import annotations

import ast
import collections
import json
import os
import re
import subprocess
import sys
import time

import pytest

LAUNCHER = re.compile(r"torch\.distributed\.run|torchrun|accelerate")
RANKS = re.compile(r"--nproc[-_]per[-_]node[= ](\d+)")
_children = []  # the command line of every subprocess started during the current test


def _count_children() -> None:
    started = subprocess.Popen.__init__

    def counted(self, args, *rest, **kwargs):
        _children.append(" ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args))
        started(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = counted


_count_children()  # registered by tests/conftest.py only when the costs are asked for


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import distributed

    distributed.GROUPS.clear()
    _children.clear()
    begin = time.perf_counter()
    yield
    launched = [line for line in _children if LAUNCHER.search(line)]
    record = {
        "test": item.nodeid,
        "seconds": round(time.perf_counter() - begin, 3),
        "groups": list(distributed.GROUPS),  # world sizes
        "launches": [int(m.group(1)) if (m := RANKS.search(line)) else 1 for line in launched],
        "interpreters": len(_children) - len(launched),
    }
    with open(os.environ["HF_PARALLEL_TEST_COSTS"], "a") as f:
        f.write(json.dumps(record) + "\n")


def covers(test_file: str) -> str:
    """The first sentence of a test file's docstring: what it covers, in its own words."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), test_file)) as f:
        text = " ".join((ast.get_docstring(ast.parse(f.read())) or "").split())
    sentence = re.split(r"(?<=\.)\s", text, maxsplit=1)[0].rstrip(".").replace("|", "/")
    return sentence if len(sentence) <= 160 else sentence[:159].rsplit(" ", 1)[0] + " …"


def minutes_per_file(durations_log: str) -> dict[str, float]:
    """Each test file's minutes (setup, call and teardown) in the output of ``pytest --durations=0``."""
    seconds = collections.defaultdict(float)
    with open(durations_log) as f:
        for line in f:
            if found := re.match(r"([\d.]+)s (?:setup|call|teardown)\s+tests/([^:]+)::", line):
                seconds[found.group(2)] += float(found.group(1))
    return {name: total / 60 for name, total in seconds.items()}


def tables(records: list[dict], before: dict[str, float] | None = None) -> str:
    """Markdown: per file (tests, minutes, rank processes, other interpreters; ``before``: each file's minutes in
    an earlier run), then per largest world size."""
    files = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    worlds = collections.defaultdict(lambda: [0, 0.0])
    for record in records:
        row = files[record["test"].split("::")[0].removeprefix("tests/")]
        ranks = sum(record["groups"]) + sum(record["launches"])
        row[0] += 1
        row[1] += record["seconds"]
        row[2] += ranks
        row[3] += record["interpreters"]
        largest = max(record["groups"] + record["launches"], default=0)
        worlds[largest][0] += 1
        worlds[largest][1] += record["seconds"]
    def line(*cells) -> str:
        return "| " + " | ".join(map(str, cells)) + " |"

    header = ["file", "what it covers", "tests", "minutes", *(["minutes before"] if before else []), "rank processes",
              "other interpreters"]  # fmt: skip
    lines = [line(*header), line(*["---"] * len(header)).replace(" ", "")]
    for name, (tests, seconds, ranks, others) in sorted(files.items(), key=lambda item: -item[1][1]):
        then = [f"{before[name]:.2f}" if name in before else "-"] if before else []
        lines.append(line(name, covers(name), tests, f"{seconds / 60:.2f}", *then, ranks, others))
    total = [sum(row[i] for row in files.values()) for i in range(4)]
    then = [f"{sum(before.values()):.1f}"] if before else []
    lines.append(line("**all**", "", total[0], f"{total[1] / 60:.1f}", *then, total[2], total[3]))
    lines += ["", "| largest world a test starts | tests | minutes |", "|---|---|---|"]
    for world, (tests, seconds) in sorted(worlds.items()):
        lines.append(f"| {world or 'no rank group (one process, or plain programs it starts)'} | {tests} | "
                     f"{seconds / 60:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        records = [json.loads(line) for line in f]
    print(tables(records, minutes_per_file(sys.argv[3]) if sys.argv[2:3] == ["--before"] else None))
