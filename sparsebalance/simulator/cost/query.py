"""What the policies and the executor ask of a latency model: typed, so nobody probes for methods.

``LatencyQuery`` is the whole contract; ``LatencyModel`` (``simulator/cost/latency.py``) is the
implementation every run uses. Policies that balance whole micro-batches (SAB, LBB, DST) need only
its ``MicrobatchLatency`` part; the executor, dst-cp and schedule-aware ordering need the rest.
A simpler model -- a closed form in a test, a user's own -- writes the scalar methods and inherits the
vectorised ones from :class:`ScalarMicrobatchLatency` / :class:`ScalarStageLatency` (same values, one
call per element). Seconds throughout; lengths and tokens in tokens; a budget is a
:class:`~sparsebalance.simulator.budget.Budget` or an int (the same as ``Budget.uniform(int)``: what
policies pass while they search over k).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.cost.modes import MODES

if TYPE_CHECKING:
    from sparsebalance.simulator.cost.cp.placement import Placement
    from sparsebalance.simulator.cost.cp.ring import RingReport
    from sparsebalance.simulator.cost.profile import Profile
    from sparsebalance.simulator.cost.stagecost import StageCost
    from sparsebalance.simulator.layout import Layout


class MicrobatchLatency(Protocol):
    """Forward + backward seconds of a micro-batch over the whole model: what SAB and DST balance."""

    def microbatch_latency(self, lengths: Sequence[int], budget) -> float: ...

    def microbatch_latencies(self, microbatches: Sequence[Sequence[int]], budgets) -> np.ndarray:
        """[M] seconds; ``budgets`` one int for all or M ints."""
        ...


class LatencyQuery(MicrobatchLatency, Protocol):
    """Everything the simulator and the schedule-aware policies ask of a latency model."""

    layout: Layout
    """Layers and parameters per (virtual) stage and device."""
    block_size: int
    """MoBA key-block size (tokens)."""
    profile: Profile
    """The latency table behind the model."""
    extrapolate: str
    """Beyond the profiled range: warn, error or clamp."""
    cost: StageCost
    """Stage and whole-model times (``simulator/cost/stagecost.py``): what dst-cp's stage tables and
    sab-order compose, and their budget-free split."""

    def attention(self, seq_len: int, budget: int, *, backward: bool = False) -> float: ...

    def attention_many(self, seq_len, budget, *, backward: bool = False) -> np.ndarray: ...

    def per_token_many(self, name: str, tokens, *, backward: bool = False, part: str | None = None) -> np.ndarray:
        """[len(tokens)] seconds of ``name`` (layer, embed, head) at each token count."""
        ...

    def stage_time(self, lengths, budget, stage: int, *, backward: bool, chunk: int = 0,
                   part: str | None = None) -> float: ...

    def stage_times(self, microbatches, budgets, modes=("F", "B")) -> dict[str, np.ndarray]:
        """Per mode (F, B, I, W) seconds [V, M] of every virtual stage (``simulator/cost/stagecost.py``)."""
        ...

    def p2p_time(self, tokens: int) -> float: ...

    def allreduce_time(self, stage: int) -> float:
        """Seconds of the DP gradient synchronisation of device ``stage``, nothing overlapping it."""
        ...

    def grad_sync_exposed(self, stage: int, window: float) -> float:
        """Seconds of it left after the device's last backward action (``window`` seconds long)
        when its buckets overlap that action (``cluster.dp_overlap``)."""
        ...

    def param_gather_exposed(self, stage: int, window: float) -> float:
        """Seconds of ZeRO-1's parameter gather left after the device's first forward action
        (``window`` seconds long) with ``cluster.param_gather_overlap``."""
        ...

    def optimizer_time(self, stage: int) -> float: ...

    def cp_report(self, L: int, k: int, *, backward: bool = False,
                  degree: int | None = None) -> RingReport | None:
        """One layer of a sequence on the context-parallel group (``cp.ring.RingReport``), or
        None without CP or when the sequence stays whole on one rank; ``degree``: on that many of
        the group's ranks (``cp_split = "per-sequence"``)."""
        ...

    def cp_joint(self, lengths, k: int, *, backward: bool = False) -> RingReport | None:
        """One layer of a packed micro-batch's sequences on one ring of the whole CP group
        (``cp.pricing.CPPricing.joint``), or None without CP or under ``cp_split =
        "per-sequence"``."""
        ...

    def cp_placement(self, lengths, budget) -> Placement | None:
        """Where a micro-batch's sequences lie on the CP group (``cp.placement.Placement``) under
        ``cp_split = "per-sequence"``, else None."""
        ...

    def cp_tokens(self, lengths, budget) -> int:
        """Tokens the busiest CP rank holds x cp (what P2P and memory see): the micro-batch's
        tokens unless ``cp_split = "per-sequence"``."""
        ...


class ScalarMicrobatchLatency:
    """``microbatch_latencies`` from a subclass's ``microbatch_latency``, one call per micro-batch."""

    def microbatch_latencies(self, microbatches, budgets) -> np.ndarray:
        ks = [budgets] * len(microbatches) if np.ndim(budgets) == 0 else list(budgets)
        return np.array([self.microbatch_latency(list(mb), k if isinstance(k, Budget) else int(k))  # type: ignore[attr-defined]
                         for mb, k in zip(microbatches, ks)], dtype=float)


class ScalarStageLatency:
    """``stage_times`` from a subclass's ``stage_time`` and ``cluster`` (pp, virtual_stages), one
    call per (micro-batch, virtual stage, mode), memoised (per-layer budgets recur across
    iterations; ``LatencyModel`` takes this path for them). A model without context parallelism
    answers ``cp_report`` and ``cp_placement`` with None and ``cp_tokens`` with the tokens."""

    def cp_report(self, L: int, k: int, *, backward: bool = False,
                  degree: int | None = None) -> RingReport | None:
        return None

    def cp_joint(self, lengths, k: int, *, backward: bool = False) -> RingReport | None:
        return None

    def cp_placement(self, lengths, budget) -> Placement | None:
        return None

    def cp_tokens(self, lengths, budget) -> int:
        from sparsebalance.simulator.plan import split_pad

        return split_pad(lengths)[1]

    _MEMO_LIMIT = 200_000

    def stage_times(self, microbatches, budgets, modes=("F", "B")) -> dict[str, np.ndarray]:
        pp, chunks = self.cluster.pp, self.cluster.virtual_stages  # type: ignore[attr-defined]
        memo = self.__dict__.setdefault("_stage_memo", {})
        if len(memo) > self._MEMO_LIMIT:  # bound memory in very long runs
            memo.clear()
        out = {mode: np.empty((pp * chunks, len(microbatches))) for mode in modes}
        for i, (lengths, budget) in enumerate(zip(microbatches, budgets)):
            for vs in range(pp * chunks):
                for mode in modes:
                    key = (vs, mode, tuple(lengths), budget)
                    hit = memo.get(key)
                    if hit is None:
                        backward, part = MODES[mode]
                        kw = {"part": part} if part else {}
                        hit = memo[key] = float(self.stage_time(lengths, budget, vs % pp,  # type: ignore[attr-defined]
                                                                backward=backward, chunk=vs // pp, **kw))
                    out[mode][vs, i] = hit
        return out
