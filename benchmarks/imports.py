"""What importing costs: RSS of a fresh interpreter after reaching ``AutoModelForCausalLM``, from
hf_parallel against transformers, alternating, medians of ``--runs``.

    python benchmarks/imports.py [--runs 5]

transformers' own entry point is the bar: a user of hf_parallel imports it instead, and hf_parallel
imports what a path needs (the mesh, FSDP, peft, the pipeline's and sequence split's machinery)
only when that path runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBES = {
    "transformers": "import transformers; transformers.AutoModelForCausalLM",
    "hf_parallel": "import hf_parallel; hf_parallel.AutoModelForCausalLM",
}
READ = """
def kib(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1])
import json; print(json.dumps({'rss': kib('VmRSS') * 1024, 'peak': kib('VmHWM') * 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    readings = {name: [] for name in PROBES}
    for _ in range(args.runs):
        for name, code in PROBES.items():
            done = subprocess.run(
                [sys.executable, "-c", code + "\n" + READ], capture_output=True, text=True, check=True
            )
            readings[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    median = {
        name: {k: statistics.median(r[k] for r in rs) / 2**20 for k in ("rss", "peak")} for name, rs in readings.items()
    }
    for name, row in median.items():
        print(f"{name:<13} RSS after import {row['rss']:6.0f} MiB   peak {row['peak']:6.0f} MiB")
    ratio = median["hf_parallel"]["rss"] / median["transformers"]["rss"]
    print(
        f"import RSS, hf_parallel over transformers: {ratio:.2f}x (target <= 1.05): {'met' if ratio <= 1.05 else 'missed'}"
    )


if __name__ == "__main__":
    main()
