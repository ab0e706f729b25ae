"""The two phases of ``dst-cp`` (:mod:`.critical`): lowering critical micro-batches and raising
budgets into bubbles, on one decision's :class:`State` and the kept times of its replicas
(:class:`~sparsebalance.simulator.schedule.perturb.ReplicaTimes`). See :mod:`.critical` for the rules; the
raise phase's bounds and exact pricing are in :mod:`.critical_raise`."""

from __future__ import annotations

import numpy as np

from sparsebalance.policies.critical_raise import MARGIN, FloorCache, largest_within, raise_limits
from sparsebalance.policies.stage_tables import StageTable
from sparsebalance.simulator.schedule.perturb import SMALL_GRAPH, ReplicaTimes

PRICE_ALL = 16
"""A critical replica with at most this many candidate moves prices them all in one call; with
more, candidates are priced best bound first until no bound can beat the best price."""


class State:
    """Budgets and per-(micro-batch, k) lookups of one decision; flat index i = r * m + j."""

    def __init__(self, cfg, tab: StageTable, lo, hi, cov: np.ndarray, dp: int, m: int) -> None:
        self.cfg, self.tab = cfg, tab
        self.dp, self.m = dp, m
        self.lo = np.asarray(lo, dtype=np.int64)
        self.hi = np.asarray(hi, dtype=np.int64)
        self.K = np.full((dp, m), cfg.k0, dtype=np.int64)
        self.cov = cov  # [dp m, width]: C(k) of micro-batch i at column k - 1 (k <= hi[i])
        self.floor = FloorCache(dp * m, 2 * tab.nv)

    def coverage(self, i, k):
        return self.cov[i, np.asarray(k) - 1]


def lower(st: State, times: ReplicaTimes, R: np.ndarray) -> tuple[int, np.ndarray]:
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


def raise_into_bubbles(st: State, times: ReplicaTimes, R: np.ndarray, T_a: float, T_fixed: float) -> np.ndarray:
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
        todo_a = np.array(todo, dtype=np.int64)
        others = _others(R)
        limits: dict[int, tuple[list, list, dict]] = {}  # per replica, valid until it changes
        dead: dict[int, np.ndarray] = {}  # per replica, settled while its actions only lengthen
        for at, i in enumerate(todo):
            r, j = divmod(i, m)
            if others[r] > bound:
                continue
            if r not in limits:  # only for r's micro-batches still ahead in this pass: each
                ahead = todo_a[at:]  # is visited once, and the limits of one do not read another's
                need = np.sort(ahead[ahead // m == r] - r * m)
                gone = dead.setdefault(r, np.zeros(m, dtype=bool))
                limits[r] = raise_limits(st, times, r, float(R[r]), bound, need[~gone[need]], gone)
            k_now = int(flat[i])
            sure, maybe, odd = limits[r]
            if maybe[j] <= k_now:
                continue
            k = largest_within(st, times, r, j, max(sure[j], k_now), maybe[j], bound, odd.get(j))
            if k > k_now:
                st.K[r, j] = k
                new = st.tab.rows([i], [k])[0]
                if not (new >= times.own_durations(r, np.array([j]))[0]).all():
                    dead.pop(r, None)  # an action shortens: paths through the others may too
                times.apply(r, j, new)
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
