"""The two phases of ``dst-cp`` (:mod:`.critical`): lowering critical micro-batches and raising
budgets into bubbles, on one decision's :class:`State` and the kept times of its replicas
(:class:`~sparsebalance.simulator.perturb.ReplicaTimes`). See :mod:`.critical` for the rules."""

from __future__ import annotations

import numpy as np

from sparsebalance.policies.stage_tables import StageTable
from sparsebalance.simulator.perturb import SMALL_GRAPH, ReplicaTimes

PRICE_ALL = 16
"""A critical replica with at most this many candidate moves prices them all in one call; with
more, candidates are priced best bound first until no bound can beat the best price."""

MARGIN = 1e-13
"""Relative slack (of the iteration time) added to every bound, far above rounding (~1e-15)."""


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
        limits: dict[int, tuple[list, list]] = {}  # per replica, valid until it changes
        for at, i in enumerate(todo):
            r, j = divmod(i, m)
            if others[r] > bound:
                continue
            if r not in limits:  # only for r's micro-batches still ahead in this pass: each
                ahead = todo_a[at:]  # is visited once, and the limits of one do not read another's
                need = np.sort(ahead[ahead // m == r] - r * m)
                limits[r] = _raise_limits(st, times, r, float(R[r]), bound, need)
            k_now = int(flat[i])
            sure, maybe, odd = limits[r]
            if maybe[j] <= k_now:
                continue
            k = _largest_within(st, times, r, j, max(sure[j], k_now), maybe[j], bound, odd.get(j))
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


def _raise_limits(st, times, r: int, R_r: float, bound: float, need=None) -> tuple[list, list, dict]:
    """Per micro-batch j of replica r (those in ``need``, sorted, when given): the largest k surely within ``bound`` and the largest k
    possibly within it (above it: surely not). Raising j's actions by d_a can lengthen any path at
    most by the sum of d_a (upper bound), and lengthens the longest path through each action a by
    at least d_a (lower bound); both grow with k where the table does. Micro-batches whose next
    budget already breaks the lower bound (those on the critical path) are settled first, on
    one row each. Where a table is not monotone in k, an action's path can also lose the other
    actions' decreases: the lower bound counts them, and the third value maps such micro-batches
    j to their (k, lower bound within, upper bound within) for :func:`_largest_within`."""
    m, tab = st.m, st.tab
    i_all = r * m + np.arange(m)
    K = st.K[r]
    sure, maybe = K.copy(), K.copy()
    margin = MARGIN * bound
    js = np.flatnonzero(K < st.hi[i_all]) if need is None else need[K[need] < st.hi[r * m + need]]
    if js.size:
        through = times.own_through(r, js)
        now = times.own_durations(r, js)
        d1 = tab.rows(i_all[js], K[js] + 1) - now
        keep = np.maximum(R_r, (through + d1).max(axis=1)) <= bound + margin
        # rows not monotone in k: the lower bound at every k is at least the one built from the
        # smallest rise of each action and the largest fall over k (kept per micro-batch until its
        # budget moves; fl(+), max are monotone, so bitwise a bound on each k's): where it exceeds
        # the bound, no k is possible (maybe = sure = k_now) and the rows of all k are not read
        nm = np.flatnonzero(~tab.monotone[i_all[js]])
        if nm.size:
            up, down = st.floor.get(st, times, r, js[nm])
            keep[nm] = np.maximum(R_r, (through[nm] + up).max(axis=1)) + down <= bound + margin
        js, through, now = js[keep], through[keep], now[keep]
    if not js.size:
        return sure.tolist(), maybe.tolist(), {}
    i = i_all[js]
    span = st.hi[i] - K[js]
    which = np.repeat(np.arange(len(js)), span)
    k = K[js][which] + 1 + (np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span))
    d = tab.rows(i[which], k) - now[which]
    through = through[which]
    up = np.maximum(d, 0.0)
    # a path through action a grows by d_a plus the other actions' changes, at least their
    # decreases (rows not monotone in k can shrink with k): 0 where rows grow with k
    down = np.minimum(d, 0.0).sum(axis=1)
    low = np.maximum(R_r, (through + up).max(axis=1)) + down
    high = np.maximum(R_r, through.max(axis=1) + up.sum(axis=1))
    starts = np.cumsum(span) - span  # each micro-batch's k's are one run of rows
    low_ok, high_ok = low <= bound + margin, high <= bound - margin
    for out, ok in ((sure, high_ok), (maybe, low_ok)):
        best = np.maximum.reduceat(np.where(ok, k, 0), starts)  # largest k that passes, 0: none
        out[js] = np.maximum(out[js], best)
    # bisection needs monotone rows: these are priced k by k (sure stays k_now), from the
    # largest k the lower bound allows (maybe) down to the first that the upper bound settles
    bad = np.flatnonzero(~tab.monotone[i])
    odd = {}
    for x in bad.tolist():
        a, b = int(starts[x]), int(starts[x] + span[x])
        odd[int(js[x])] = (k[a:b], low_ok[a:b], high_ok[a:b])
    sure[js[bad]] = K[js[bad]]
    return sure.tolist(), maybe.tolist(), odd


class FloorCache:
    """Per micro-batch i of a not-monotone table, at its current budget K: over k = K+1..k_hi[i],
    the smallest rise max(d, 0) of each action ([2 V]) and the smallest sum of falls min(d, 0)
    (d = row(k) - row(K)), computed as :func:`_raise_limits` computes them. Only a raised
    micro-batch's entry is recomputed, where every call re-derived them all."""

    def __init__(self, n: int, width: int) -> None:
        self.at = np.full(n, -1, dtype=np.int64)  # the budget each entry was computed at
        self.up = np.zeros((n, width))
        self.down = np.zeros(n)

    def get(self, st, times, r: int, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = r * st.m + js
        K = st.K[r, js]
        stale = np.flatnonzero(self.at[i] != K)
        if stale.size:
            js_s, i_s, K_s = js[stale], i[stale], K[stale]
            span = st.hi[i_s] - K_s
            which = np.repeat(np.arange(len(js_s)), span)
            starts = np.cumsum(span) - span
            k = K_s[which] + 1 + (np.arange(int(span.sum())) - starts[which])
            d = st.tab.rows(i_s[which], k) - times.own_durations(r, js_s)[which]
            self.up[i_s] = np.minimum.reduceat(np.maximum(d, 0.0), starts, axis=0)
            self.down[i_s] = np.minimum.reduceat(np.minimum(d, 0.0).sum(axis=1), starts)
            self.at[i_s] = K_s
        return self.up[i], self.down[i]


def _largest_within(st, times, r: int, j: int, lo: int, hi: int, bound: float, odd=None) -> int:
    """Largest k in [lo, hi] with replica r's exact finish within ``bound`` when j runs at k,
    given that lo is (the current budget or) within it: bisection, the finish grows with k.
    Rows not monotone in k: the largest k within among those whose lower bound allows it (``odd``
    from :func:`_raise_limits`: k, lower bound within, upper bound within), priced down to the
    largest k that the upper bound settles; the same k as pricing every k."""
    i = r * st.m + j
    if not st.tab.monotone[i]:
        if odd is None:  # no bounds: price every k
            ks = np.arange(lo + 1, hi + 1)
        else:
            ks, low_ok, high_ok = odd
            keep = (ks > lo) & (ks <= hi) & low_ok
            ks, settled = ks[keep], np.flatnonzero(high_ok[keep])
            top = int(settled[-1]) if settled.size else -1
            if top >= 0:
                lo, ks = int(ks[top]), ks[top + 1:]
        if not ks.size:
            return lo
        rows = st.tab.rows(np.full(len(ks), i), ks)
        for x in range(len(ks) - 1, -1, -1):  # the largest k within: from the top, first found
            if times.finish_one(r, j, rows[x]) <= bound:
                return int(ks[x])
        return lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if times.finish_one(r, j, st.tab.row(i, mid)) <= bound:
            lo = mid
        else:
            hi = mid - 1
    return lo
