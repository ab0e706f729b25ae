"""The unit every part exchanges: one training sample, and the one count of its MoBA key blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IGNORE_INDEX = -100
"""A label that trains nothing (PyTorch's cross-entropy default): ``Sequence.labels`` outside the
positions a task scores."""


def blocks(length, block: int):
    """MoBA key blocks of a sequence of ``length`` tokens in blocks of ``block`` (the last may be
    short): the ceiling of length / block, for ints and numpy arrays alike. Here, in the lowest
    layer, so that every part counts blocks with the same function."""
    return -(-length // block)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sequence:
    """One training sample.

    id: stable index of the sample in its dataset (used for EMA state and measured coverage).
    length: tokens in the sample (after truncation).
    tokens: optional int token ids, shape [length]; present for real runs, absent in simulation.
    labels: optional int training targets, shape [length]: ``labels[t]`` is what position ``t``
        predicts, ``IGNORE_INDEX`` where nothing is (e.g. all but the answers of a task); absent = every
        next token (the real run's default LM loss).
    coverage: optional measured coverage curve, ``coverage[k - 1] = C(k)`` for k = 1..len; when absent
        a coverage model (policies/) supplies one.
    sensitivity: optional per-sample parameter of the parametric coverage model (see docs/policies.md).
    """

    id: int
    length: int
    tokens: np.ndarray | None = field(default=None, compare=False, repr=False)
    labels: np.ndarray | None = field(default=None, compare=False, repr=False)
    coverage: tuple[float, ...] | None = field(default=None, compare=False, repr=False)
    sensitivity: float | None = None

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"Sequence.length: must be >= 1, got {self.length}")
        if self.tokens is not None and len(self.tokens) != self.length:
            raise ValueError(
                f"Sequence.tokens: has {len(self.tokens)} ids but length is {self.length}"
            )
        if self.labels is not None and len(self.labels) != self.length:
            raise ValueError(f"Sequence.labels: has {len(self.labels)} entries but length is {self.length}")
