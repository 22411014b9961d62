"""Encoder-decoders (T5, T5 v1.1, BART, Whisper) at TP=2 and 3 against one process: logits,
gradients, greedy generation through an EncoderDecoderCache (tokens and every step's logits), the
bytes each rank holds, collectives per forward, and a save bitwise equal to the source. One spawned
group per world size runs every case. Also, with no processes: the tied vocabulary table split on
every module that holds it (the cause of the ``IndexError: index out of range`` these models hit),
T5's per-head position bias cut by heads, and what is still refused."""

import pytest
import seq2seq_workers
import torch
from checks import assert_same_checkpoint
from compare import MISSING, assert_within
from distributed import run_ranks
from seq2seq_workers import SEQ2SEQ, make_seq2seq_checkpoint

TOL = 1e-5
FAMILIES = sorted(SEQ2SEQ)
CASES = FAMILIES + ["t5_discovered"]  # discovery splits only T5's vocab (its tied table, on every holder)


@pytest.fixture(scope="module")
def seq2seq_paths(tiny_root):
    return {name: make_seq2seq_checkpoint(name, tiny_root) for name in SEQ2SEQ}


@pytest.fixture(scope="module")
def seq2seq_results(seq2seq_paths, tmp_path_factory):
    cases = {name: (name, path, "auto") for name, path in seq2seq_paths.items()}
    cases["t5_discovered"] = ("t5", seq2seq_paths["t5"], "discover")
    cache = {}

    def get(world_size):
        if world_size not in cache:
            root = tmp_path_factory.mktemp(f"seq2seq{world_size}")
            ranks = run_ranks(
                world_size, seq2seq_workers.compare_seq2seq, cases, str(root / "saved"), out_dir=str(root / "ranks")
            )
            cache[world_size] = (ranks, str(root / "saved"))
        return cache[world_size]

    return get


def expected_all_reduces(case: str, r: dict) -> int:
    """Per forward: each encoder layer's attention output and MLP down projection, each decoder layer's
    self-attention, cross-attention and MLP outputs, and each vocab-parallel lookup (T5 / BART: the
    encoder's and the decoder's; Whisper: the decoder's). Discovery splits only the vocabulary."""
    lookups = 1 if case == "whisper" else 2
    if case.endswith("discovered"):
        return lookups
    return 2 * r["encoder_layers"] + 3 * r["decoder_layers"] + lookups


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_encoder_decoder_matches_single_process(seq2seq_results, seq2seq_paths, case, world_size):
    ranks, saved = seq2seq_results(world_size)
    for rank, results in enumerate(ranks):
        r = results[case]
        where = f"{case} rank {rank}/{world_size}"
        assert_within({k: r[k] for k in ("logits", "loss", "generate_logits")}, atol=TOL, rtol=TOL, where=where)
        # Whisper's sinusoidal encoder positions: frozen by the model (transformers' from_pretrained re-enables them)
        grads = {n: g for n, g in r["grads"].items() if not (n in r["frozen"] and g == MISSING)}
        assert_within(grads, atol=TOL, rtol=TOL, where=f"{where} gradients")
        assert r["tokens"] == r["ref_tokens"], f"{where}: generated {r['tokens']}, one process {r['ref_tokens']}"
        assert r["cache"] == "EncoderDecoderCache"
        assert r["counts"] == {"all_reduce": expected_all_reduces(case, r), "all_gather": 1}, where
        assert not [w for w in r["warnings"] if "matches no module" in w or "Unsharded" in w], r["warnings"]
        if case.endswith("discovered"):
            assert r["plan_source"].startswith("discovered")
            continue
        assert r["plan_source"] == f"plans/{case.split('_')[0]}.toml"
        if world_size == 2:
            assert r["local_bytes"] <= 0.6 * r["full_bytes"], (
                f"{where}: holds {r['local_bytes']} of {r['full_bytes']} bytes"
            )
    split = ranks[0][case]["split"]
    if case in ("t5", "t5_gated"):
        assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in split
        assert "decoder.block.1.layer.1.EncDecAttention.k.weight" in split
    elif not case.endswith("discovered"):
        assert "model.decoder.layers.1.encoder_attn.v_proj.weight" in split
    assert_same_checkpoint(seq2seq_paths[case.split("_discovered")[0]], f"{saved}/{case}")


def _rank_model(path, tp_plan="auto", **sizes):
    import transformers

    from hf_parallel.build import build_rank_model
    from hf_parallel.commands.report import default_auto_class
    from hf_parallel.distributed.mesh import Mesh

    config = transformers.AutoConfig.from_pretrained(path)
    return build_rank_model(default_auto_class(config), config, torch.float32, Mesh.dry_run(**sizes), tp_plan)


@pytest.mark.parametrize("tp_plan", ["auto", "discover"])
def test_every_holder_of_the_tied_vocabulary_is_vocab_parallel(seq2seq_paths, tp_plan):
    """T5's ``shared`` table is also encoder.embed_tokens, decoder.embed_tokens and lm_head, four modules:
    a split table left to a plain lookup in one of them raised ``IndexError: index out of range``."""
    rules = _rank_model(seq2seq_paths["t5"], tp_plan, tp_size=2).layout.rules
    assert {
        path: rules[path].style_name for path in ("shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head")
    } == {
        "shared": "embedding_rowwise",
        "encoder.embed_tokens": "embedding_rowwise",
        "decoder.embed_tokens": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    }


def test_t5_splits_its_position_bias_by_heads_of_its_own_size(seq2seq_paths):
    layout = _rank_model(seq2seq_paths["t5"], tp_size=3).layout
    assert layout.heads.head_dim == 6  # d_kv, not d_model / heads (8)
    bias = layout.params["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    assert bias.layout.dim == 1 and [bias.layout.local_size(r) for r in range(3)] == [2, 2, 2]


def test_tied_vocabulary_rules_that_disagree_are_refused(seq2seq_paths):
    with pytest.raises(ValueError, match="share one tied weight"):
        _rank_model(
            seq2seq_paths["bart"],
            {"lm_head": "colwise_gather_output", "model.encoder.embed_tokens": "embedding_colwise"},
            tp_size=2,
        )


@pytest.mark.parametrize(
    "sizes", [dict(tp_size=2, sp_size=2), dict(tp_size=2, pp_size=2), dict(tp_size=1, fsdp_size=2)]
)
def test_encoder_decoders_are_split_by_tensor_parallelism_only(seq2seq_paths, sizes):
    with pytest.raises(ValueError, match="is an encoder-decoder .* tensor parallelism \\(tp_size\\) only"):
        _rank_model(seq2seq_paths["bart"], **sizes)


def test_encoder_and_decoder_with_different_heads_are_refused(tmp_path):
    import transformers

    config = transformers.BartConfig(vocab_size=101, d_model=48, encoder_attention_heads=6, decoder_attention_heads=3,
                                     encoder_layers=1, decoder_layers=1, encoder_ffn_dim=64, decoder_ffn_dim=64)  # fmt: skip
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="differ in their heads"):
        _rank_model(str(tmp_path), tp_size=2)


def test_verify_refuses_an_encoder_decoder_by_name(seq2seq_paths):
    from hf_parallel.commands.verify import verify

    with pytest.raises(ValueError, match="T5Config is an encoder-decoder, and verify compares a causal LM's layers"):
        verify(seq2seq_paths["t5"])
