"""Kinds of point-to-point traffic between pipeline stages. NCCL ignores tags, so messages between two
ranks match by order alone (``p2p.py`` passes none to any backend); a kind decides which transport
carries a message: hidden states and their gradients go through shared-memory pipes between stages on
one host, everything else through the process group."""

from __future__ import annotations

from enum import IntEnum


class Tag(IntEnum):
    FORWARD = 1  # a pipeline stage's hidden states, to the next stage
    BACKWARD = 2  # the gradient of a stage's input, back to the stage before
    TIED = 3  # a tied weight's layout on the other end stage, swapped once between the first and the last stage
