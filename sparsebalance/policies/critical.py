"""``dst-cp``: critical-path DST. Budgets chosen against the pipeline schedule, not an anchor.

DST (:mod:`.tuning`) balances every micro-batch toward an anchor latency. What sets the pace of a
PP x DP iteration is the critical path of the schedule: the slowest replica's 1F1B/GPipe makespan,
then the all-reduce that waits for it. ``dst-cp`` predicts that iteration time exactly (the
simulator's timing core, :mod:`sparsebalance.simulator.schedule.timing`, on the schedule's graph) and:

(a) **lowers** budgets greedily, starting from ``k0`` everywhere: in every round each micro-batch
    of a *critical* replica (one whose finish sets the iteration time) is tried at
    ``max(floor, k - step)``; per critical replica the move with the largest saving of predicted
    iteration time per unit of coverage lost is applied (all critical replicas move together, since
    lowering one of two tied replicas saves nothing). When no critical replica has an improving
    move, ``step`` halves (``k0 // 4``, ..., 1); the phase ends at step 1 or after ``cp_rounds``
    rounds. Floors are DST's (smallest k with C(k) >= 1 - p, clamped to [k_min, k0]).
(b) **raises** budgets into bubbles: micro-batches in order of rising coverage take the largest
    k <= k_hi whose predicted iteration time stays <= ``T_a (1 + cp_raise_tol)`` (``T_a`` = end of
    phase a; never above the ``fixed`` time), all k of one micro-batch scored in one batched call;
    two passes. ``k_hi = min(k_max, max(k0, n_blocks))`` as in DST.

Never slower than ``fixed`` in prediction: (a) accepts only moves that lower the predicted time, (b)
is capped by it. Deterministic (ties go to the lowest flat index). Budgets are ints (one per
micro-batch). Limitation: a single-micro-batch move cannot shorten a replica whose makespan is set
by two disjoint paths at once; phase (a) then stops early.

Cost: stage times of every micro-batch at k = floor..k0 + 1 (:mod:`.stage_tables`: affine in the
attention, each sequence's attention computed once per distinct effective budget; rows above
k0 + 1 only for micro-batches phase (b) may raise, when the profile is monotone in the budget),
coverage curves of all micro-batches as one matrix; then moves are priced exactly without
re-timing the schedule (:mod:`sparsebalance.simulator.schedule.perturb`): each replica's action ends and
times to the end are kept, a question re-times only the levels holding the micro-batch's own
actions and crosses the next cut, a move re-times until its effect settles into a uniform
shift. Phase (a) prices candidates best upper bound first and stops when no bound can beat the
best price; phase (b) bounds each micro-batch's raise from the kept times and bisects over k
where its rows grow with k (every k is priced where they do not). Same decisions as pricing every
candidate by a full re-timing (tests), where the former closed-form evaluator re-timed every
action for every candidate (quadratic in micro-batches per rank).
``stats``: mean_budget, floor_share, lowered, raised (counts vs k0), rounds, and predicted seconds:
``predicted_fixed_s`` (all k0), ``lowered_s`` (after a), ``predicted_s`` (final).
"""

from __future__ import annotations

import numpy as np

from sparsebalance import jit
from sparsebalance.data.sequence import blocks
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.critical_phases import State, lower, raise_into_bubbles
from sparsebalance.policies.stage_tables import StageTable, budget_monotone_range
from sparsebalance.simulator.cost.query import LatencyQuery
from sparsebalance.simulator.plan import Budget, Budgets, Plan
from sparsebalance.simulator.schedule.graph import ActionGraph, schedule_graph
from sparsebalance.simulator.schedule.perturb import ReplicaTimes
from sparsebalance.simulator.schedule.timing import pack_lags


def graph_for(cluster, m: int) -> ActionGraph:
    """The (cached, read-only) dependency graph of ``cluster``'s schedule for ``m`` micro-batches."""
    return schedule_graph(cluster.schedule, cluster.pp, m, cluster.virtual_stages)


class CriticalPathDST:
    """``dst-cp``: see the module docstring."""

    name = "dst-cp"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.stats: dict[str, float] = {}
        self._per_model: tuple[LatencyQuery, np.ndarray, tuple[float, float] | None] | None = None
        """(latency model, [pp] all-reduce + optimizer seconds, the lengths where its attention does
        not fall as the budget grows): kept while the latency model stays the same."""

    def stage_table(self, lm, lengths: tuple[int, ...], k_lo: int, k_hi: int, nv: int, pp: int,
                    split: bool = False):
        """Forward and backward seconds of every virtual stage at k = k_lo..k_hi: two arrays
        [k_hi - k_lo + 1, V] (see :mod:`.stage_tables`); with ``split`` a third, the backward's
        input-gradient part I (its weight-gradient part W does not depend on k: ``StageTable.weight_times``)."""
        ks = np.arange(k_lo, k_hi + 1)
        at = np.zeros(len(ks), dtype=np.int64)
        whole = StageTable(lm, [lengths], [k_lo], [k_hi], [k_hi], nv, pp).rows(at, ks)
        if not split:
            return whole[:, :nv], whole[:, nv:]
        parts = StageTable(lm, [lengths], [k_lo], [k_hi], [k_hi], nv, pp,
                           fused=np.zeros((1, nv), dtype=bool)).rows(at, ks)
        return whole[:, :nv], whole[:, nv:], parts[:, nv:]

    def budgets(self, plan: Plan, ctx: PolicyContext) -> Budgets:
        cfg, lm, cl = self.cfg, ctx.latency, ctx.cluster
        dp, m = plan.dp, plan.num_microbatches
        pp, nv = cl.pp, cl.pp * cl.virtual_stages
        g = graph_for(cl, m)
        jit.warm(dp * m >= 256)  # many exact re-timings of a long graph ahead (sparsebalance/jit.py)
        if self._per_model is None or self._per_model[0] is not lm:
            tail = np.array([lm.allreduce_time(s) + lm.optimizer_time(s) for s in range(pp)])
            self._per_model = (lm, tail, budget_monotone_range(lm))
        _, tail, mono = self._per_model
        mbs = [mb for _, _, mb in plan.microbatches()]  # flat index i = r * m + j
        lengths = [mb.lengths for mb in mbs]
        bs = ctx.model.block_size
        hi = np.array([min(cfg.k_max, max(cfg.k0, blocks(max(x), bs))) for x in lengths], dtype=np.int64)
        cov = _coverage_matrix(ctx.coverage, mbs, hi)  # [dp m, max k_hi]; row i read up to hi[i]
        # DST's floor (DynamicSparsity.floor) read off the same curves: its C(1..min(k_hi, k0))
        # are their first entries, computed alike; the smallest k reaching 1 - p, else k_top
        k_top = np.minimum(hi, cfg.k0)
        width = int(k_top.max()) if len(mbs) else 0
        ok = (cov[:, :width] >= 1.0 - cfg.p - 1e-12) & (np.arange(width)[None, :] < k_top[:, None])
        first = np.where(ok.any(axis=1), ok.argmax(axis=1) + 1, k_top)
        lo = np.maximum(cfg.k_min, np.minimum(first, cfg.k0))
        p2p = np.array([lm.p2p_time(sum(x)) for x in lengths]).reshape(dp, 1, m)
        p2p = np.broadcast_to(p2p, (dp, max(nv - 1, 0), m))
        # a split schedule's backward node is I (B where the graph runs that backward whole); its
        # W keeps the same seconds at every k (an empty placeholder where the backward is whole)
        fused = np.tile(g.fused.T, (dp, 1)) if g.split else None  # [dp m, V]
        # rows above k0 + 1 only when phase (b) reads them, where rows surely grow with k (bounds
        # then settle most micro-batches on one row); else all rows, each checked
        lazy = mono is not None and mono[0] <= min(map(min, lengths)) and max(map(max, lengths)) <= mono[1]
        tab = StageTable(lm, lengths, lo, np.minimum(hi, cfg.k0 + 1) if lazy else hi, hi, nv, pp, fused=fused)
        st = State(cfg, tab, lo, hi, cov, dp, m)
        first = tab.rows(np.arange(dp * m), st.K.ravel())  # [dp m, 2V] at k0
        dur = first.reshape(dp, m, 2 * nv).transpose(2, 1, 0).reshape(2 * nv * m, dp)
        if g.split:
            assert fused is not None
            w = np.where(fused, 0.0, tab.weight_times())  # [dp m, V]
            dur = np.vstack([dur, w.reshape(dp, m, nv).transpose(2, 1, 0).reshape(nv * m, dp)])
        times = ReplicaTimes(g, dur, pack_lags(g, p2p, dp), tail)
        R = times.finish()
        T_fixed = float(R.max())
        rounds, R = lower(st, times, R)
        T_a = float(R.max())
        R = raise_into_bubbles(st, times, R, T_a, T_fixed)
        K = st.K
        n = dp * m
        floors = st.lo.reshape(dp, m)
        self.stats = {
            "mean_budget": float(K.mean()) if n else float(cfg.k0),
            "floor_share": float(((K == floors) & (K <= cfg.k0)).mean()) if n else 0.0,
            "lowered": float((K < cfg.k0).sum()),
            "raised": float((K > cfg.k0).sum()),
            "predicted_s": float(R.max()),
            "predicted_fixed_s": T_fixed,
            "lowered_s": T_a,
            "rounds": float(rounds),
        }
        return tuple(tuple(Budget.uniform(int(k)) for k in row) for row in K)

    def observe(self, plan: Plan, budgets: Budgets, result=None) -> None:
        """Stateless across iterations, like DST (its decision 1)."""


def _coverage_matrix(coverage, mbs, hi: np.ndarray) -> np.ndarray:
    """[len(mbs), max hi]: micro-batch i's coverage at k = 1..hi[i] (columns past hi[i] unread)."""
    return coverage.microbatch_matrix(mbs, int(hi.max()) if len(mbs) else 0)
