"""Head geometry read from what the model uses: its attention modules and their projections.

A config may carry attributes its model never reads (``num_key_value_heads`` on a GPT-2 config
built from a shared dict, a GGUF conversion's extras): splitting by them gives wrong numbers with
no error. So the geometry comes from the attention module itself: its head-size attribute, the
widths of its q/k/v projections (separate, or one fused q/k/v of ``(heads + 2 kv) x head_dim``
rows) and the head counts it stores for its forward. The config only fills what the module does
not say, and where the config disagrees, the module wins and a warning names what was ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

QKV_ROLES = {
    **dict.fromkeys(("q_proj", "query", "q", "wq"), "q"),
    **dict.fromkeys(("k_proj", "key", "k", "wk"), "k"),
    **dict.fromkeys(("v_proj", "value", "v", "wv"), "v"),
}
QKV_NAMES = set(QKV_ROLES)
FUSED_QKV_NAMES = {"c_attn", "query_key_value", "qkv_proj", "qkv", "Wqkv", "W_pack"}
OUT_NAMES = {"o_proj", "out_proj", "dense", "c_proj", "wo", "o", "output.dense"}
HEAD_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size", "key_value_proj_dim")  # the last: T5
Q_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")  # the last: T5
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "kv_heads")
CONFIG_Q_ATTRS = ("num_attention_heads", "n_head")
CONFIG_KV_ATTRS = ("num_key_value_heads", "num_kv_heads")
# gated attention: q_proj's rows hold each head's query and its output gate side by side
# ([q_h | gate_h], two head widths a head; the model chunks them per head after the projection)
GATED_QUERY_ATTENTION = {"Qwen3NextAttention", "Qwen3_5Attention", "Qwen3_5MoeAttention"}


@dataclass(frozen=True)
class Geometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    gated_query: bool = False  # q_proj holds [q_h | gate_h] per head (GATED_QUERY_ATTENTION)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2 family) stores its weight transposed: [in, out]."""
    return type(module).__name__ == "Conv1D"


def fan_out(module: nn.Module) -> int:
    return module.weight.shape[1] if is_conv1d(module) else module.weight.shape[0]


def named(path: str, names: set[str]) -> bool:
    parts = path.split(".")
    return parts[-1] in names or ".".join(parts[-2:]) in names


def _attribute(modules: list[nn.Module], names: tuple[str, ...]) -> tuple[str, int] | None:
    """The first integer attribute among ``names`` on the attention module or an inner one."""
    for module in modules:
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return f"{type(module).__name__}.{name}", value
    return None


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def config_geometry(config) -> dict[str, tuple[str, int]]:
    """What the config says, attribute name -> value (only the attributes it sets)."""
    text = text_config(config)
    said = {}
    for role, names in (("q", CONFIG_Q_ATTRS), ("kv", CONFIG_KV_ATTRS), ("head_dim", ("head_dim",))):
        for name in names:
            value = getattr(text, name, None)
            if isinstance(value, int) and value > 0:
                said[role] = (f"config.{name}", value)
                break
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        said["kv"] = ("config.multi_query", 1)  # Falcon-7B / GPT-BigCode multi-query attention
    return said


def attention_geometry(module: nn.Module, config, path: str) -> tuple[Geometry, str | None]:
    """The heads ``module`` (an attention block) computes with, read from itself and its
    projections, and what of the config it ignored (None: the config agrees)."""
    inner = [module] + [
        m for _, m in module.named_modules() if m is not module and type(m).__name__.endswith("Attention")
    ]
    said = config_geometry(config)
    q_attr, kv_attr = _attribute(inner, Q_HEAD_ATTRS), _attribute(inner, KV_HEAD_ATTRS)
    q_said = q_attr or said.get("q")
    head_dim = _attribute(inner, HEAD_DIM_ATTRS) or said.get("head_dim")
    if head_dim is None:
        hidden = _hidden_size(config)
        if q_said is None or hidden is None:
            raise ValueError(f"{path}: no head size on {type(module).__name__} or its config; cannot split its heads")
        head_dim = ("hidden size / heads", hidden // q_said[1])
    gated = type(module).__name__ in GATED_QUERY_ATTENTION
    used, source = _heads_used(module, path, head_dim, gated, q_said, kv_attr or said.get("kv"), kv_attr)
    _check_counts(path, inner, (q_attr, kv_attr), used, source)
    geometry = Geometry(used["q"], used["kv"], head_dim[1], gated)
    return geometry, _ignored(module, said, geometry, source)


def _hidden_size(config) -> int | None:
    """The model's hidden width as its config names it, to derive a head size when none is given."""
    text = text_config(config)
    return next((getattr(text, a) for a in ("hidden_size", "n_embd", "d_model") if getattr(text, a, None)), None)


def _heads_in(width: int, what: str, path: str, head_dim: tuple[str, int]) -> int:
    """How many heads of ``head_dim`` a projection of ``width`` outputs; refuses a part of a head."""
    if width % head_dim[1]:
        raise ValueError(
            f"{path}: {what} of width {width} is not a whole number of heads of {head_dim[1]} ({head_dim[0]})"
        )
    return width // head_dim[1]


def _heads_used(module, path, head_dim, gated, q_said, kv_said, kv_attr) -> tuple[dict[str, int], str]:
    """The query and key/value head counts the weights imply, and where they were read: separate q/k
    projections' widths, else a fused q/k/v's split by a known count, else the counts said. Each
    family spells its heads differently; the cases read in one place, in the order they are tried."""
    hd = head_dim[1]
    projections = {p: m for p, m in module.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}
    separate = {QKV_ROLES[p.rsplit(".", 1)[-1]]: m for p, m in projections.items() if p.rsplit(".", 1)[-1] in QKV_ROLES}
    fused = [m for p, m in projections.items() if named(p, FUSED_QKV_NAMES)]
    if {"q", "k"} <= set(separate):
        used = {
            "q": _heads_in(fan_out(separate["q"]), "q", path, head_dim),
            "kv": _heads_in(fan_out(separate["k"]), "k", path, head_dim),
        }
        source = f"the q/k projections' widths ({fan_out(separate['q'])}, {fan_out(separate['k'])}) / {hd}"
        if gated:
            used["q"] //= 2
            source += " (q_proj: a query and an output gate a head)"
        return used, source
    if len(fused) == 1:
        total = _heads_in(fan_out(fused[0]), "the fused q/k/v projection", path, head_dim)
        if kv_attr is not None:
            used = {"kv": kv_attr[1], "q": total - 2 * kv_attr[1]}
        elif q_said is not None:
            used = {"q": q_said[1], "kv": (total - q_said[1]) // 2}
        else:
            raise ValueError(f"{path}: a fused q/k/v of {total} heads, and no head count to split it by")
        if used["q"] <= 0 or used["kv"] <= 0 or used["q"] + 2 * used["kv"] != total:
            raise ValueError(
                f"{path}: the fused q/k/v projection holds {total} heads of {hd}, which is not q + 2 kv for "
                f"{(kv_attr or q_said)[0]}={(kv_attr or q_said)[1]}"
            )
        return used, f"the fused q/k/v projection's width {fan_out(fused[0])} = ({used['q']} + 2 x {used['kv']}) x {hd}"
    if q_said is None:
        raise ValueError(f"{path}: no q/k/v projections or head count on {type(module).__name__} to split it by")
    kv = kv_said or q_said
    return {"q": q_said[1], "kv": kv[1]}, f"{q_said[0]} and {kv[0]}"


def _check_counts(path: str, inner: list, attrs: tuple, used: dict[str, int], source: str) -> None:
    """The module's own head counts must agree with its weights, and its heads form whole groups."""
    for attr, role in zip(attrs, ("q", "kv")):
        if attr is not None and attr[1] != used[role]:
            raise ValueError(f"{path}: {attr[0]}={attr[1]} disagrees with {source}; cannot tell which heads it uses")
    groups = _attribute(inner, ("num_key_value_groups",))
    if groups is not None and used["q"] != groups[1] * used["kv"]:
        raise ValueError(f"{path}: {groups[0]}={groups[1]} disagrees with {source}")
    if used["q"] % used["kv"]:
        raise ValueError(f"{path}: {used['q']} query heads do not form whole groups over {used['kv']} key/value heads")


def _ignored(module, said: dict, geometry: Geometry, source: str) -> str | None:
    """What of the config disagrees with the heads the model computes with (None: nothing), for a warning."""
    ignored = [
        f"{name}={value} (the model uses {getattr(geometry, field)})"
        for role, field in (("q", "num_heads"), ("kv", "num_kv_heads"), ("head_dim", "head_dim"))
        if role in said
        for name, value in [said[role]]
        if value != getattr(geometry, field)
    ]
    if not ignored:
        return None
    return (
        f"ignored {', '.join(ignored)}: {type(module).__name__} computes with {geometry.num_heads} heads and "
        f"{geometry.num_kv_heads} key/value heads of {geometry.head_dim} ({source})"
    )


class ConfigIgnoredWarning(UserWarning):
    """A config attribute disagrees with what the model computes with; the model's value is used."""
