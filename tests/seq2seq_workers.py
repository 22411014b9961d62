"""Encoder-decoders (T5, BART, Whisper): tiny random checkpoints, and the worker that compares a
tensor-parallel load (logits, gradients, greedy generation with its per-step logits, bytes held,
collectives per forward, a save) against one process. Runs inside a rank of ``distributed.run_ranks``."""

from __future__ import annotations

import os
import warnings

import torch
from compare import gap, gaps

COMMON = dict(vocab_size=101, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Geometry traps: T5's head size (d_kv=6) is not d_model / heads (8), so the heads must come from the
# attention module itself; BART's 5 heads split unevenly at TP=2 (3, 2) and TP=3 (2, 2, 1); every
# T5 / Whisper MLP width (80) and the vocab (101) split unevenly at TP=3.
# fmt: off
SEQ2SEQ = {
    "t5": ("T5Config", dict(d_model=48, d_kv=6, num_heads=6, d_ff=80, num_layers=2, num_decoder_layers=2,
                            relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0)),
    # T5 v1.1 / Flan-T5: gated MLP (wi_0, wi_1), and tie_word_embeddings=False, which transformers 5 reads
    # as "do not scale the decoder output by d_model**-0.5" (scale_decoder_outputs; the head stays tied)
    "t5_gated": ("T5Config", dict(d_model=48, d_kv=6, num_heads=6, d_ff=80, num_layers=2, num_decoder_layers=2,
                                  relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0,
                                  feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "bart": ("BartConfig", dict(d_model=40, encoder_attention_heads=5, decoder_attention_heads=5, encoder_ffn_dim=96,
                                decoder_ffn_dim=96, encoder_layers=2, decoder_layers=2, max_position_embeddings=64,
                                decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None)),
    "whisper": ("WhisperConfig", dict(d_model=48, encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=80,
                                      decoder_ffn_dim=80, encoder_layers=2, decoder_layers=2, num_mel_bins=8,
                                      max_source_positions=16, max_target_positions=32, decoder_start_token_id=1,
                                      suppress_tokens=None, begin_suppress_tokens=None)),
}
# fmt: on
SPEECH = {"whisper"}
NOISE = 0.05  # off their init: norms and biases distinguishable, logits ~1 (so 1e-5 is fp32 noise, not conditioning)

INPUT_IDS = torch.tensor([[1, 51, 42, 34, 99, 68, 8], [3, 64, 26, 76, 31, 9, 50]])
ATTENTION_MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])  # padding: masks in both attentions
DECODER_IDS = torch.tensor([[0, 17, 68, 25, 90], [0, 33, 51, 7, 100]])
LABELS = torch.tensor([[17, 68, 25, 90, 2], [33, 51, 7, 100, 2]])
MAX_NEW_TOKENS = 6


def input_features() -> torch.Tensor:
    """Whisper's log-mel input: [batch, mel bins, 2 x max_source_positions frames]."""
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(7))


def auto_name(name: str) -> str:
    return "AutoModelForSpeechSeq2Seq" if name in SPEECH else "AutoModelForSeq2SeqLM"


def make_seq2seq_checkpoint(name: str, root: str) -> str:
    """A seeded random encoder-decoder of ``name`` under ``root/name`` (once); returns the path."""
    import transformers

    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    class_name, overrides = SEQ2SEQ[name]
    config = getattr(transformers, class_name)(**{**COMMON, **overrides})
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, auto_name(name)).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * NOISE)
        if getattr(config, "scale_decoder_outputs", True) is False:
            # T5 v1.1: the d_model**-0.5 the model skips, put in the weights, for logits ~1 (1e-5 is fp32 noise)
            model.get_output_embeddings().weight.mul_(config.d_model**-0.5)
    model.save_pretrained(path)
    return path


def _inputs(family: str) -> dict:
    if family in SPEECH:
        return {"input_features": input_features()}
    return {"input_ids": INPUT_IDS, "attention_mask": ATTENTION_MASK}


def _step(model, family: str):
    out = model(**_inputs(family), decoder_input_ids=DECODER_IDS, labels=LABELS)
    return out.logits, out.loss


def _generate(model, family: str) -> dict:
    # no repeats: each step feeds the cache a new token, however flat the random model (raw logits compared)
    with torch.no_grad():
        out = model.generate(
            **_inputs(family),
            max_new_tokens=MAX_NEW_TOKENS,
            min_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            num_beams=1,
            no_repeat_ngram_size=1,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return {
        "tokens": out.sequences.tolist(),
        "logits": torch.stack(out.logits, 1),
        "cache": type(out.past_key_values).__name__,
    }


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied tensors counted once


def compare_seq2seq(rank: int, world_size: int, cases: dict, save_root: str) -> dict:
    """For each case (name -> (family, checkpoint path, tp_plan)): a tensor-parallel load against
    single-process transformers: logits and every gradient (this rank's slice of one process's), the
    collectives of one forward, greedy generation (tokens and every step's logits), the bytes this
    rank holds, and a gathered save under ``save_root/<name>``."""
    import transformers

    import hf_parallel
    from hf_parallel.distributed import comm

    results = {}
    for name, (family, path, tp_plan) in cases.items():
        single = getattr(transformers, auto_name(family)).from_pretrained(path, dtype=torch.float32)
        ref_logits, ref_loss = _step(single, family)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in single.named_parameters()}
        single.eval()
        ref_gen = _generate(single, family)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = getattr(hf_parallel, auto_name(family)).from_pretrained(path, tp_plan=tp_plan, dtype=torch.float32)
        state = hf_parallel.parallel_state(model)
        comm.COUNTS.clear()
        with torch.no_grad():
            model(**_inputs(family), decoder_input_ids=DECODER_IDS)
        counts = {op: comm.COUNTS[op] for op in ("all_reduce", "all_gather")}
        logits, loss = _step(model, family)
        loss.backward()
        grads = gaps(model, state, ref_grads, state.mesh.tp.rank)
        split = [entry.name for entry in state.layout.unique_params() if not entry.layout.is_replicated]
        model.zero_grad(set_to_none=True)
        gen = _generate(model, family)
        config = model.config
        results[name] = {
            "logits": gap(logits, ref_logits),
            "loss": gap(loss, ref_loss),
            "grads": grads,
            "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
            "split": split,
            "counts": counts,
            "encoder_layers": getattr(config, "encoder_layers", getattr(config, "num_layers", None)),
            "decoder_layers": getattr(config, "decoder_layers", getattr(config, "num_decoder_layers", None)),
            "tokens": gen["tokens"],
            "ref_tokens": ref_gen["tokens"],
            "generate_logits": gap(gen["logits"], ref_gen["logits"]),
            "cache": gen["cache"],
            "local_bytes": _bytes(model),
            "full_bytes": _bytes(single),
            "plan_source": state.layout.source,
            "warnings": [f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught],
            "heads": [state.layout.heads.local_q(r) for r in range(world_size)] if state.layout.heads else None,
        }
        model.save_pretrained(os.path.join(save_root, name))
    return results
