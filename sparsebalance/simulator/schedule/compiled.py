"""The timing core's recurrence compiled (numba), for wide calls: many columns of a long graph.

Why: a policy's order search prices a few hundred candidate orders of one replica in one call
(``sab-order`` at global batch 4,096: 396 candidates x 3,272 nodes of a 1F1B graph with 824
levels). The numpy levels of :func:`.timing.time_graph` pay a dozen numpy calls per level on
arrays of only [4 nodes, 396 columns], so fixed costs and gathers dominate (20-30 ms per call on
the project's VM); the same loop compiled runs the nodes in level order with the columns innermost
and contiguous, about 8x faster.

**Same numbers, bit for bit.** Every node's end is ``max(end of its device predecessor, end of
each data predecessor + its lag) + duration``, the same floats combined in the same order as the
numpy levels (a sentinel predecessor ends at 0 s and the zero lag is 0, which cannot raise a
non-negative maximum); ``tests/simulator/schedule/test_timing.py`` holds the paths equal on every schedule.

**When** (:mod:`sparsebalance.jit`): only once a large policy decision has loaded the compiled
loops, and then for calls of :data:`MIN_WORK` updates or more; otherwise, and where numba is
missing, the numpy levels and plain loops run: same results, slower.
"""

from __future__ import annotations

import functools

import numpy as np

from sparsebalance import jit

MIN_WORK = 1 << 12
"""Node x column updates from which a call takes the compiled path once it is loaded (a few
candidates of a long graph: sab-order's seed orders, 8 x 3,272, or dst-cp's two replicas)."""


@jit.compiled
def _run(order, prev, deps, lags, duration, lag, by_order, table, node_vs, node_j, tables, p2p, cols, m, zero_lag,
         n, with_starts):  # pragma: no cover (compiled)
    """The recurrence over the nodes in level order, the columns innermost. Durations and lags are
    ``duration`` [n, C] and ``lag`` [lag ids, C]; or, ``by_order``, read through each candidate's
    order: node i of candidate c lasts ``tables[table[i], node_vs[i], cols[node_j[i], c]]`` and lag
    id q < zero_lag is the P2P of the micro-batch in position q mod m (``cols`` [m, C])."""
    c = cols.shape[1] if by_order else duration.shape[1]
    end = np.zeros((n + 1, c))
    start = np.empty((n if with_starts else 0, c))
    width = deps.shape[1]
    lagrow = np.empty(c)
    durrow = np.empty(c)
    for x in range(order.shape[0]):
        i = order[x]
        row = end[i]
        src = end[prev[i]]
        for k in range(c):
            row[k] = src[k]
        for q in range(width):  # a sentinel predecessor (end 0) with the zero lag raises nothing
            src = end[deps[i, q]]
            lid = lags[i, q]
            if not by_order:
                lg = lag[lid]
            else:
                if lid == zero_lag:
                    for k in range(c):
                        lagrow[k] = 0.0
                else:
                    pos = cols[lid % m]
                    for k in range(c):
                        lagrow[k] = p2p[pos[k]]
                lg = lagrow
            for k in range(c):
                row[k] = max(row[k], src[k] + lg[k])
        if with_starts:
            st = start[i]
            for k in range(c):
                st[k] = row[k]
        if by_order:
            tab = tables[table[i], node_vs[i]]
            pos = cols[node_j[i]]
            for k in range(c):
                durrow[k] = tab[pos[k]]
            du = durrow
        else:
            du = duration[i]
        for k in range(c):
            row[k] = row[k] + du[k]
    return start, end


_NO_F1, _NO_I1 = np.zeros(0), np.zeros(0, dtype=np.int64)
_NO_F2, _NO_I2, _NO_F3 = np.zeros((0, 0)), np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0, 0))


@jit.compiled
def _run_sink(order, nxt, succ, succ_lag, last, sink, duration, lag, n):  # pragma: no cover (compiled)
    """:func:`.timing.time_to_sink`'s recurrence, the levels last first (nodes of one level are
    independent, so any order inside a level gives the same numbers)."""
    c = duration.shape[1]
    out = np.full((n + 1, c), -np.inf)
    for s in range(last.shape[0]):
        out[last[s]] = sink[s]
    through = np.full((n + 1, c), -np.inf)
    width = succ.shape[1]
    for x in range(order.shape[0] - 1, -1, -1):
        i = order[x]
        row = out[i]
        src = through[nxt[i]]
        for k in range(c):
            row[k] = max(row[k], src[k])
        for q in range(width):
            src = through[succ[i, q]]
            lg = lag[succ_lag[i, q]]
            for k in range(c):
                v = lg[k] + src[k]
                row[k] = max(row[k], v)
        th = through[i]
        du = duration[i]
        for k in range(c):
            th[k] = row[k] + du[k]
    return out


def to_sink_compiled(graph, nxt, succ, succ_lag, duration, lag, sink) -> np.ndarray:
    """:func:`.timing.time_to_sink` compiled: [n, C]."""
    out = _run_sink.get()(_order(graph), nxt, succ, succ_lag, np.ascontiguousarray(graph.last),
                          np.ascontiguousarray(sink, dtype=np.float64),
                          np.ascontiguousarray(duration, dtype=np.float64),
                          np.ascontiguousarray(lag, dtype=np.float64), graph.n)
    return out[:graph.n]


@functools.lru_cache(maxsize=64)
def _node_tables(graph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node: which of ``[F, B, I, W, zero]`` tables its duration comes from (the split graph's
    fused positions read the whole backward for I and nothing for W, as ``timing.kind_durations``),
    its vstage and its position."""
    size = graph.nv * graph.m
    kind = np.repeat(np.arange(len(graph.kinds)), size)
    vs = np.tile(np.repeat(np.arange(graph.nv), graph.m), len(graph.kinds))
    j = np.tile(np.arange(graph.m), len(graph.kinds) * graph.nv)
    names = np.array(graph.kinds)[kind]
    fused = np.tile(graph.fused.reshape(-1), len(graph.kinds))
    table = np.select([names == "F", names == "B", (names == "I") & fused, names == "I", fused],
                      [0, 1, 1, 2, 4], default=3)
    return table.astype(np.int64), vs.astype(np.int64), j.astype(np.int64)


def order_finish_compiled(graph, orders: np.ndarray, fwd, bwd, p2p, bwd_input=None, bwd_weight=None) -> np.ndarray:
    """:func:`.timing.order_finish` compiled: [C, pp] ends of each device's last action for C
    orders of one replica's micro-batches, durations read through the orders inside the loop (no
    [n, C] copies)."""
    fwd = np.asarray(fwd, dtype=np.float64)
    zero = np.zeros_like(fwd)
    tables = np.stack([fwd, np.asarray(bwd, dtype=np.float64),
                       zero if bwd_input is None else np.asarray(bwd_input, dtype=np.float64),
                       zero if bwd_weight is None else np.asarray(bwd_weight, dtype=np.float64), zero])
    table, vs, j = _node_tables(graph)
    cols = np.ascontiguousarray(np.asarray(orders, dtype=np.int64).T)
    _, end = _run.get()(*_graph_arrays(graph), _NO_F2, _NO_F2, True, table, vs, j, tables,
                        np.ascontiguousarray(p2p, dtype=np.float64), cols, graph.m, graph.zero_lag, graph.n, False)
    return end[graph.last].T


def worth(work: int) -> bool:
    """Whether a call of ``work`` node x column updates takes the compiled path: once a large
    decision has loaded it (:func:`sparsebalance.jit.warm`), from :data:`MIN_WORK` on."""
    return work >= MIN_WORK and jit.loaded()


@functools.lru_cache(maxsize=64)
def _order(graph) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate(graph.levels)) if graph.levels else np.zeros(0, np.int64)


def time_compiled(graph, duration: np.ndarray, lag: np.ndarray, starts: bool):
    """:func:`.timing.time_graph` compiled: (start or None, end), each [n, C]."""
    n = graph.n
    start, end = _run.get()(*_graph_arrays(graph), np.ascontiguousarray(duration, dtype=np.float64),
                            np.ascontiguousarray(lag, dtype=np.float64), False, _NO_I1, _NO_I1, _NO_I1, _NO_F3,
                            _NO_F1, _NO_I2, 1, 0, n, starts)
    return (start if starts else None), end[:n]


def _graph_arrays(graph) -> tuple[np.ndarray, ...]:
    """(nodes in level order, device predecessor, data predecessors, their lag ids): the recurrence's graph."""
    return (_order(graph), np.ascontiguousarray(graph.prev), np.ascontiguousarray(graph.deps),
            np.ascontiguousarray(graph.lags))
