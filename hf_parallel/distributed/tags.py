"""Tags of point-to-point messages. Messages between the same pair of ranks are matched in order per
tag, so each kind of traffic has its own: one enum, so no two kinds can share a number by accident."""

from __future__ import annotations

from enum import IntEnum


class Tag(IntEnum):
    FORWARD = 1  # a pipeline stage's hidden states, to the next stage
    BACKWARD = 2  # the gradient of a stage's input, back to the stage before
    TIED = 3  # a tied weight's gradient, between the first and the last stage
    SAVE = 4  # a gathered save's blocks, from a stage's first rank to rank 0
