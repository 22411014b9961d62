"""Plan discovery over every causal-LM architecture transformers can build from a tiny config.

For each model_type in transformers' causal-LM mapping: shrink its default config, build and save a
random model, then run it at TP=2 with ``tp_plan="discover"`` against one process (logits and
gradients, fp32). Writes docs/discovery_report.md. Outcomes:

- pass: logits within 1e-5, gradients within 1e-5 of the largest gradient (at least 1e-5 absolute),
  nothing left replicated;
- pass, replicated: within 1e-5, with modules discovery could not classify left whole (notes);
- error: loading or running raised (a clear error, not a wrong result);
- WRONG: ran but differs from single-process. Must never happen.
- not buildable: transformers cannot build, save or run the shrunken config in one process, or it
  stays over MAX_PARAMS (not counted).

    python scripts/discovery_report.py [--only gpt2 opt ...] [--out docs/discovery_report.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SIZES = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_key_value_heads": 2, "intermediate_size": 128, "ffn_dim": 128,
    "n_inner": 128, "vocab_size": 128, "max_position_embeddings": 128, "n_positions": 128, "head_dim": 16,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
}  # fmt: skip
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
MAX_PARAMS = 40_000_000  # some defaults stay large when shrunk (extra vocabularies, towers): not tiny


def shrink(model_type: str):
    """The default config of ``model_type`` with every size field we know set small: passed to the
    constructor where it is a field (so derived fields such as ``layer_types`` follow), else set."""
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    fields = default.to_dict()
    small = {name: value for name, value in {**SIZES, **TOKENS}.items() if name in fields}
    text = default.get_text_config() if hasattr(default, "get_text_config") else default
    if text is not default:  # a composite config: shrink its text part through its own constructor
        key = next((k for k, v in vars(default).items() if v is text), None)
        if key is not None:
            text_fields = text.to_dict()
            small[key] = {**text_fields, **{n: v for n, v in {**SIZES, **TOKENS}.items() if n in text_fields}}
            small[key].pop("layer_types", None)
    small.pop("layer_types", None)
    try:
        config = transformers.AutoConfig.for_model(model_type, **small)
    except Exception:  # noqa: BLE001 - some constructors reject sizes they derive themselves
        config = default
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for target in {id(config): config, id(text): text}.values():
        for name, value in {**SIZES, **TOKENS}.items():
            if name in target.to_dict() or hasattr(type(target), name):
                try:
                    setattr(target, name, value)
                except AttributeError:  # a derived property (e.g. Falcon's head_dim)
                    pass
    return config


def build(model_type: str, root: str) -> str:
    import torch
    import transformers

    config = shrink(model_type)
    with torch.device("meta"):  # count first: building a model that stayed large takes minutes
        count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if count > MAX_PARAMS:
        raise ValueError(f"{count / 1e6:.0f}M parameters after shrinking (limit {MAX_PARAMS / 1e6:.0f}M)")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    path = os.path.join(root, model_type)
    model.save_pretrained(path)
    return path


def sweep_cases(rank: int, world_size: int, paths: dict) -> dict:
    """A batch of architectures on one rank (one spawn per batch): compare each, or report its error."""
    import warnings

    os.environ["HF_PARALLEL_TIMEOUT"] = "60"  # a desynchronised architecture fails fast instead of hanging
    import transformers
    import tp_workers as workers

    from hf_parallel.build import build_empty
    from hf_parallel.tensor.discover import discover_plan

    warnings.simplefilter("ignore")
    results = {}
    for model_type, path in paths.items():
        try:
            workers.reference(path)
        except Exception as error:  # noqa: BLE001 - transformers itself cannot run the shrunken config
            results[model_type] = {
                "error": None,
                "unrunnable": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}",
            }
            continue
        try:
            config = transformers.AutoConfig.from_pretrained(path)
            notes = discover_plan(build_empty(transformers.AutoModelForCausalLM, config, None)).notes
            result = workers.compare_tp(rank, world_size, {"case": (path, "discover")}, None)["case"]
            results[model_type] = {**result, "notes": notes, "error": None}
        except Exception as error:  # noqa: BLE001 - reported, not raised
            results[model_type] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    return results


def worst_rank(ranks: list[dict]) -> dict:
    """Per architecture, over the ranks (each checks its own shard): the logits and every gradient beyond 1e-5
    (absolute, and of that tensor's scale: fp32 sums over tokens in another order), a NaN or a missing gradient
    among them, by rank; and any error."""
    from compare import failures

    merged = {}
    for model_type, first in ranks[0].items():
        outs = [rank[model_type] for rank in ranks]
        error = next((o["error"] for o in outs if o.get("error")), None)
        if error or first.get("unrunnable"):
            merged[model_type] = dict(first, error=error)
            continue
        records = [{"logits": o["logits"], **o["grads"]} for o in outs]
        merged[model_type] = {
            **first,
            "failures": [f"rank {r}: {text}" for r, rank in enumerate(records) for text in failures(rank, 1e-5, 1e-5)],
            "logits": max(o["logits"][0] for o in outs),
            "grads": max((g[0] for o in outs for g in o["grads"].values() if not isinstance(g, str)), default=0.0),
        }
    return merged


def outcome_of(out: dict) -> tuple[str, str]:
    if out.get("unrunnable"):
        return "not buildable", "one process of plain transformers fails on it: " + out["unrunnable"]
    if out["error"]:
        return "error", out["error"]
    if out["failures"]:
        return "WRONG", "; ".join(out["failures"][:3])
    if out["notes"]:
        return "pass, replicated", "; ".join(out["notes"])
    return "pass", f"logits {out['logits']:.1e}, grads {out['grads']:.1e}"


def main() -> None:
    import transformers
    from distributed import run_ranks
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--batch", type=int, default=24, help="architectures per spawned process group")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "discovery_report.md"))
    args = parser.parse_args()
    rows, counts = [], {"pass": 0, "pass, replicated": 0, "error": 0, "WRONG": 0, "not buildable": 0}
    with tempfile.TemporaryDirectory() as root:
        built = {}
        for model_type in args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                built[model_type] = build(model_type, root)
            except Exception as error:  # noqa: BLE001
                counts["not buildable"] += 1
                rows.append((model_type, "not buildable", f"{type(error).__name__}: {str(error)[:120]}"))
        names = sorted(built)
        for start in range(0, len(names), args.batch):
            batch = {name: built[name] for name in names[start : start + args.batch]}
            try:
                outs = worst_rank(run_ranks(2, sweep_cases, batch, out_dir=os.path.join(root, f"ranks{start}")))
            except Exception:  # noqa: BLE001 - a rank died: the whole batch is reported as errors
                died = "a rank died: " + traceback.format_exc().splitlines()[-1][:160]
                outs = dict.fromkeys(batch, {"error": died})
            for model_type, out in outs.items():
                outcome, detail = outcome_of(out)
                counts[outcome] += 1
                rows.append((model_type, outcome, detail.replace(root, "<tmp>")))
                print(f"{model_type:<28} {outcome:<18} {detail[:100]}", flush=True)
    rows.sort()
    lines = [
        "# Plan discovery over transformers' causal-LM architectures",
        "",
        f"`python scripts/discovery_report.py` with transformers {transformers.__version__}: every causal-LM "
        "model_type built from a shrunken default config (2 layers, hidden 64, 4 heads / 2 KV heads), run at "
        'TP=2 with `tp_plan="discover"` against one process (fp32; logits within 1e-5, gradients within 1e-5 of '
        "the largest gradient). *pass, replicated*: what discovery could not classify stayed whole (named). "
        "*error*: a clear error at load or run, never a wrong number. *WRONG* (ran and differs) must never happen. "
        f"*not buildable*: transformers cannot build, save or run the shrunken config in one process, or it stays "
        f"over {MAX_PARAMS // 10**6}M parameters; these say nothing about hf_parallel.",
        "",
        " | ".join(f"{k}: **{v}**" for k, v in counts.items()),
        "",
        "| model_type | outcome | detail |",
        "|---|---|---|",
    ] + [f"| {m} | {o} | {d.replace('|', '/')} |" for m, o, d in rows]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(counts)


if __name__ == "__main__":
    main()
