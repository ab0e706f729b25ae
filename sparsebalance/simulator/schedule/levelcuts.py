"""A schedule's dependency graph in level order, with the edges that cross each cut between levels.

What local re-timing (:mod:`.perturb`) reads. Nodes are renumbered by **row**: their position when
sorted by topological level (:attr:`.graph.ActionGraph.levels`), so the rows of levels ``a..b``
form one contiguous range and a what-if over them reads and writes slices. Level ``l`` holds rows
``level_start[l]:level_start[l + 1]``; the **cut** ``c`` lies between levels ``c - 1`` and ``c``.

Why cuts: every path from the iteration's start to its end (a sink edge after the last action of
a device) crosses every cut exactly once, over one edge from a row before the cut to a row after
it. So when only rows before cut ``c`` change, the iteration time is the max over the edges
crossing ``c`` of (end of the source + lag + the target's duration and time to the end), which
the rows after the cut keep. The crossing edges of a cut are few (about twice the number of
devices for 1F1B), whatever the number of micro-batches.

Sink edges are stored with target row ``n`` (the "end" node) and the physical stage in the lag
field; P2P lags by their lag id (:mod:`.graph`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from sparsebalance.simulator.schedule.graph import ActionGraph


@dataclass(frozen=True, slots=True, eq=False)
class LevelCuts:
    """Row-ordered view of one graph (see the module docstring). Lists are for Python loops."""

    n: int
    """Nodes (= rows); row ``n`` stands for the end of the iteration."""
    levels: int
    """Number of levels."""
    node: np.ndarray
    """[n] the node at each row."""
    row: np.ndarray
    """[n] the row of each node."""
    level_start: list
    """[levels + 1] first row of each level (and n)."""
    prev: list
    """[n] row of the action run before it on its device, -1 for the first."""
    deps: list
    """[n] ((row, lag id), ...) data predecessors."""
    next: list
    """[n] row of the action run after it on its device, -1 for the last."""
    succ: list
    """[n] ((row, lag id), ...) data successors."""
    sink: list
    """[n] physical stage whose last action the row is, else -1."""
    pred_lo: list
    """[levels] lowest predecessor row (or own row) of any row at this level or later."""
    succ_hi: list
    """[levels] one past the highest successor row (or own row) of any row at this level or before."""
    cut_ptr: list
    """[levels + 2] edges crossing cut c are cut_src[cut_ptr[c]:cut_ptr[c + 1]] (and dst, lag)."""
    cut_src: list
    cut_dst: list
    cut_lag: list
    last_source: int
    """Highest row without any predecessor (its start is 0 s whatever happens before it)."""
    last_rows: np.ndarray
    """[pp] row of each physical stage's last action."""
    own: np.ndarray
    """[m, 2 V] rows of micro-batch j's actions whose seconds a budget moves: F of vstages
    0..V-1, then B (or I in a split-backward graph; W keeps its seconds)."""
    span: list
    """[m] (first level, last level) of micro-batch j's own actions."""


@functools.lru_cache(maxsize=32)
def level_cuts(graph: ActionGraph) -> LevelCuts:
    """The (cached) :class:`LevelCuts` of ``graph``; numpy over all nodes, O(actions)."""
    g, n = graph, graph.n
    order = np.concatenate(g.levels) if g.levels else np.zeros(0, dtype=np.int64)
    sizes = np.array([len(x) for x in g.levels], dtype=np.int64)
    nlev = len(sizes)
    level_start = np.concatenate(([0], np.cumsum(sizes)))
    row = np.empty(n + 1, dtype=np.int64)
    row[order] = np.arange(n)
    row[n] = -1  # the sentinel: "no predecessor"
    lev = np.repeat(np.arange(nlev), sizes)  # level of each row
    prev = row[g.prev[order]]
    dep_rows = row[g.deps[order]]  # [n, D], -1 where none
    dep_lags = g.lags[order]
    # edges (src row -> dst row, lag id): device order, data, and the sink edges of the last actions
    d_src, d_col = np.nonzero(dep_rows >= 0)
    has_prev = np.flatnonzero(prev >= 0)
    last_rows = row[g.last]
    src = np.concatenate([prev[has_prev], dep_rows[d_src, d_col], last_rows])
    dst = np.concatenate([has_prev, d_src, np.full(g.pp, n)])
    lag = np.concatenate([np.full(len(has_prev), g.zero_lag), dep_lags[d_src, d_col], np.arange(g.pp)])
    lev_ext = np.append(lev, nlev)  # the end sits after the last level
    span = lev_ext[dst] - lev[src]  # the edge crosses cuts lev[src] + 1 .. lev[dst]
    rep = np.repeat(np.arange(len(src)), span)
    cut = lev[src][rep] + 1 + (np.arange(len(rep)) - np.repeat(np.cumsum(span) - span, span))
    o = np.argsort(cut, kind="stable")
    cut_ptr = np.searchsorted(cut[o], np.arange(nlev + 2), side="left")
    nxt = np.full(n, -1, dtype=np.int64)
    nxt[prev[has_prev]] = has_prev
    sink = np.full(n, -1, dtype=np.int64)
    sink[last_rows] = np.arange(g.pp)
    # slice bounds: lowest predecessor of any row at level >= l; highest successor at level <= l
    own_lo = np.arange(n)
    low = np.minimum(own_lo, np.where(prev >= 0, prev, n))
    for c in range(dep_rows.shape[1]):
        low = np.minimum(low, np.where(dep_rows[:, c] >= 0, dep_rows[:, c], n))
    lvl_low = np.minimum.reduceat(low, level_start[:-1]) if n else low
    pred_lo = np.minimum.accumulate(lvl_low[::-1])[::-1]
    high = np.arange(n) + 1
    np.maximum.at(high, src[dst < n], dst[dst < n] + 1)
    lvl_high = np.maximum.reduceat(high, level_start[:-1]) if n else high
    succ_hi = np.maximum.accumulate(lvl_high)
    srcs = np.zeros(n, dtype=bool)
    srcs[:] = prev < 0
    srcs &= (dep_rows < 0).all(axis=1)
    # per row its ((row, lag id), ...) predecessors in column order, and successors in row order
    deps_l = _pairs(np.repeat(np.arange(n), dep_rows.shape[1]), dep_rows.ravel(), dep_lags.ravel(), n)
    succ_src = dep_rows[d_src, d_col]
    o_s = np.lexsort((d_col, d_src, succ_src))  # by source row, then target row, then column
    succ_l = _pairs(succ_src[o_s], d_src[o_s], dep_lags[d_src, d_col][o_s], n)
    per_kind = g.nv * g.m
    moved = 2 if len(g.kinds) > 1 else len(g.kinds)  # F and B, or F and I: W keeps its seconds
    own_nodes = (np.arange(moved * g.nv)[None, :] * g.m + np.arange(g.m)[:, None])
    own = row[own_nodes] if per_kind else np.zeros((g.m, 0), dtype=np.int64)
    own_lev = lev[own] if own.size else np.zeros((g.m, 0), dtype=np.int64)
    span_l = list(zip(own_lev.min(axis=1).tolist(), own_lev.max(axis=1).tolist())) if own.size else []
    return LevelCuts(
        n=n, levels=nlev, node=order, row=row[:n], level_start=level_start.tolist(),
        prev=prev.tolist(), deps=deps_l, next=nxt.tolist(), succ=succ_l, sink=sink.tolist(),
        pred_lo=pred_lo.tolist(), succ_hi=succ_hi.tolist(), cut_ptr=cut_ptr.tolist(),
        cut_src=src[rep][o].tolist(), cut_dst=dst[rep][o].tolist(), cut_lag=lag[rep][o].tolist(),
        last_source=int(np.flatnonzero(srcs).max()) if srcs.any() else -1,
        last_rows=last_rows, own=own, span=span_l)


def _pairs(owner: np.ndarray, other: np.ndarray, lag: np.ndarray, n: int) -> list:
    """[n] tuples ((other, lag), ...) of each owner row, in the given order (entries with other < 0
    dropped): one Python tuple per row, built from runs of equal owners."""
    keep = other >= 0
    owner, other, lag = owner[keep], other[keep], lag[keep]
    out: list = [()] * n
    if not len(owner):
        return out
    pairs = list(zip(other.tolist(), lag.tolist()))
    starts = np.flatnonzero(np.concatenate(([True], owner[1:] != owner[:-1])))
    ends = np.append(starts[1:], len(owner))
    for x, a, b in zip(owner[starts].tolist(), starts.tolist(), ends.tolist()):
        out[x] = tuple(pairs[a:b])
    return out


def forward(cx: LevelCuts, dur: list[float], lag: list[float], starts: list[float] | None = None) -> list[float]:
    """[n] the end of every row of one column: the timing core's recurrence (``start = max(end of
    the device's previous action, end of each data predecessor + its lag)``, ``end = start +
    duration``) as a plain loop over the rows in level order. ``dur`` per row, ``lag`` per lag id;
    ``starts`` (length n), when given, receives each row's start. Bitwise the numpy levels' and
    the compiled loop's values: the same floats combined in the same order."""
    end = [0.0] * cx.n
    for x, p, deps in zip(range(cx.n), cx.prev, cx.deps):
        t = end[p] if p >= 0 else 0.0
        for d, q in deps:
            v = end[d] + lag[q]
            if v > t:  # noqa: PLR1730 (hot loop: cheaper than max())
                t = v
        if starts is not None:
            starts[x] = t
        end[x] = t + dur[x]
    return end


def backward(cx: LevelCuts, dur: list[float], lag: list[float], sink: list[float]) -> list[float]:
    """[n] the longest time from the end of every row to the iteration's end, one column: over the
    device's next action and the data successors (their lag, then their duration and time to the
    end), and ``sink[s]`` after the last action of device ``s``; the rows in reverse level order."""
    out = [0.0] * cx.n
    through = [0.0] * cx.n  # duration + time to the end, from a row's start
    for x in range(cx.n - 1, -1, -1):
        y, s = cx.next[x], cx.sink[x]
        t = through[y] if y >= 0 else -np.inf
        if s >= 0 and sink[s] > t:
            t = sink[s]
        for y, q in cx.succ[x]:
            v = lag[q] + through[y]
            if v > t:  # noqa: PLR1730 (hot loop: cheaper than max())
                t = v
        out[x] = t
        through[x] = t + dur[x]
    return out
