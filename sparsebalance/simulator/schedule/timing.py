"""The exact timing core: start and end of every action of a schedule, vectorised over its levels.

The model is the SimPy engine's (:mod:`.events`, its independent check, equal in tests): an
action starts when its device is free and its inputs have arrived, ``start = max(end of the
device's previous action, end of each data predecessor + its P2P lag)``, ``end = start + duration``;
then per physical stage the gradient all-reduce starts when every replica's copy of the stage has
ended its last action, followed by the optimizer step. Without contention or faults this is a
longest-path (max-plus) recurrence over the schedule's DAG (:mod:`.graph`), so it is computed
directly instead of by events.

**How.** The nodes of one topological level are independent: the core visits the levels in order
and handles each with a few numpy gathers, a max and an add over ``[nodes in level, columns]``.
Columns are replicas (every replica of a PP x DP iteration runs the same graph) and, for the
policies, candidate duration sets: one call prices many candidates. Cost: O(levels) numpy calls,
about 2 (m + V) levels for GPipe / 1F1B whatever the number of replicas, plus O(actions x columns)
arithmetic. Why numpy and not a compiled loop (numba): the Python overhead is per level, not per
action, so a 65,536-action iteration is a few hundred numpy calls; numba would add an LLVM
dependency and about a second of JIT per process, which is more than a whole ``pipeline`` call or
a policy decision takes here.

Arithmetic is the same as the former closed-form evaluator of ``policies/critical.py``
(``max(prev, dep + lag) + duration``), so its values are bitwise those the policies used.

**Narrow graphs.** With few columns and few nodes per level (one replica of a long pipeline: 4
nodes per level at PP 4) numpy's fixed cost per call dominates; there the same recurrence runs as
a plain loop over the nodes in level order, column by column (about 12x faster at one column, the
same values bit for bit: ``max`` and ``+`` of the same floats in the same order). The plain loops,
forward and backward, are written once, over the graph's level cuts (:func:`.levelcuts.forward`,
:func:`.levelcuts.backward`), and the what-ifs of :mod:`.perturb` run the same ones.
"""

from __future__ import annotations

import functools

import numpy as np

from sparsebalance.simulator.schedule import compiled
from sparsebalance.simulator.schedule.graph import ActionGraph
from sparsebalance.simulator.schedule.levelcuts import backward, forward, level_cuts


def time_graph(graph: ActionGraph, duration: np.ndarray, lag: np.ndarray | None = None,
               *, starts: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
    """Start and end of every node, seconds, each ``[n, C]``.

    ``duration``: ``[n, C]`` seconds per node (node order of ``graph``) and column. ``lag``:
    ``[(V - 1) m + 1, C]`` P2P seconds per lag id (the last row, the zero lag, must be 0) or None
    (no P2P). ``starts=False`` skips the start array (returns None for it)."""
    n = graph.n
    c = duration.shape[1]
    if lag is None:
        lag = np.zeros((graph.zero_lag + 1, c))
    if compiled.worth(n * c):
        return compiled.time_compiled(graph, duration, lag, starts)
    if _narrow(graph, c) and _rows_paid(graph):
        return _time_scalar(graph, duration, lag, starts)
    end = np.zeros((n + 1, c))
    start = np.empty((n, c)) if starts else None
    for step in graph.steps:
        idx, prv = step[0], step[1]
        t = end[prv]
        for q in range(2, len(step), 2):
            np.maximum(t, end[step[q]] + lag[step[q + 1]], out=t)
        if start is not None:
            start[idx] = t
        end[idx] = t + duration[idx]
    return start, end[:n]


def _narrow(graph: ActionGraph, columns: int) -> bool:
    """Plain loops beat numpy for a few columns of a graph with few nodes per level."""
    return columns * graph.n < 48 * len(graph.levels)


@functools.lru_cache(maxsize=64)
def _narrow_calls(graph: ActionGraph) -> list[int]:
    return [0]


def _rows_paid(graph: ActionGraph) -> bool:
    """Whether the plain loops' rows of ``graph`` (its level cuts, :mod:`.levelcuts`) are, or are
    now worth, built: from its second narrow call on. Building them costs 10-25 ms at ~3,000 nodes,
    several narrow calls' worth, so a graph timed narrow once (sab-order's seeds at a micro-batch
    count not seen before) takes the numpy levels instead. Both give the same numbers bit for bit."""
    calls = _narrow_calls(graph)
    calls[0] += 1
    return calls[0] > 1


def _time_scalar(graph: ActionGraph, duration: np.ndarray, lag: np.ndarray,
                 starts: bool) -> tuple[np.ndarray | None, np.ndarray]:
    """:func:`time_graph` column by column with the plain loop (:func:`.levelcuts.forward`)."""
    cx = level_cuts(graph)
    n, c = graph.n, duration.shape[1]
    end_out = np.empty((n, c))
    start_out = np.empty((n, c)) if starts else None
    for col in range(c):
        st = [0.0] * n if start_out is not None else None
        end_out[cx.node, col] = forward(cx, duration[cx.node, col].tolist(), lag[:, col].tolist(), st)
        if start_out is not None:
            start_out[cx.node, col] = st
    return start_out, end_out


def stage_finish(graph: ActionGraph, duration: np.ndarray, lag: np.ndarray | None = None) -> np.ndarray:
    """[pp, C] end of each physical stage's last action (the all-reduce may start after it)."""
    _, end = time_graph(graph, duration, lag, starts=False)
    return end[graph.last]


def pack_durations(graph: ActionGraph, per_kind: dict[str, np.ndarray]) -> np.ndarray:
    """``{kind: [C, V, m] seconds}`` -> the core's ``[n, C]`` duration array (node order)."""
    parts = []
    for k in graph.kinds:
        a = np.asarray(per_kind[k], dtype=float)
        parts.append(a.reshape(a.shape[0], -1))
    return np.concatenate(parts, axis=1).T.copy()


def kind_durations(graph: ActionGraph, fwd, bwd, bwd_input=None, bwd_weight=None) -> dict[str, np.ndarray]:
    """Per-kind seconds ``[C, V, m]`` of ``graph``'s nodes: F and B; for a split graph I and W
    (``bwd_input``, ``bwd_weight``, required), where a fused node I takes the whole backward ``bwd``
    and its placeholder W takes 0 s (see :mod:`.graph`)."""
    if not graph.split:
        return {"F": fwd, "B": bwd}
    if bwd_input is None or bwd_weight is None:
        raise ValueError("a split-backward schedule needs the input- and weight-gradient seconds")
    fused = graph.fused
    return {"F": fwd, "I": np.where(fused, bwd, bwd_input), "W": np.where(fused, 0.0, bwd_weight)}


def pack_lags(graph: ActionGraph, p2p: np.ndarray, columns: int) -> np.ndarray:
    """P2P seconds broadcastable to ``[C, V - 1, m]`` -> the core's ``[(V - 1) m + 1, C]`` lag array."""
    out = np.zeros((graph.zero_lag + 1, columns))
    if graph.nv > 1:
        p = np.broadcast_to(np.asarray(p2p, dtype=float), (columns, graph.nv - 1, graph.m))
        out[:-1] = p.reshape(columns, -1).T
    return out


def replica_finish(graph: ActionGraph, fwd: np.ndarray, bwd: np.ndarray, p2p, bwd_input=None,
                   bwd_weight=None) -> np.ndarray:
    """[C, pp] end of each device's last action for C replicas (or candidates); ``fwd``, ``bwd``
    (and for a split graph ``bwd_input``, ``bwd_weight``): [C, V, m] seconds, ``p2p``:
    broadcastable to [C, V - 1, m]."""
    fwd = np.asarray(fwd, dtype=float)
    dur = pack_durations(graph, kind_durations(graph, fwd, bwd, bwd_input, bwd_weight))
    return stage_finish(graph, dur, pack_lags(graph, p2p, fwd.shape[0])).T


def order_finish(graph: ActionGraph, orders: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray,
                 bwd_input: np.ndarray | None = None, bwd_weight: np.ndarray | None = None) -> np.ndarray:
    """[C, pp] :func:`replica_finish` of C orders of one replica's micro-batches: ``orders`` [C, m]
    (indices into the columns of ``fwd``, ``bwd`` (and for a split graph ``bwd_input``,
    ``bwd_weight``): [V, m] seconds; ``p2p`` [m]). The durations are gathered straight into the
    core's [n, C] layout (one take per kind, no per-candidate copies): the same numbers as
    ``replica_finish`` on ``fwd[:, orders].transpose(1, 0, 2)``..., so the same result bit for bit.
    Wide calls (a policy's few hundred candidates) run compiled, reading each candidate's durations
    through its order inside the loop (:func:`.compiled.order_finish_compiled`; same numbers)."""
    orders = np.asarray(orders, dtype=np.int64)
    c, m, nv = orders.shape[0], graph.m, graph.nv
    if graph.split and (bwd_input is None or bwd_weight is None):
        raise ValueError("a split-backward schedule needs the input- and weight-gradient seconds")
    if compiled.worth(graph.n * c):
        return compiled.order_finish_compiled(graph, orders, fwd, bwd, p2p, bwd_input, bwd_weight)
    cols = orders.T  # [m, C]: node (kind, vs, j) of candidate c takes column orders[c, j]
    per_kind = {"F": fwd, "B": bwd}
    if graph.split:
        assert bwd_input is not None and bwd_weight is not None  # checked above
        fused = graph.fused[:, :, None]  # by position, as kind_durations
        per_kind = {"F": fwd, "I": np.where(fused, np.take(bwd, cols, axis=1), np.take(bwd_input, cols, axis=1)),
                    "W": np.where(fused, 0.0, np.take(bwd_weight, cols, axis=1))}
    dur = np.empty((graph.n, c))
    for i, k in enumerate(graph.kinds):
        block = dur[i * nv * m:(i + 1) * nv * m].reshape(nv, m, c)
        a = per_kind[k]
        block[...] = a if a.ndim == 3 else np.take(np.asarray(a, dtype=float), cols, axis=1)
    lag = np.zeros((graph.zero_lag + 1, c))
    if nv > 1:
        lag[:-1].reshape(nv - 1, m, c)[...] = np.take(np.asarray(p2p, dtype=float), cols)[None]
    return stage_finish(graph, dur, lag).T


@functools.lru_cache(maxsize=64)
def _successors(graph: ActionGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The successor view of the graph: device successor ``nxt`` [n + 1] (the sentinel where
    none), data successors ``succ`` [n, D'] (sentinel-padded) and their lag ids [n, D']."""
    n = graph.n
    nxt = np.full(n + 1, n, dtype=np.int64)
    nxt[graph.prev[graph.prev < n]] = np.flatnonzero(graph.prev < n)
    recv, col = np.nonzero(graph.deps < n)
    send = graph.deps[recv, col]
    o = np.argsort(send, kind="stable")
    send, recv, lag = send[o], recv[o], graph.lags[recv[o], col[o]]
    counts = np.bincount(send, minlength=n)
    width = max(1, int(counts.max()) if counts.size else 1)
    succ = np.full((n, width), n, dtype=np.int64)
    succ_lag = np.full((n, width), graph.zero_lag, dtype=np.int64)
    slot = np.arange(len(send)) - np.repeat(np.cumsum(counts) - counts, counts)
    succ[send, slot], succ_lag[send, slot] = recv, lag
    return nxt, succ, succ_lag


@functools.lru_cache(maxsize=64)
def _reverse_steps(graph: ActionGraph) -> tuple[tuple[np.ndarray, ...], ...]:
    """Per level, last level first: (nodes, device successors, data successors [k, D'], their lag
    ids [k, D']) - the successor view of the graph for :func:`time_to_sink`."""
    nxt, succ, succ_lag = _successors(graph)
    return tuple((idx, nxt[idx], succ[idx], succ_lag[idx]) for idx in reversed(graph.levels))


def time_to_sink(graph: ActionGraph, duration: np.ndarray, lag: np.ndarray | None, sink: np.ndarray) -> np.ndarray:
    """[n, C] longest time from each node's end to the iteration's end: over its successors
    (device next and data successors, plus their lags and durations), and ``sink[s]`` after the
    last action of device ``s`` (all-reduce + optimizer). ``start + duration + this`` is the
    length of the longest path through a node (= the iteration time on a critical node)."""
    n = graph.n
    c = duration.shape[1]
    if lag is None:
        lag = np.zeros((graph.zero_lag + 1, c))
    sink = np.broadcast_to(np.asarray(sink, dtype=float), (graph.pp,))
    if compiled.worth(n * c):
        return compiled.to_sink_compiled(graph, *_successors(graph), duration, lag, sink)
    if _narrow(graph, c) and _rows_paid(graph):
        cx = level_cuts(graph)
        res = np.empty((n, c))
        sk = sink.tolist()
        for col in range(c):
            res[cx.node, col] = backward(cx, duration[cx.node, col].tolist(), lag[:, col].tolist(), sk)
        return res
    out = np.full((n + 1, c), -np.inf)
    out[graph.last] = np.broadcast_to(sink[:, None], (graph.pp, c))
    through = np.full((n + 1, c), -np.inf)  # duration + time to sink, from a node's start
    for idx, nxt, succ, slag in _reverse_steps(graph):
        t = np.maximum(out[idx], through[nxt])
        for q in range(succ.shape[1]):
            np.maximum(t, lag[slag[:, q]] + through[succ[:, q]], out=t)
        out[idx] = t
        through[idx] = t + duration[idx]
    return out[:n]
