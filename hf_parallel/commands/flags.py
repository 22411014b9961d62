"""The flags several commands share, defined once, so one idea has one name and one help text everywhere
(``--dp-replicate`` on ``generate`` as on ``plan``; sizes read as ``20GiB`` wherever bytes are taken), and
the help formatter that shows every default, as ``vllm serve --help`` does."""

from __future__ import annotations

import argparse


class DefaultsShown(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless it has none (an unset flag means "not asked for")
    or the help already says what it is."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        shown = not unset and "default" not in text
        return f"{text} (default: %(default)s)" if shown and action.option_strings else text


def byte_size(value: str) -> int:
    """``20GiB``, ``500MB``, ``50GB`` or a number of bytes, read as transformers' ``max_shard_size``."""
    from ..compat.transformers import size_in_bytes

    try:
        return size_in_bytes(value.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give a size such as 20GiB, 500MB or a number of bytes") from None


def int_list(value: str) -> list[int]:
    """``2,1`` -> [2, 1]"""
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give whole numbers separated by commas, e.g. 2,1") from None


KEPT_MODES = ("fp8", "int4")


class KeepQuantized(argparse.Action):
    """``--keep-quantized [fp8|int4]``: a mode, or nothing for ``True``. A following word that is not a mode is
    not swallowed: it is kept aside (``args.after_keep_quantized``) for the command's positional MODEL, so
    ``serve --keep-quantized DIR`` serves DIR; ``main`` refuses it where no positional is free."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs="?", const=True, default=False, help=help,
                         metavar="{" + ",".join(KEPT_MODES) + "}")  # fmt: skip

    def __call__(self, parser, namespace, value, option_string=None):
        if value is True or value in KEPT_MODES:
            setattr(namespace, self.dest, value)
            return
        setattr(namespace, self.dest, True)
        namespace.after_keep_quantized = value


KEEP_QUANTIZED_HELP = (
    "a quantized checkpoint's weights held as stored (from_pretrained's keep_quantized): dequantized module by "
    "module, FP8 through the package's kernel on a GPU; fp8: besides, W8A8 products on Hopper "
    "(torch._scaled_mm); int4: GPTQ / AWQ / W4A16 through torch's int4 kernel; off: dequantized at load"
)


def tp_plan_arg(value: str):
    """``auto``, ``discover``, a model_type with a plan, or a TOML/JSON file of rules (pattern = style): a
    ``.toml`` or ``.json`` path, as ``from_pretrained(tp_plan=...)`` reads it."""
    if not value.endswith((".toml", ".json")):
        return value
    from ..tensor.plan import read_plan_file

    return read_plan_file(value)


# One entry per layout idea: from_pretrained's keyword, and the flag's help. A command picks the ones it takes
# and may give its own default (``plan``, with no ranks to fill, takes --tp 1).
LAYOUT_FLAGS = {
    "--tp": dict(type=int, help="tensor-parallel size: ranks each layer is split over (of every stage, with --pp); "
                 "unset: the ranks the other sizes leave"),
    "--tp-plan": dict(default="auto", help="the TP rules: auto (a shipped plan, else transformers', else "
                      "discovered), discover, a model_type, or a TOML/JSON file of rules"),
    "--ep-plan": dict(choices=["auto"], help="auto: every expert whole on one rank of the TP group, each rank on "
                      "the group's batch (from_pretrained's ep_plan; dense layers still follow --tp-plan)"),
    "--sp": dict(type=int, default=1, help="sequence-parallel size (Ulysses): each sequence split over the ranks, "
                 "heads exchanged by an all-to-all around attention; the KV cache kept split"),
    "--cp": dict(type=int, default=1, help="context-parallel size: a ring of --sp groups, each holding two zigzag "
                 "chunks of every sequence"),
    "--fsdp": dict(type=int, default=1, help="FSDP size: data-parallel replicas sharding the parameters (and a "
                   "step's gradients and optimizer state) between them"),
    "--dp-replicate": dict(type=int, default=1, help="data-parallel copies of the model (of the FSDP group: HSDP); "
                           "generate gives each its share of --prompts-file"),
    "--ep": dict(type=int, default=1, help="expert-parallel size (from_pretrained's ep_size): the experts spread "
                 "over tp x this many ranks borrowed from --fsdp / --dp-replicate, tokens travelling to them"),
    "--pp": dict(type=int, default=1, help="pipeline stages of contiguous layers, each at the same TP size"),
    "--stage-tp": dict(type=int_list, help="TP size per pipeline stage, e.g. 2,1 (sets the stages; leave --tp "
                       "unset)"),
    "--stage-layers": dict(type=int_list, help="layers per pipeline stage, e.g. 18,12 (unset: balanced by "
                           "parameters)"),
}


def add_layout_flags(parser, names: str, **own: dict) -> None:
    """Add the layout flags ``names`` (``"tp sp cp"``); ``own``: a flag's own settings (``tp=dict(default=1)``)."""
    for name in names.split():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, **{**LAYOUT_FLAGS[flag], **own.get(name, {})})


def pipeline_kwargs(args) -> dict:
    """from_pretrained's pipeline keywords from --pp / --stage-tp / --stage-layers / --micro-batches."""
    out = {}
    if getattr(args, "stage_tp", None) is not None:
        out["stage_tp_sizes"] = args.stage_tp
    elif getattr(args, "pp", 1) > 1:
        out["pp_size"] = args.pp
    if getattr(args, "stage_layers", None) is not None:
        out["stage_layers"] = args.stage_layers
    if getattr(args, "micro_batches", None) is not None:
        out["micro_batches"] = args.micro_batches
    return out


def layout_kwargs(args) -> dict:
    """from_pretrained's layout keywords of the flags the command has (sizes of 1 and an unset --tp left out)."""
    sizes = {"sp_size": "sp", "cp_size": "cp", "fsdp_size": "fsdp", "dp_replicate_size": "dp_replicate",
             "ep_size": "ep"}  # fmt: skip
    out = {key: getattr(args, name) for key, name in sizes.items() if getattr(args, name, 1) > 1}
    if getattr(args, "tp", None) is not None:
        out["tp_size"] = args.tp
    if getattr(args, "ep_plan", None):
        out["ep_plan"] = args.ep_plan
    return {**out, **pipeline_kwargs(args)}
