"""What a batching policy returns (a plan) and what a tuning policy returns (budgets: one
:class:`~sparsebalance.simulator.budget.Budget` per micro-batch)."""

from __future__ import annotations

from dataclasses import dataclass

from sparsebalance.data.sequence import Sequence
from sparsebalance.simulator.budget import Budget


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch: one or more sequences packed side by side (varlen, no cross attention),
    optionally followed by ``pad`` tokens of padding (a fixed slot's pad document)."""

    sequences: tuple[Sequence, ...]
    pad: int = 0
    """Tokens of padding after the documents, filling a fixed slot (``policy.slot_tokens``): the pad
    document runs through the dense layers, is sent stage to stage, attends nothing and is attended by
    nothing, and carries no label."""

    @property
    def lengths(self) -> tuple[int, ...]:
        """The documents' lengths, then ``-pad`` where there is padding: the form the latency model
        prices (see :func:`split_pad`)."""
        docs = tuple(s.length for s in self.sequences)
        return docs + (-self.pad,) if self.pad else docs

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.sequences) + self.pad


def split_pad(lengths) -> tuple[tuple[int, ...], int]:
    """(the documents' lengths, all tokens) of a micro-batch's ``lengths``, in which a negative entry
    ``-n`` is ``n`` tokens of padding: what a padded micro-batch costs is attention over the documents
    and dense work over all its tokens."""
    docs = tuple(L for L in lengths if L > 0)
    return docs, sum(docs) - sum(L for L in lengths if L < 0)


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
