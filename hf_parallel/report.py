"""The plan dry run: what every parameter becomes on every rank, with no process and no weight read."""

from __future__ import annotations

import math

import torch
import transformers

from .api import build_empty, resolve_dtype
from .distributed.mesh import Mesh
from .tensor.parallelize import shard_plan
from .tensor.plan import resolve_plan


def plan_report(path: str, tp: int, tp_plan="auto", dtype=None, auto_class=transformers.AutoModelForCausalLM) -> str:
    config = transformers.AutoConfig.from_pretrained(path)
    dtype = resolve_dtype(dtype, config)
    model = build_empty(auto_class, config, dtype)
    shard = shard_plan(model, resolve_plan(model, tp_plan), Mesh.dry_run(tp_size=tp))
    itemsize = torch.empty((), dtype=dtype).element_size()
    lines = [f"plan for {path} ({config.model_type}) at tp={tp}: rules from {shard.plan.source}"]
    if shard.heads is not None:
        h = shard.heads
        lines.append(
            f"heads: q per rank {[h.local_q(r) for r in range(tp)]}, kv per rank {[h.local_kv(r) for r in range(tp)]}, head_dim {h.head_dim}"
        )
    lines.append(f"{'parameter':<48} {'rule':<34} {'style':<24} {'layout':<36} local shape per rank / bytes per rank")
    totals = [0] * tp
    for entry in shard.unique_params():
        rule = entry.rule
        shapes = [entry.layout.local_shape(entry.full_shape, r) for r in range(tp)]
        nbytes = [math.prod(s) * itemsize for s in shapes]
        totals = [t + n for t, n in zip(totals, nbytes)]
        name = entry.name + (f" (= {', '.join(entry.aliases[1:])})" if len(entry.aliases) > 1 else "")
        rule_text = f"{rule.pattern} [{rule.source}]" if rule else "-"
        shown = " ".join("x".join(map(str, s)) for s in shapes)
        lines.append(
            f"{name:<48} {rule_text:<34} {rule.style_name if rule else 'replicated':<24} {entry.layout.describe():<36} {shown} / {nbytes}"
        )
    lines += [f"left replicated by discovery: {note}" for note in shard.plan.notes]
    lines.append(
        f"bytes per rank: {totals} (full model {sum(math.prod(e.full_shape) for e in shard.unique_params()) * itemsize})"
    )
    return "\n".join(lines)
