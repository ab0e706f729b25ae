"""The executor interface the iteration loop drives: the simulator and realrun both implement it.

Lives in simulator/ (not loop.py) so ``SimulatorExecutor`` implements it without importing
``loop.py``, which imports policies/ (docs/architecture.md, dependency rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import pandas as pd

from sparsebalance.simulator.plan import Budgets, Plan


@dataclass(slots=True)
class IterationResult:
    """What an executor reports for one iteration (seconds throughout)."""

    iteration_time_s: float
    trace: pd.DataFrame
    """Rows in the TRACE_COLUMNS schema."""
    microbatch_latency_s: list[list[float]]
    """[dp_rank][microbatch]: F + B compute summed over stages (imbalance = max / mean)."""
    stage_busy_s: list[float]
    """[stage]: busy (compute) seconds, max over DP replicas."""
    bubble_fraction: float
    coverage: dict[int, tuple[float, ...]] = field(default_factory=dict)
    """Measured coverage curves by sequence id (realrun, from real gate scores); empty in simulation."""
    extra: dict[str, float] = field(default_factory=dict)
    """Further per-iteration metrics (e.g. loss)."""


class Executor(Protocol):
    """Runs one iteration of a plan with its budgets and reports what happened (or is predicted)."""

    name: str

    def execute(self, iteration: int, plan: Plan, budgets: Budgets) -> IterationResult:
        ...
