"""Phase (b) of ``dst-cp`` (:mod:`.critical`, loop in :mod:`.critical_phases`): per replica, the
bounds that settle most micro-batches' raise without pricing it (:func:`raise_limits`), and the
exact largest budget within the bound for the rest (:func:`largest_within`)."""

from __future__ import annotations

import numpy as np

MARGIN = 1e-13
"""Relative slack (of the iteration time) added to every bound, far above rounding (~1e-15)."""

FAR = 1e-9
"""A micro-batch whose lower bound exceeds the bound by more than this share of it stays settled
while the replica's raises only lengthen actions (:func:`raise_limits`): kept times drift from an
exact re-timing by a few ulps per move, orders of magnitude below it."""


def raise_limits(st, times, r: int, R_r: float, bound: float, need=None,
                 dead=None) -> tuple[list, list, dict]:
    """Per micro-batch j of replica r (those in ``need``, sorted, when given): the largest k
    surely within ``bound`` and the largest k possibly within it (above it: surely not). Raising
    j's actions by d_a can lengthen any path at most by the sum of d_a (upper bound), and
    lengthens the longest path through each action a by at least d_a (lower bound); both grow
    with k where the table does. Micro-batches whose next budget already breaks the lower bound
    (those on the critical path) are settled first, on one row each. Where a table is not
    monotone in k, an action's path can also lose the other actions' decreases: the lower bound
    counts them, and the third value maps such micro-batches j to their (k, lower bound within,
    upper bound within) for :func:`largest_within`. ``dead`` ([m] bool, optional) gets the
    micro-batches settled with room to spare (:data:`FAR`): paths only grow while every action
    of the replica only lengthens, so their bounds stay broken and the caller may leave them out."""
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
        low = np.maximum(R_r, (through + d1).max(axis=1))
        # rows not monotone in k: the lower bound at every k is at least the one built from the
        # smallest rise of each action and the largest fall over k (kept per micro-batch until its
        # budget moves; fl(+), max are monotone, so bitwise a bound on each k's): where it exceeds
        # the bound, no k is possible (maybe = sure = k_now) and the rows of all k are not read
        nm = np.flatnonzero(~tab.monotone[i_all[js]])
        if nm.size:
            up, down = st.floor.get(st, times, r, js[nm])
            low[nm] = np.maximum(R_r, (through[nm] + up).max(axis=1)) + down
        keep = low <= bound + margin
        if dead is not None:
            dead[js[low > bound * (1.0 + FAR)]] = True
        js, through, now = js[keep], through[keep], now[keep]
    if not js.size:
        return sure.tolist(), maybe.tolist(), {}
    i = i_all[js]
    which, starts, k = _above(K[js], st.hi[i])
    d = tab.rows(i[which], k) - now[which]
    through = through[which]
    up = np.maximum(d, 0.0)
    # a path through action a grows by d_a plus the other actions' changes, at least their
    # decreases (rows not monotone in k can shrink with k): 0 where rows grow with k
    down = np.minimum(d, 0.0).sum(axis=1)
    low = np.maximum(R_r, (through + up).max(axis=1)) + down
    high = np.maximum(R_r, through.max(axis=1) + up.sum(axis=1))
    low_ok, high_ok = low <= bound + margin, high <= bound - margin
    for out, ok in ((sure, high_ok), (maybe, low_ok)):
        best = np.maximum.reduceat(np.where(ok, k, 0), starts)  # largest k that passes, 0: none
        out[js] = np.maximum(out[js], best)
    # bisection needs monotone rows: these are priced k by k (sure stays k_now), from the
    # largest k the lower bound allows (maybe) down to the first that the upper bound settles
    bad = np.flatnonzero(~tab.monotone[i])
    odd = {}
    for x in bad.tolist():
        a = int(starts[x])
        b = int(starts[x + 1]) if x + 1 < len(starts) else len(k)
        odd[int(js[x])] = (k[a:b], low_ok[a:b], high_ok[a:b])
    sure[js[bad]] = K[js[bad]]
    return sure.tolist(), maybe.tolist(), odd


def _above(K: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every budget above the current one up to the cap, micro-batch after micro-batch, as one
    run of rows each: (owner index per row, first row of each run, k per row). Every K < hi."""
    span = hi - K
    which = np.repeat(np.arange(len(K)), span)
    starts = np.cumsum(span) - span
    return which, starts, K[which] + 1 + (np.arange(int(span.sum())) - starts[which])


class FloorCache:
    """Per micro-batch i of a not-monotone table, at its current budget K: over k = K+1..k_hi[i],
    the smallest rise max(d, 0) of each action ([2 V]) and the smallest sum of falls min(d, 0)
    (d = row(k) - row(K)), computed as :func:`raise_limits` computes them. Only a raised
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
            which, starts, k = _above(K_s, st.hi[i_s])
            d = st.tab.rows(i_s[which], k) - times.own_durations(r, js_s)[which]
            self.up[i_s] = np.minimum.reduceat(np.maximum(d, 0.0), starts, axis=0)
            self.down[i_s] = np.minimum.reduceat(np.minimum(d, 0.0).sum(axis=1), starts)
            self.at[i_s] = K_s
        return self.up[i], self.down[i]


def largest_within(st, times, r: int, j: int, lo: int, hi: int, bound: float, odd=None) -> int:
    """Largest k in [lo, hi] with replica r's exact finish within ``bound`` when j runs at k,
    given that lo is (the current budget or) within it: bisection, the finish grows with k.
    Rows not monotone in k: the largest k within among those whose lower bound allows it (``odd``
    from :func:`raise_limits`: k, lower bound within, upper bound within), priced down to the
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
