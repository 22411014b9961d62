"""Workers of test_hybrids: tensor parallelism (tp_workers.compare_tp, with greedy generation) and, on
two ranks, pipeline stages, on checkpoints with recurrent mixers beside attention."""

from __future__ import annotations

import torch
from compare import gap
from tp_workers import INPUT_IDS, compare_tp


def tensor_and_pipeline(rank: int, world_size: int, cases: dict, save_root: str, pipelined: list) -> dict:
    """``compare_tp`` over ``cases`` (saves under ``save_root``, 6 greedy tokens); with ``pipelined``, a LoRA
    adapter on Bamba's mixer ``in_proj`` (the error it raises), and each checkpoint of ``pipelined`` in
    ``world_size`` pipeline stages: its logits' largest difference from one process's and
    its greedy tokens, both models'."""
    import transformers

    import hf_parallel

    results = {"tp": compare_tp(rank, world_size, cases, save_root, generate=6), "pp": {}}
    if pipelined:  # on two ranks: LoRA on a projection a mixer's block rule places
        import peft

        model = hf_parallel.AutoModelForCausalLM.from_pretrained(cases["bamba"][0], dtype=torch.float32)
        try:
            peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["in_proj"]))(INPUT_IDS)
            results["lora"] = None
        except ValueError as error:
            results["lora"] = f"ValueError: {error}"
        try:  # each rank's attention weights are its own heads'
            model(INPUT_IDS, output_attentions=True)
            results["output_attentions"] = None
        except ValueError as error:
            results["output_attentions"] = str(error)
    for name in pipelined:
        path = cases[name][0]
        single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, pp_size=world_size, dtype=torch.float32)
        with torch.no_grad():
            logits = gap(model(INPUT_IDS).logits, single(INPUT_IDS).logits)
        tokens = [m.generate(INPUT_IDS[:1], max_new_tokens=6, do_sample=False)[0].tolist() for m in (model, single)]
        results["pp"][name] = {"logits": logits, "tokens": tokens}
    return results
