"""Plan rules: matching, precedence, sources, validation, the registry and the dry run."""


import pytest
import torch

import hf_parallel
from hf_parallel.build import build_empty
from hf_parallel.tensor.plan import resolve_plan
from hf_parallel.tensor.registry import STYLES
from hf_parallel.tensor.rules import Plan, validate_rule
from hf_parallel.tensor.styles import ParallelStyle


def test_most_specific_rule_wins_whatever_the_order():
    a = validate_rule("layers.*.self_attn.q_proj", "colwise", "t")
    b = validate_rule("layers.0.self_attn.q_proj", "rowwise", "t")
    for order in ([a, b], [b, a]):
        plan = Plan(list(order), "t", "model")
        assert plan.rule_for("model.layers.0.self_attn.q_proj").style_name == "rowwise"
        assert plan.rule_for("model.layers.1.self_attn.q_proj").style_name == "colwise"


def test_full_paths_and_base_relative_paths_both_match():
    plan = Plan(
        [
            validate_rule("model.layers.*.mlp.up_proj", "colwise", "t"),
            validate_rule("lm_head", "colwise_gather_output", "t"),
        ],
        "t",
        "model",
    )
    assert plan.rule_for("model.layers.3.mlp.up_proj").pattern == "model.layers.*.mlp.up_proj"
    assert plan.rule_for("lm_head").style_name == "colwise_gather_output"
    assert plan.rule_for("model.layers.3.mlp.down_proj") is None
    assert plan.rule_for("model.layers.3.mlp.up_proj.extra") is None  # '*' is one whole component


def test_equally_specific_conflicting_rules_are_an_error():
    plan = Plan(
        [validate_rule("layers.*.mlp.up_proj", "colwise", "t"), validate_rule("*.0.mlp.up_proj", "rowwise", "t")],
        "t",
        "model",
    )
    with pytest.raises(ValueError, match="conflicting plan rules"):
        plan.rule_for("model.layers.0.mlp.up_proj")


def test_unknown_style_lists_registered_styles():
    with pytest.raises(
        ValueError, match=r"unknown parallel style 'colwize' \(rule 'layers\.\*\.q'\); registered styles: .*colwise"
    ):
        validate_rule("layers.*.q", "colwize", "t")


@pytest.mark.parametrize("pattern", ["layers..q", "layers.*.q proj", "layers.[0-9].q", ""])
def test_malformed_rules_are_rejected(pattern):
    with pytest.raises(ValueError, match="malformed plan rule"):
        validate_rule(pattern, "colwise", "t")


def meta_model(path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    return build_empty(transformers.AutoModelForCausalLM, config, torch.float32)


def test_auto_prefers_curated_file_then_transformers(tiny_paths, tiny_root):
    import transformers

    assert resolve_plan(meta_model(tiny_paths["phi3"]), "auto").source == "plans/phi3.toml"
    config = transformers.GraniteConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = build_empty(transformers.AutoModelForCausalLM, config, torch.float32)
    plan = resolve_plan(model, "auto")
    assert plan.source == "transformers GraniteConfig.base_model_tp_plan"
    assert {r.pattern: r.style_name for r in plan.rules}["layers.*.self_attn.q_proj"] == "colwise"


def test_rule_matching_nothing_warns_naming_it(tiny_paths):
    model = meta_model(tiny_paths["llama"])
    plan = resolve_plan(model, {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.nonexistent": "rowwise"})
    with pytest.warns(UserWarning, match=r"'layers\.\*\.mlp\.nonexistent' .* matches no module"):
        plan.assign(model)


def test_register_style_and_plan(tiny_paths):
    class Quiet(ParallelStyle):
        pass

    hf_parallel.register_style("quiet_test_style", Quiet(), overwrite=True)
    assert isinstance(STYLES["quiet_test_style"], Quiet)
    with pytest.raises(ValueError, match="already registered"):
        hf_parallel.register_style("colwise", Quiet())
    hf_parallel.register_plan(
        "starcoder2", {"layers.*.mlp.c_fc": "colwise", "layers.*.mlp.c_proj": "rowwise"}, source="my plan"
    )
    try:
        model = meta_model(tiny_paths["starcoder2"])
        assert resolve_plan(model, "auto").source == "my plan"
    finally:
        from hf_parallel.tensor import plan as plan_module

        plan_module._REGISTERED.pop("starcoder2")
        plan_module._FILES_LOADED = False


def test_plans_ship_inside_the_installed_package():
    from importlib import resources

    names = {entry.name for entry in resources.files("hf_parallel.plans").iterdir()}
    assert {"llama.toml", "phi3.toml", "qwen3.toml", "olmo2.toml", "gpt_neox.toml", "starcoder2.toml"} <= names


def test_plan_dry_run_prints_layouts_per_rank(smollm2):
    from hf_parallel.commands.report import plan_report

    out = plan_report(smollm2, 4)  # (the command line itself: the pipeline plan and getting-started tests)
    assert "rules from plans/llama.toml" in out
    assert "q per rank [2, 1, 3, 3], kv per rank [1, 1, 1, 1]" in out
    line = next(row for row in out.splitlines() if row.startswith("model.layers.0.self_attn.q_proj.weight"))
    assert "colwise" in line and "sizes=[128,64,192,192]" in line and "128x576 64x576 192x576 192x576" in line
    embed = next(row for row in out.splitlines() if row.startswith("model.embed_tokens.weight"))
    assert "(= lm_head.weight)" in embed and "chunks(dim=0, sizes=[12288,12288,12288,12288])" in embed


def test_no_shipped_plan_leaves_routed_experts_whole():
    """A plan that leaves an MoE's routed experts whole on every rank holds most of the model on each (a load
    only warns): for every tiny model of a family with routed experts, the plan ``tp_plan="auto"`` picks (a
    ``plans/`` file, else transformers') gives each 3-D expert parameter a rule that splits it."""
    import warnings

    import transformers
    from tiny_models import ARCHS, COMMON, HYBRIDS, MOE

    checked = {}
    for name, (class_name, overrides) in {**ARCHS, **MOE, **HYBRIDS}.items():
        config = getattr(transformers, class_name)(**{**COMMON, **overrides})
        if not any(getattr(config, n, None) for n in ("num_experts", "num_local_experts", "n_routed_experts")):
            continue  # no routed experts (building every tiny model on meta would cost the pure tier seconds)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        experts = [n for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n]
        if not experts:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rules for variants this tiny model lacks
            plan = resolve_plan(model, "auto")
            assigned = plan.assign(model)
        whole = [n for n in experts if n not in assigned or assigned[n].style_name == "replicated"]
        assert not whole, f"{name}: {plan.source} leaves {whole} whole on every rank"
        checked[name] = plan.source
    assert {"granitemoehybrid", "jamba", "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"} <= set(checked), checked


def test_a_plans_optional_rules_are_quiet_on_the_variant_without_them():
    """Granite-4's plan splits routed experts; its dense variants (``num_local_experts=0``) have none, and the
    rules for them are ``optional``: no warning about a rule matching nothing, and every other rule used."""
    import warnings

    import transformers
    from tiny_models import COMMON, HYBRIDS

    class_name, overrides = HYBRIDS["granitemoehybrid"]
    config = getattr(transformers, class_name)(**{**COMMON, **overrides, "num_local_experts": 0})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    plan = resolve_plan(model, "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assigned = plan.assign(model)
    assert plan.source == "plans/granitemoehybrid.toml"
    assert not any("experts" in path for path in assigned)
    assert {rule.pattern for rule in plan.rules} - plan.used == set(plan.optional)


def test_tp_plan_may_be_a_plan_file_as_the_cli_takes(tiny_paths, tmp_path):
    """from_pretrained(tp_plan=PATH) reads the file's rules, as ``--tp-plan PATH`` does."""
    rules = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    path = tmp_path / "my_plan.toml"
    path.write_text("[rules]\n" + "".join(f'"{pattern}" = "{style}"\n' for pattern, style in rules.items()))
    plan = resolve_plan(meta_model(tiny_paths["llama"]), str(path))
    assert plan.source == f"plan file {path}" and {r.pattern: r.style_name for r in plan.rules} == rules, plan
