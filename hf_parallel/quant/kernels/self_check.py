"""What a kernel's load-time check found (``fp8_weight_only.runs_on``, ``int4_torch.runs_on``): the cases it
computes wrong on a device, or the error it raised there, so that a refusal names its reason."""

from __future__ import annotations

import torch


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
