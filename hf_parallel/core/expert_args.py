"""The arguments of transformers' experts forward, by role: whichever way a model passes them (by
position or by name, and under GPT-OSS's names), the styles and the kept experts find the same three."""

from __future__ import annotations

# transformers' experts forward takes (hidden states, expert ids, routing weights); GPT-OSS names them
# (hidden_states, router_indices, routing_weights)
EXPERT_ARG_ROLES = {"hidden_states": 0, "top_k_index": 1, "router_indices": 1, "top_k_weights": 2, "routing_weights": 2}


def rewrite_expert_args(args: tuple, kwargs: dict, rewrite) -> tuple[tuple, dict]:
    """Apply ``rewrite(role, value)`` to each experts-forward argument, passed by position or name."""
    args = tuple(rewrite(role, value) if role < 3 else value for role, value in enumerate(args))
    kwargs = {key: rewrite(EXPERT_ARG_ROLES[key], v) if key in EXPERT_ARG_ROLES else v for key, v in kwargs.items()}
    return args, kwargs


EXPERT_ROLES = ("hidden_states", "expert ids", "routing weights")


def expert_args(args: tuple, kwargs: dict) -> list:
    """The experts forward's three arguments by role (hidden states, expert ids, routing weights)."""
    found = [None, None, None]

    def read(role, value):
        found[role] = value
        return value

    rewrite_expert_args(args, kwargs, read)
    missing = [EXPERT_ROLES[role] for role, value in enumerate(found) if value is None]
    if missing:
        raise RuntimeError(f"hf_parallel: an experts forward called without its {', '.join(missing)}")
    return found
