"""The suite's one comparison against a reference (one process's tensors, losses, norms).

A tensor is within tolerance when ``max|got - want| <= atol + rtol * max|want|`` (the tolerance
relative to that tensor's largest magnitude: gradients hold many values near zero, where an
element-wise relative tolerance means nothing). A NaN or an inf on either side, a shape that
differs, a gradient one side has and the other lacks: never within any tolerance.

Workers run in spawned ranks and return JSON, so they record, and the tests judge:
``gap`` / ``gaps`` give JSON-safe records (``[error, scale]``, NaN kept: ``json`` writes and reads it,
or a string saying what is wrong), ``assert_within`` fails on any record beyond the tolerance,
naming it and where it came from. ``assert_close`` does both for tensors the test itself holds.
"""

from __future__ import annotations

import math

import torch

Record = list | str  # [largest |got - want|, largest |want|], or what prevents comparing
MISSING = "no gradient, the reference has one"


def gap(got, want) -> Record:
    """``[max|got - want|, max|want|]``; the error is NaN when either holds a NaN or an inf; a string
    when the shapes differ."""
    got, want = torch.as_tensor(got).detach().cpu(), torch.as_tensor(want).detach().cpu()  # (the cuda tier's)
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, the reference's {tuple(want.shape)}"
    if not got.numel():
        return [0.0, 0.0]
    got, want = got.double(), want.double()
    scale = want.abs().max().item()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return [math.nan, scale]
    return [(got - want).abs().max().item(), scale]


def piece_gap(got, want, layout=None, rank: int = 0) -> Record | None:
    """``gap`` of this rank's ``got`` against its piece of the whole reference ``want``: the TP ``layout``'s
    slice for ``rank``, then FSDP's slice of that when ``got`` is a DTensor (compared as this rank holds
    it, before any gather). None when neither has one (a parameter this forward did not use)."""
    if got is None or want is None:
        if got is None and want is None:
            return None
        return MISSING if got is None else "a gradient, the reference has none"
    if layout is not None:
        want = layout.extract(want, rank)
    if hasattr(got, "to_local"):  # FSDP's DTensor: this rank's rows of the TP shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(got.shape, got.device_mesh, got.placements)
        if tuple(got.shape) != tuple(want.shape):
            return f"shape {tuple(got.shape)}, the reference's {tuple(want.shape)}"
        want = want[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        got = got.to_local()
    return gap(got, want)


def gaps(model, state, want: dict, rank: int, what: str = "grad") -> dict[str, Record]:
    """Every parameter hf_parallel placed on this rank: its ``what`` (``"grad"``, or ``"data"`` after a step)
    against its piece of ``want[name]`` (one process's, whole), by ``piece_gap``."""
    out = {}
    for entry in state.layout.unique_params():
        got = getattr(model.get_parameter(entry.name), what)
        at = rank if entry.layout.over == "tp" else state.mesh[entry.layout.over].rank  # (experts under ep_size)
        record = piece_gap(got, want[entry.name], entry.layout, at)
        if record is not None:
            out[entry.name] = record
    return out


def of_model(model, what: str = "grad") -> dict[str, torch.Tensor | None]:
    """``{name: parameter.<what>}`` of a one-process model, for ``gaps``."""
    return {name: getattr(param, what) for name, param in model.named_parameters(remove_duplicate=False)}


def failures(records: dict[str, Record], atol: float, rtol: float) -> list[str]:
    """The records beyond ``atol + rtol * scale`` (a NaN never within), worst first, each named."""
    bad = []
    for name, record in records.items():
        if isinstance(record, str):
            bad.append((math.inf, f"{name}: {record}"))
            continue
        error, scale = record
        if not error <= atol + rtol * scale:  # NaN compares False
            why = "NaN or inf" if math.isnan(error) or math.isinf(error) else f"differs by {error:.3g}"
            bad.append((math.inf if math.isnan(error) else error, f"{name}: {why} (scale {scale:.3g})"))
    return [text for _, text in sorted(bad, key=lambda item: -item[0])]


def assert_within(records: dict[str, Record], *, atol: float, rtol: float, where: str) -> None:
    """Every record within ``atol + rtol * scale``; else fail naming ``where`` and each record beyond it."""
    if not records:
        raise AssertionError(f"{where}: nothing compared")
    bad = failures(records, atol, rtol)
    assert not bad, f"{where}: {len(bad)} of {len(records)} beyond atol={atol} + rtol={rtol} x scale: " + "; ".join(
        bad[:8]
    )


def assert_close(got, want, *, atol: float, rtol: float, what: str) -> None:
    """Two tensors (or lists of numbers: losses, norms) the test holds, by the same rule."""
    assert_within({what: gap(got, want)}, atol=atol, rtol=rtol, where=what)


def largest_scale(records: dict[str, Record]) -> float:
    """The largest reference magnitude over ``records`` (a whole model's gradient scale); NaN if any is."""
    scales = [record[1] for record in records.values() if not isinstance(record, str)]
    return math.nan if any(math.isnan(s) for s in scales) else max(scales, default=0.0)


def tolerance_of(dtype: torch.dtype) -> float:
    """A tolerance relative to a tensor's scale for a low-precision run against one process in the same dtype:
    8 of the dtype's epsilons (bf16 0.0625, fp16 0.0078). Summed in another order over the ranks, TP=2 and SP=2
    bf16 gradients land up to 3.5 epsilons of their scale from one process's (tiny Llama); a wrong scale or a
    missing sum is off by O(1) of it."""
    return 8 * torch.finfo(dtype).eps
