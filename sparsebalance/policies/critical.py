"""``dst-cp``: critical-path DST. Budgets chosen against the pipeline schedule, not an anchor.

DST (:mod:`.tuning`) balances every micro-batch toward an anchor latency. What sets the pace of a
PP x DP iteration is the critical path of the schedule: the slowest replica's 1F1B/GPipe makespan,
then the all-reduce that waits for it. ``dst-cp`` predicts that iteration time exactly (the
simulator's timing core, :mod:`sparsebalance.simulator.timing`, on the schedule's graph) and:

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

Cost: stage times of every micro-batch at every k in [floor, k_hi] (``LatencyModel.attention``
summed over its sequences, affine in a stage's layer count; one vectorised call for all), then the
moves are priced exactly without re-timing the schedule (:mod:`sparsebalance.simulator.perturb`):
each replica's action times and times-to-end are kept, a move of micro-batch j re-times only the
window between F(0, j) and B(0, j) (about pp^2 actions for 1F1B), and an applied move updates the
kept times in one pass. So phase (a) costs O(rounds x (candidates x window + actions)) and phase
(b) O(micro-batches x k range x window + applied moves x actions), where the former closed-form
evaluator re-timed every action for every candidate (quadratic in micro-batches per rank).
``stats``: mean_budget, floor_share, lowered, raised (counts vs k0), rounds, and predicted seconds:
``predicted_fixed_s`` (all k0), ``lowered_s`` (after a), ``predicted_s`` (final).
"""

from __future__ import annotations

import numpy as np

from sparsebalance.errors import ConfigError
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.stage_tables import StageTable, budget_monotone_range
from sparsebalance.policies.tuning import DynamicSparsity
from sparsebalance.simulator.graph import ActionGraph, schedule_graph
from sparsebalance.simulator.perturb import SMALL_GRAPH, ReplicaTimes
from sparsebalance.simulator.plan import Budgets, Plan
from sparsebalance.simulator.timing import pack_lags

PRICE_ALL = 16
"""A critical replica with at most this many candidate moves prices them all in one call; with
more, candidates are priced best bound first until no bound can beat the best price."""

MARGIN = 1e-13
"""Relative slack (of the iteration time) added to every bound, far above rounding (~1e-15)."""


def graph_for(cluster, m: int) -> ActionGraph:
    """The (cached, read-only) dependency graph of ``cluster``'s schedule for ``m`` micro-batches."""
    return schedule_graph(cluster.schedule, cluster.pp, m, cluster.virtual_stages)


class CriticalPathDST:
    """``dst-cp``: see the module docstring."""

    name = "dst-cp"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.stats: dict[str, float] = {}
        self._dst = DynamicSparsity(cfg)  # kept for callers of .floor; budgets() reads floors off the curve
        self._latency = None
        self._tail: np.ndarray | None = None
        self._monotone: tuple[float, float] | None = None

    def stage_table(self, lm, lengths: tuple[int, ...], k_lo: int, k_hi: int, nv: int, pp: int,
                    split: bool = False):
        """Forward and backward seconds of every virtual stage at k = k_lo..k_hi: two arrays
        [k_hi - k_lo + 1, V] (see :mod:`.stage_tables`); with ``split`` a third, the backward's
        input-gradient part I (its weight-gradient part W does not depend on k: :meth:`weight_times`)."""
        ks = np.arange(k_lo, k_hi + 1)
        at = np.zeros(len(ks), dtype=np.int64)
        whole = StageTable(lm, [lengths], [k_lo], [k_hi], [k_hi], nv, pp).rows(at, ks)
        if not split:
            return whole[:, :nv], whole[:, nv:]
        parts = StageTable(lm, [lengths], [k_lo], [k_hi], [k_hi], nv, pp,
                           fused=np.zeros((1, nv), dtype=bool)).rows(at, ks)
        return whole[:, :nv], whole[:, nv:], parts[:, nv:]

    @staticmethod
    def weight_times(lm, lengths: tuple[int, ...], nv: int, pp: int) -> np.ndarray:
        """[V] seconds of the weight-gradient part W of each virtual stage's backward (attention
        has no weights, so W is the same at every budget)."""
        return np.array([lm.stage_time(lengths, 1, vs % pp, backward=True, chunk=vs // pp, part="weight")
                         for vs in range(nv)])

    def budgets(self, plan: Plan, ctx: PolicyContext) -> Budgets:
        cfg, lm, cl = self.cfg, ctx.latency, ctx.cluster
        if not hasattr(lm, "stage_time"):
            raise ConfigError("policy.tuning: dst-cp needs a latency model with stage_time "
                              "(sparsebalance.simulator.latency.LatencyModel)")
        dp, m = plan.dp, plan.num_microbatches
        pp, nv = cl.pp, cl.pp * cl.virtual_stages
        g = graph_for(cl, m)
        if self._latency is not lm:
            self._latency = lm
            self._tail = np.array([lm.allreduce_time(s) + lm.optimizer_time(s) for s in range(pp)])
            self._monotone = budget_monotone_range(lm)
        mbs = [mb for _, _, mb in plan.microbatches()]  # flat index i = r * m + j
        lengths = [mb.lengths for mb in mbs]
        bs = ctx.model.block_size
        hi = np.array([min(cfg.k_max, max(cfg.k0, -(-max(x) // bs))) for x in lengths], dtype=np.int64)
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
        mono = self._monotone
        lazy = mono is not None and mono[0] <= min(map(min, lengths)) and max(map(max, lengths)) <= mono[1]
        tab = StageTable(lm, lengths, lo, np.minimum(hi, cfg.k0 + 1) if lazy else hi, hi, nv, pp, fused=fused)
        st = _State(cfg, tab, lo, hi, cov, dp, m)
        first = tab.rows(np.arange(dp * m), st.K.ravel())  # [dp m, 2V] at k0
        dur = first.reshape(dp, m, 2 * nv).transpose(2, 1, 0).reshape(2 * nv * m, dp)
        if g.split:
            w = np.where(fused, 0.0, tab.weight_times())  # [dp m, V]
            dur = np.vstack([dur, w.reshape(dp, m, nv).transpose(2, 1, 0).reshape(nv * m, dp)])
        times = ReplicaTimes(g, dur, pack_lags(g, p2p, dp), self._tail)
        R = times.finish()
        T_fixed = float(R.max())
        rounds, R = _lower(st, times, R)
        T_a = float(R.max())
        R = _raise(st, times, R, T_a, T_fixed)
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
        return tuple(tuple(int(k) for k in row) for row in K)

    def observe(self, plan: Plan, budgets: Budgets, result=None) -> None:
        """Stateless across iterations, like DST (its decision 1)."""


def _coverage_matrix(coverage, mbs, hi: np.ndarray) -> np.ndarray:
    """[len(mbs), max hi]: micro-batch i's coverage at k = 1..hi[i] (columns past hi[i] unread)."""
    width = int(hi.max()) if len(mbs) else 0
    many = getattr(coverage, "microbatch_matrix", None)
    if many is not None:
        return many(mbs, width)
    out = np.ones((len(mbs), width))
    for i, (mb, k) in enumerate(zip(mbs, hi.tolist())):
        out[i, :k] = coverage.microbatch_curve(mb, k)
    return out


class _State:
    """Budgets and per-(micro-batch, k) lookups of one decision; flat index i = r * m + j."""

    def __init__(self, cfg, tab: StageTable, lo, hi, cov: np.ndarray, dp: int, m: int) -> None:
        self.cfg, self.tab = cfg, tab
        self.dp, self.m = dp, m
        self.lo = np.asarray(lo, dtype=np.int64)
        self.hi = np.asarray(hi, dtype=np.int64)
        self.K = np.full((dp, m), cfg.k0, dtype=np.int64)
        self.cov = cov  # [dp m, width]: C(k) of micro-batch i at column k - 1 (k <= hi[i])

    def coverage(self, i, k):
        return self.cov[i, np.asarray(k) - 1]


def _lower(st: _State, times: ReplicaTimes, R: np.ndarray) -> tuple[int, np.ndarray]:
    """Phase (a): see the module docstring. Returns (rounds, exact finishes after it)."""
    cfg, m = st.cfg, st.m
    T = float(R.max())
    eps = 1e-12 * T
    step, rounds = max(1, cfg.k0 // 4), 0
    moved = False
    while rounds < cfg.cp_rounds:
        crit = np.flatnonzero(R >= T - eps)
        below = R < T - eps
        rest = float(np.max(R[below])) if below.any() else -np.inf
        best = {}
        for r in crit.tolist():
            js = np.flatnonzero(st.K[r] > st.lo[r * m:(r + 1) * m])
            if js.size:
                pick = _best_cut(st, times, r, js, step, T, float(R[r]), rest, eps)
                if pick is not None:
                    best[r] = pick
        rounds += 1
        if len(best) < len(crit):  # some critical replica cannot be shortened at this step
            if step == 1:
                break
            step //= 2
            continue
        for r, (j, k, new) in best.items():
            st.K[r, j] = k
            times.apply(r, j, new)
        moved = True
        R = times.finish()
        T = float(R.max())
    # the decision's figures are those of an exact re-timing (kept times may differ by ulps)
    return rounds, (times.exact_finish(range(st.dp)) if moved else R)


def _best_cut(st, times, r, js, step, T, R_r, rest, eps):
    """The move of replica r's critical phase: among micro-batches ``js`` lowered by ``step``
    (not below their floor), the largest saving of the iteration time per unit of coverage lost
    (first on ties), None when none saves more than ``eps``. Prices every candidate when they are
    few; else in order of an upper bound on the saving: the moved durations of the candidate's
    critical actions (every longest path loses at most those), capped by T - rest."""
    m = st.m
    i = r * m + js
    K = st.K[r, js]
    kn = np.maximum(st.lo[i], K - step)
    new = st.tab.rows(i, kn)
    if len(js) <= PRICE_ALL or times.cuts.n <= SMALL_GRAPH:
        loss = np.maximum(st.coverage(i, K) - st.coverage(i, kn), 1e-15)
        saving = T - np.maximum(times.finish_if(np.full(len(js), r), js, new), rest)
        ok = np.flatnonzero(saving > eps)
        if not ok.size:
            return None
        eff = saving[ok] / loss[ok]
        x = int(ok[np.argmax(eff)])  # argmax: the first of equal maxima
        return int(js[x]), int(kn[x]), new[x]
    through = times.own_through(r, js)
    cut = np.maximum(times.own_durations(r, js) - new, 0.0)
    b = (cut * (through >= R_r - 1e-9 * T)).sum(axis=1)
    bound = np.minimum(T - R_r + b, T - rest) + MARGIN * T
    cand = np.flatnonzero(bound > eps)
    if not cand.size:
        return None
    loss = np.ones(len(js))  # read at candidates only
    loss[cand] = np.maximum(st.coverage(i[cand], K[cand]) - st.coverage(i[cand], kn[cand]), 1e-15)
    order = cand[np.lexsort((cand, -(bound[cand] / loss[cand])))]  # best bound first, then index
    eff_b = (bound / loss)[order]
    best_eff, best_x, at, size = -np.inf, -1, 0, 2
    while at < len(order) and eff_b[at] >= best_eff:
        chunk = order[at:at + size]
        chunk = chunk[eff_b[at:at + size] >= best_eff]
        fin = times.finish_if(np.full(len(chunk), r), js[chunk], new[chunk])
        saving = T - np.maximum(fin, rest)
        eff = saving / loss[chunk]
        for x, s_, e_ in zip(chunk.tolist(), saving.tolist(), eff.tolist()):
            if s_ > eps and (e_ > best_eff or (e_ == best_eff and x < best_x)):
                best_eff, best_x = e_, x
        at += size
        size *= 2
    if best_x < 0:
        return None
    return int(js[best_x]), int(kn[best_x]), new[best_x]


def _raise(st: _State, times: ReplicaTimes, R: np.ndarray, T_a: float, T_fixed: float) -> np.ndarray:
    """Phase (b): see the module docstring. Returns the finishes after it (exact)."""
    cfg, dp, m = st.cfg, st.dp, st.m
    bound = max(T_a, min(T_a * (1.0 + cfg.cp_raise_tol), T_fixed)) * (1 + 1e-12)
    raised = False
    hi = st.hi.tolist()
    for _ in range(2):
        changed = False
        flat = st.K.ravel()  # a view: follows st.K
        order = np.lexsort((np.arange(dp * m), st.coverage(np.arange(dp * m), flat)))
        todo = [i for i in order.tolist() if flat[i] < hi[i]]
        others = _others(R)
        limits: dict[int, tuple[list, list]] = {}  # per replica, valid until it changes
        for i in todo:
            r, j = divmod(i, m)
            if others[r] > bound:
                continue
            if r not in limits:
                limits[r] = _raise_limits(st, times, r, float(R[r]), bound)
            k_now = int(flat[i])
            sure, maybe = limits[r][0][j], limits[r][1][j]
            if maybe <= k_now:
                continue
            k = _largest_within(st, times, r, j, max(sure, k_now), maybe, bound)
            if k > k_now:
                st.K[r, j] = k
                times.apply(r, j, st.tab.rows([i], [k])[0])
                R = times.finish()
                others = _others(R)
                changed = raised = True
                limits.pop(r)
        if not changed:
            break
    return times.exact_finish(range(dp)) if raised else R


def _others(R: np.ndarray) -> list[float]:
    """Per replica, the largest finish of the other replicas (-inf with one replica)."""
    if len(R) == 1:
        return [-np.inf]
    top = np.argsort(-R, kind="stable")[:2]
    first, second = float(R[top[0]]), float(R[top[1]])
    return [second if r == top[0] else first for r in range(len(R))]


def _raise_limits(st, times, r: int, R_r: float, bound: float) -> tuple[list, list]:
    """Per micro-batch j of replica r: the largest k surely within ``bound`` and the largest k
    possibly within it (above it: surely not). Raising j's actions by d_a can lengthen any path at
    most by the sum of d_a (upper bound), and lengthens the longest path through each action a by
    at least d_a (lower bound); both grow with k where the table does. Micro-batches whose next
    budget already breaks the lower bound (those on the critical path) are settled first, on
    one row each; where a table is not monotone in k every k is priced."""
    m, tab = st.m, st.tab
    i_all = r * m + np.arange(m)
    K = st.K[r]
    sure, maybe = K.copy(), K.copy()
    margin = MARGIN * bound
    js = np.flatnonzero(K < st.hi[i_all])
    if js.size:
        through = times.own_through(r, js)
        now = times.own_durations(r, js)
        d1 = tab.rows(i_all[js], K[js] + 1) - now
        keep = np.maximum(R_r, (through + d1).max(axis=1)) <= bound + margin
        keep |= ~tab.monotone[i_all[js]]
        js, through, now = js[keep], through[keep], now[keep]
    if not js.size:
        return sure.tolist(), maybe.tolist()
    i = i_all[js]
    span = st.hi[i] - K[js]
    which = np.repeat(np.arange(len(js)), span)
    k = K[js][which] + 1 + (np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span))
    d = tab.rows(i[which], k) - now[which]
    through = through[which]
    low = np.maximum(R_r, (through + d).max(axis=1))
    high = np.maximum(R_r, through.max(axis=1) + np.maximum(d, 0.0).sum(axis=1))
    starts = np.cumsum(span) - span  # each micro-batch's k's are one run of rows
    for out, ok in ((sure, high <= bound - margin), (maybe, low <= bound + margin)):
        best = np.maximum.reduceat(np.where(ok, k, 0), starts)  # largest k that passes, 0: none
        out[js] = np.maximum(out[js], best)
    odd = js[~tab.monotone[i]]  # bisection needs monotone rows: price every k of these
    sure[odd], maybe[odd] = K[odd], st.hi[r * m + odd]
    return sure.tolist(), maybe.tolist()


def _largest_within(st, times, r: int, j: int, lo: int, hi: int, bound: float) -> int:
    """Largest k in [lo, hi] with replica r's exact finish within ``bound`` when j runs at k,
    given that lo is (the current budget or) within it: bisection, the finish grows with k."""
    i = r * st.m + j
    if not st.tab.monotone[i]:  # price every k, keep the largest within (as without bisection)
        ks = np.arange(lo + 1, hi + 1)
        if not ks.size:
            return lo
        fin = times.finish_if(np.full(len(ks), r), np.full(len(ks), j), st.tab.rows(np.full(len(ks), i), ks))
        ok = np.flatnonzero(fin <= bound)
        return int(ks[ok[-1]]) if ok.size else lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fin = times.finish_if(np.array([r]), np.array([j]), st.tab.rows([i], [mid]))
        if fin[0] <= bound:
            lo = mid
        else:
            hi = mid - 1
    return lo
