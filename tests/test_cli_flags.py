"""The CLI explains itself: every flag of every command has help and shows its default, one idea has one flag
name across the commands, sizes read as transformers reads them, and ``--keep-quantized`` takes a mode without
swallowing the model path after it. (No processes: the parser alone; tests/test_cli.py runs the commands.)"""

import argparse

import pytest

from hf_parallel.commands.cli import build_parser, main
from hf_parallel.commands.flags import LAYOUT_FLAGS, byte_size


def _commands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_every_flag_has_help_and_its_default_shown():
    for name, command in _commands().items():
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help"
            set_default = action.default is not None and action.default is not False and action.option_strings
            if set_default:
                shown = command._get_formatter()._get_help_string(action) % dict(default=action.default)
                assert " ".join(shown.split()) in text and str(action.default) in shown, (name, action.dest)


def test_one_name_per_layout_idea_across_the_commands():
    """A layout flag means the same on every command that takes it (its help is the shared one, or names the
    command's own default), and no command spells an idea another way (``generate --dp`` is a hidden alias)."""
    commands = _commands()
    flags = {name: {flag for action in command._actions for flag in action.option_strings
                    if action.help != argparse.SUPPRESS} for name, command in commands.items()}  # fmt: skip
    for flag in LAYOUT_FLAGS:
        takers = [name for name, own in flags.items() if flag in own]
        assert takers, flag
    assert "--dp-replicate" in flags["generate"] and "--dp-replicate" in flags["plan"]
    assert "--ep-plan" in flags["generate"] and "--ep-plan" in flags["serve"]
    assert not any("--dp" in own for own in flags.values())
    assert parse("generate", "--dp", "2").dp_replicate == 2  # the earlier spelling still works
    assert parse("generate").dp_replicate == 1


@pytest.mark.parametrize("text, size", [("20GiB", 20 * 2**30), ("500MB", 500 * 10**6), ("4096", 4096)])
def test_sizes_read_as_transformers_reads_max_shard_size(text, size):
    assert byte_size(text) == size
    assert parse("serve", "--kv-cache-memory", text).kv_cache_memory == size
    assert parse("verify", "x", "--reference-memory", text).reference_memory == size
    assert parse("consolidate", "a", "b", "--max-shard-size", text).max_shard_size == size


def test_earlier_size_flags_and_bad_sizes():
    assert parse("serve", "--kv-cache-memory-bytes", "1000").kv_cache_memory == 1000
    assert parse("verify", "x", "--reference-memory-gb", "0.5").reference_memory == 2**29
    assert parse("consolidate", "a", "b").max_shard_size == 50 * 10**9
    with pytest.raises(argparse.ArgumentTypeError, match="20GiB"):
        byte_size("twenty")


def test_keep_quantized_takes_a_mode_and_leaves_the_model_path(capsys):
    cases = {
        ("serve", "--keep-quantized", "/models/fp8"): (True, "/models/fp8"),
        ("serve", "--keep-quantized", "fp8", "/models/fp8"): ("fp8", "/models/fp8"),
        ("serve", "/models/fp8", "--keep-quantized"): (True, "/models/fp8"),
        ("serve", "/models/fp8"): (False, "/models/fp8"),
    }
    for argv, (kept, path) in cases.items():
        args = build_parser().parse_args(list(argv))
        stray = getattr(args, "after_keep_quantized", None)
        assert (args.keep_quantized, args.model_path or stray) == (kept, path), argv
    assert parse("generate", "--keep-quantized", "int4").keep_quantized == "int4"
    with pytest.raises(SystemExit):  # generate has no positional to take it: the mode is refused by name
        main(["generate", "--keep-quantized", "int8"])
    assert "'int8' is not one of fp8, int4" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # serve's MODEL already given: the word is a bad mode
        main(["serve", "/models/a", "--keep-quantized", "/models/b"])
    assert "'/models/b' is not one of fp8, int4" in capsys.readouterr().err


def test_a_refusal_is_one_line_naming_the_command(tmp_path, capsys):
    """A directory with no config, and a quantized checkpoint's config without its files (the plan reads their
    headers): one line each, the command's name first, exit status 1, no traceback."""
    import shutil
    from pathlib import Path

    assert main(["plan", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-parallel plan: ") and str(tmp_path) in err and "\n" not in err, err
    configs = Path(__file__).parent / "model_configs"
    shutil.copytree(configs / "qwen3-32b-fp8", tmp_path / "fp8")
    assert main(["plan", str(tmp_path / "fp8"), "--tp", "4"]) == 1
    err = capsys.readouterr().err.strip()
    missing = "no model.safetensors or model.safetensors.index.json (nor a pytorch_model.bin)"
    assert err == f"hf-parallel plan: {tmp_path / 'fp8'}: {missing}", err
