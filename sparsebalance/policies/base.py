"""The policy interface. A policy sees only what a real trainer can see.

Batching: global batch (list of Sequence) -> Plan.  Tuning: Plan -> Budgets.  Both may keep state
between iterations and learn from ``observe`` (called by the loop after each executed iteration).
The same objects drive the simulator and realrun (see ``sparsebalance.loop``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.coverage import CoverageModel
from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.query import LatencyQuery
from sparsebalance.simulator.plan import Budgets, Plan


@dataclass(slots=True)
class PolicyContext:
    """What policies may consult. ``latency`` answers :class:`~sparsebalance.simulator.cost.query.LatencyQuery`
    (a ``LatencyModel`` in every run; SAB, LBB and DST ask only its micro-batch part);
    ``coverage`` the :class:`~sparsebalance.policies.coverage.CoverageModel` (C(k) per sequence)."""

    model: ModelConfig
    cluster: ClusterConfig
    policy: PolicyConfig
    latency: LatencyQuery
    coverage: CoverageModel
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))


@runtime_checkable
class BatchingPolicy(Protocol):
    name: str

    def plan(self, batch: list[Sequence], ctx: PolicyContext) -> Plan:
        """Split the global batch across ``ctx.cluster.dp`` ranks and into micro-batches."""
        ...

    def observe(self, plan: Plan, budgets: Budgets, result: Any) -> None:
        """Learn from the executed iteration (e.g. SAB's EMA of DST budgets)."""
        ...


@runtime_checkable
class TuningPolicy(Protocol):
    name: str
    stats: dict[str, float]
    """Counters of the last ``budgets`` call (e.g. floor_share, infeasible); merged into metrics."""

    def budgets(self, plan: Plan, ctx: PolicyContext) -> Budgets:
        ...

    def observe(self, plan: Plan, budgets: Budgets, result: Any) -> None:
        ...
