"""What a batching policy returns (a plan) and what a tuning policy returns (budgets: one
:class:`~sparsebalance.simulator.budget.Budget` per micro-batch)."""

from __future__ import annotations

from dataclasses import dataclass

from sparsebalance.data.sequence import Sequence
from sparsebalance.simulator.budget import Budget


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch: one or more sequences packed side by side (varlen, no cross attention)."""

    sequences: tuple[Sequence, ...]

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(s.length for s in self.sequences)

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.sequences)


@dataclass(frozen=True, slots=True)
class Plan:
    """A global batch split across DP ranks, then into ordered micro-batches.

    ranks[r][j] is micro-batch j of DP rank r, in execution order. Every rank runs the same
    number of micro-batches (pipeline schedules need that); a rank may hold an empty-tokens
    micro-batch only if the policy says so explicitly (none does today).
    """

    ranks: tuple[tuple[MicroBatch, ...], ...]

    @property
    def dp(self) -> int:
        return len(self.ranks)

    @property
    def num_microbatches(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0

    def microbatches(self):
        """Yield (dp_rank, index, micro-batch) in rank-major order."""
        for r, mbs in enumerate(self.ranks):
            for j, mb in enumerate(mbs):
                yield r, j, mb

    def sequences(self) -> list[Sequence]:
        return [s for _, _, mb in self.microbatches() for s in mb.sequences]

    @staticmethod
    def from_lists(ranks: list[list[list[Sequence]]]) -> Plan:
        return Plan(tuple(tuple(MicroBatch(tuple(mb)) for mb in r) for r in ranks))


#: budgets[r][j] is the budget of micro-batch j of DP rank r (same shape as Plan.ranks).
Budgets = tuple[tuple[Budget, ...], ...]


def uniform_budgets(plan: Plan, k: int) -> Budgets:
    """Every micro-batch at ``Budget.uniform(k)``."""
    b = Budget.uniform(k)
    return tuple(tuple(b for _ in mbs) for mbs in plan.ranks)
