"""The kernels' load-time checks (``fp8_weight_only.runs_on``, ``int4_torch.runs_on``,
``fp8_scaled_mm.supports_block_fp8``): each kernel's small products on a device against the same weights in
float32 (its ``_computes_right``), run here, so that a refusal names its reason: the cases it computes wrong,
or the error it raised there."""

from __future__ import annotations

import warnings

import torch


def checked(kernel: str, where: str, cases: list[tuple], computes_right, instead: str) -> bool:
    """Whether ``computes_right(*case)`` holds for every case; where it does not, a warning naming ``kernel``,
    ``where`` (the device, dtypes and versions), what failed, and what is done ``instead`` (a refusal: the
    weights are dequantized)."""
    wrong = wrong_cases(cases, computes_right)
    if wrong:
        warnings.warn(f"hf_parallel: {kernel} does not compute right {where}: {wrong}; {instead}")
    return not wrong


def verdict(computes_right, *case) -> bool | str:
    """``computes_right(*case)``: True or False, or the error it raised in one line (``wrong_cases``)."""
    wrong = wrong_cases([case], computes_right)
    return not wrong or (False if wrong == [case] else wrong[0])


def wrong_cases(cases: list[tuple], computes_right) -> list:
    """The cases (argument tuples) for which ``computes_right(*case)`` is False; where the kernel raises (a
    compile error, a shape or dtype it refuses: they share no class), that error in one line. A fault of the
    device itself (``torch.AcceleratorError``) is raised: it is no refusal, and the device is unusable."""
    try:
        return [case for case in cases if not computes_right(*case)]
    except Exception as error:  # noqa: BLE001 - any refusal counts
        if isinstance(error, getattr(torch, "AcceleratorError", ())):
            raise
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
        return [f"{type(error).__name__}: {' / '.join(dict.fromkeys((lines[0], lines[-1])))}"]
