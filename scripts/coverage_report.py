"""hf_parallel beside transformers' native ``tp_plan="auto"`` on the newer families, as a new user tries them.

Each family is a tiny random checkpoint of transformers' own class (tests/tiny_models.py ``HYBRIDS``,
tests/seq2seq_workers.py ``SEQ2SEQ``), loaded at TP=2 both ways in one spawned pair of ranks. Per
implementation: the largest logit difference from one process (fp32), the share of the parameters the
most loaded rank holds, and whether greedy generation gives one process's tokens; or the error it
raised. Writes docs/coverage_report.md (the README's coverage table is copied from it).

    python scripts/coverage_report.py [--only bamba t5 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _local_numel(model) -> int:
    """The parameters this rank holds (a DTensor counts its local shard)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def _try(load, run) -> dict:
    try:
        model = load()
        return run(model)
    except Exception as error:  # noqa: BLE001 - reported, not raised
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}


def both_ways(rank: int, world_size: int, cases: dict) -> dict:
    """Every case loaded by hf_parallel and by transformers' native TP, each compared with one process."""
    import torch
    import transformers
    from seq2seq_workers import SEQ2SEQ, _generate, _inputs, auto_name
    from tp_workers import INPUT_IDS

    import hf_parallel

    out = {}
    for name, path in cases.items():
        seq2seq = name in SEQ2SEQ
        auto = auto_name(name) if seq2seq else "AutoModelForCausalLM"

        def run(model, single):
            with torch.no_grad():
                if seq2seq:
                    logits = model(**_inputs(name), decoder_input_ids=torch.zeros(2, 3, dtype=torch.long)).logits
                    want = single(**_inputs(name), decoder_input_ids=torch.zeros(2, 3, dtype=torch.long)).logits
                    same = _generate(model, name)["tokens"] == _generate(single, name)["tokens"]
                else:
                    logits, want = model(INPUT_IDS).logits, single(INPUT_IDS).logits
                    same = all(
                        torch.equal(m.generate(INPUT_IDS[:1], max_new_tokens=6, do_sample=False), g)
                        for m, g in [(model, single.generate(INPUT_IDS[:1], max_new_tokens=6, do_sample=False))]
                    )
            held = _local_numel(model) / sum(p.numel() for p in single.parameters())
            diff = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits) - want
            return {"logits": diff.abs().max().item(), "held": held, "generate": same}

        single = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32)
        out[name] = {
            "hf_parallel": _try(
                lambda: getattr(hf_parallel, auto).from_pretrained(path, tp_plan="auto", dtype=torch.float32),
                lambda m: run(m, single),
            ),
            "transformers": _try(
                lambda: getattr(transformers, auto).from_pretrained(path, tp_plan="auto", dtype=torch.float32),
                lambda m: run(m, single),
            ),
        }
    return out


def cell(ranks: list[dict], name: str, impl: str) -> str:
    results = [rank[name][impl] for rank in ranks]
    error = next((r["error"] for r in results if "error" in r), None)
    if error:
        return f"error: {error}"
    logits, held = max(r["logits"] for r in results), max(r["held"] for r in results)
    verdict = "right" if logits < 1e-5 and all(r["generate"] for r in results) else "**WRONG**"
    return f"{verdict}, {held:.2f} of the weights a rank (logits {logits:.0e})"


def main() -> None:
    import transformers
    from distributed import run_ranks
    from seq2seq_workers import SEQ2SEQ, make_seq2seq_checkpoint
    from tiny_models import HYBRIDS, make_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "coverage_report.md"))
    args = parser.parse_args()
    names = args.only or sorted(HYBRIDS) + sorted(SEQ2SEQ)
    with tempfile.TemporaryDirectory() as root:
        paths = {n: (make_seq2seq_checkpoint if n in SEQ2SEQ else make_checkpoint)(n, root) for n in names}
        ranks = run_ranks(2, both_ways, paths, out_dir=os.path.join(root, "ranks"))
    lines = [
        "# hf_parallel and transformers' native TP on the newer families",
        "",
        f"`python scripts/coverage_report.py`, transformers {transformers.__version__}, TP=2 on two gloo ranks: tiny "
        'random checkpoints of transformers\' own classes, `tp_plan="auto"` both ways, fp32. *right*: logits within '
        "1e-5 of one process and the same greedy tokens; the share is the most loaded rank's.",
        "",
        '| family | hf_parallel | transformers `tp_plan="auto"` |',
        "|---|---|---|",
    ] + [f"| {n} | {cell(ranks, n, 'hf_parallel')} | {cell(ranks, n, 'transformers')} |" for n in names]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
