"""Exact iteration time when one micro-batch's stage times change, without re-timing the schedule.

The policies ask many questions of the form "what would replica r's finish be if micro-batch j ran
at budget k": ``dst-cp`` asks it for every micro-batch of the critical replicas in every round and
for every larger budget of every micro-batch when spending bubbles. Re-timing the whole schedule
per question costs O(actions); this module answers each in O(window) after one O(actions) pass.

**Why it is exact.** Let ``a = F(0, j)`` and ``z = B(0, j)``: every action of micro-batch j (the set
S) is a descendant of ``a`` and an ancestor of ``z`` (the F chain up the stages, then the B chain
down). The *window* ``W = desc(a) ∩ anc(z)`` holds every path between actions of S; it is convex
(a path leaving it never returns). Every other node is in ``A = anc(z) \\ W`` (before, its longest
path from the start cannot cross W), ``D = desc(a) \\ W`` (after, its longest path to the end cannot
cross W) or ``N`` (neither). So with new durations on S:

* paths that avoid W keep their lengths: the longest is the max of ``end + to_sink`` over N, of
  ``end(x) + lag + duration(y) + to_sink(y)`` over edges from A to D, of A's sink edges and D's
  source edges, all read off the current times;
* paths that touch W enter and leave it once: re-time only W (its outside predecessors keep their
  end times), then add the best exit (an edge to D, or the sink).

The finish is the larger of the two. Sizes: the window of 1F1B is about pp^2 + 2 pp actions (20 at
PP 4 whatever m), so a question costs a few numpy operations per window position across all
questions at once. Values equal a full re-timing up to the rounding of a differently associated
sum (a few ulps). Schedules that split the backward (F, I, W) are handled the same way with
``z = I(0, j)``: the questions change only F and I (the budget moves attention, which is all input
gradient; W keeps its seconds), and those lie in the window; W nodes keep their durations.
"""

from __future__ import annotations

import functools

import numpy as np

from sparsebalance.simulator.graph import ActionGraph
from sparsebalance.simulator.timing import retime_column, time_graph, time_to_sink

SMALL_GRAPH = 64
"""Up to this many actions per replica, :meth:`ReplicaTimes.finish_if` re-times the whole schedule
for every question (one batched pass is cheaper than the window bookkeeping at this size)."""


def _bit_rows(bitsets: list[int], n: int) -> np.ndarray:
    """Python-int bitsets -> bool matrix [len, n] (bit i of row r = node i), in one unpack."""
    size = (n + 7) // 8
    raw = np.frombuffer(b"".join(x.to_bytes(size, "little") for x in bitsets), dtype=np.uint8)
    return np.unpackbits(raw.reshape(len(bitsets), size), axis=1, bitorder="little")[:, :n].astype(bool)


def _split_pad(rows: np.ndarray, values: np.ndarray, m: int, fill: int) -> np.ndarray:
    """Values grouped by row (``rows`` ascending) -> [m, widest group] padded with ``fill``."""
    counts = np.bincount(rows, minlength=m)
    out = np.full((m, max(1, int(counts.max()) if counts.size else 1)), fill, dtype=np.int64)
    col = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    out[rows, col] = values
    return out


class Windows:
    """Per micro-batch index arrays of the decomposition (see the module docstring), padded to the
    largest window; built once per graph (:func:`windows_for`)."""

    def __init__(self, graph: ActionGraph) -> None:
        if graph.kinds not in (("F", "B"), ("F", "I", "W")):
            raise ValueError("windows: only F/B and F/I/W schedules")
        g, n, m, nv = graph, graph.n, graph.m, graph.nv
        self.graph = g
        order = np.concatenate(g.levels)
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        src = np.concatenate([g.prev[g.prev < n], g.deps[g.deps < n]])
        dst = np.concatenate([np.flatnonzero(g.prev < n), np.nonzero(g.deps < n)[0]])
        elag = np.concatenate([np.full(int((g.prev < n).sum()), g.zero_lag), g.lags[g.deps < n]])
        succ: list[list[int]] = [[] for _ in range(n)]
        pred: list[list[int]] = [[] for _ in range(n)]
        for x, y in zip(src.tolist(), dst.tolist()):
            succ[x].append(y)
            pred[y].append(x)
        desc, anc = [0] * n, [0] * n
        for x in reversed(order.tolist()):
            b = 1 << x
            for y in succ[x]:
                b |= desc[y]
            desc[x] = b
        for x in order.tolist():
            b = 1 << x
            for p in pred[x]:
                b |= anc[p]
            anc[x] = b
        dev_pos = np.empty(n, dtype=np.int64)
        for o in g.orders:
            dev_pos[o] = np.arange(len(o))
        sink_stage = np.full(n, -1, dtype=np.int64)
        sink_stage[g.last] = np.arange(g.pp)
        source = (g.prev == n) | (g.deps == n).any(axis=1)
        # [m, n] bool matrices: descendants of F(0, j), ancestors of B(0, j), for every j at once
        da = _bit_rows([desc[j] for j in range(m)], n)
        az = _bit_rows([anc[nv * m + j] for j in range(m)], n)
        in_w = da & az
        a_only, d_only = az & ~da, da & ~az
        rows_w, nodes_w = np.nonzero(in_w)  # row-major: nodes ascending within each j
        o = np.lexsort((rank[nodes_w], rows_w))  # topological order within each window
        self.win = _split_pad(rows_w[o], nodes_w[o], m, n)  # [m, Wmax] (n = padding)
        self.nset = _split_pad(*np.nonzero(~(da | az)), m, n)
        cross = a_only[:, src] & d_only[:, dst]  # [m, E] edges from A to D
        cr, ce = np.nonzero(cross)
        self.cx, self.cy = _split_pad(cr, src[ce], m, n), _split_pad(cr, dst[ce], m, n)
        self.cl = _split_pad(cr, elag[ce], m, g.zero_lag)
        self.asink = _split_pad(*np.nonzero(a_only & (sink_stage >= 0)), m, n)
        # of D's source nodes on one device the first reaches the others (the device runs them in
        # order), so its path from the start is the longest: keep one per (j, device)
        firsts_r, firsts_n = [], []
        for s_dev in range(g.pp):
            cols = np.flatnonzero(source & (g.device == s_dev))
            cols = cols[np.argsort(dev_pos[cols])]
            if cols.size:
                sub = d_only[:, cols]
                has = sub.any(axis=1)
                firsts_r.append(np.flatnonzero(has))
                firsts_n.append(cols[sub.argmax(axis=1)[has]])
        fr, fn = np.concatenate(firsts_r), np.concatenate(firsts_n)
        o = np.argsort(fr, kind="stable")
        self.dsrc = _split_pad(fr[o], fn[o], m, n)
        self.sink_stage = np.append(sink_stage, -1)
        wmax = self.win.shape[1]
        # position of each node in each window (-1 outside), with a padding column for node n
        pos = np.full((m, n + 1), -1, dtype=np.int64)
        jj = np.repeat(np.arange(m), wmax)
        ww = self.win.ravel()
        pos[jj[ww < n], ww[ww < n]] = np.tile(np.arange(wmax), m)[ww < n]
        # predecessors of each window position: local position in the window, or a global node
        prev_all = np.append(g.prev, n)
        dep_all = np.append(g.deps[:, 0], n)
        lag_all = np.append(g.lags[:, 0], g.zero_lag)
        self.pred_global = np.stack([prev_all[self.win], dep_all[self.win]], axis=2)  # [m, W, 2]
        self.pred_lag = np.stack([np.full(self.win.shape, g.zero_lag), lag_all[self.win]], axis=2)
        self.pred_local = np.take_along_axis(pos, self.pred_global.reshape(m, -1), axis=1).reshape(
            self.pred_global.shape)
        # outside successors of each window position (edges into D) for the exit value
        counts = np.bincount(src, minlength=n)
        width = max(1, int(counts.max()) if counts.size else 1)
        so = np.argsort(src, kind="stable")
        slot = np.arange(len(src)) - np.repeat(np.cumsum(counts) - counts, counts)
        succ_pad = np.full((n + 1, width), n, dtype=np.int64)
        succ_lag_pad = np.full((n + 1, width), g.zero_lag, dtype=np.int64)
        succ_pad[src[so], slot] = dst[so]
        succ_lag_pad[src[so], slot] = elag[so]
        exit_node = succ_pad[self.win]  # [m, W, width]
        inside = np.take_along_axis(pos, exit_node.reshape(m, -1), axis=1).reshape(exit_node.shape) >= 0
        self.exit_node = np.where(inside, n, exit_node)
        self.exit_lag = np.where(inside, g.zero_lag, succ_lag_pad[self.win])
        # which window positions are micro-batch j's own actions: index into [F(0..V-1), B(0..V-1)]
        # (B or I; a W keeps its seconds)
        kind, rest = np.divmod(self.win, nv * m)
        vs, mb = np.divmod(rest, m)
        own = (self.win < n) & (mb == np.arange(m)[:, None]) & (kind < 2)
        self.own = np.where(own, kind * nv + vs, -1)


@functools.lru_cache(maxsize=16)
def windows_for(graph: ActionGraph) -> Windows:
    """The (cached) windows of ``graph``."""
    return Windows(graph)


class ReplicaTimes:
    """The current times of replicas under one graph, and exact answers to "finish of replica r
    if micro-batch j had these stage times" (:meth:`finish_if`). ``duration`` [n, R] (node order),
    ``lag`` [(V-1) m + 1, R], ``sink`` [pp] seconds after each stage's last action."""

    def __init__(self, graph: ActionGraph, duration: np.ndarray, lag: np.ndarray, sink: np.ndarray) -> None:
        self.graph, self.win = graph, windows_for(graph)
        self.duration, self.lag = np.array(duration, dtype=float), np.asarray(lag, dtype=float)
        self.sink = np.asarray(sink, dtype=float)
        n, r = self.duration.shape
        self.end = np.zeros((n + 1, r))
        self.to_sink = np.full((n + 1, r), -np.inf)
        self.refresh(range(r))

    def refresh(self, replicas) -> None:
        """Re-time ``replicas`` after their durations changed (one O(actions) pass each way)."""
        cols = list(replicas)
        if not cols:
            return
        d, lg = self.duration[:, cols], self.lag[:, cols]
        _, end = time_graph(self.graph, d, lg, starts=False)
        self.end[:-1, cols] = end
        self.to_sink[:-1, cols] = time_to_sink(self.graph, d, lg, self.sink)

    def update(self, replica: int, microbatch: int) -> None:
        """Re-time ``replica`` after only ``microbatch``'s durations changed (its window and what
        follows it forward, what precedes it backward)."""
        g, m = self.graph, self.graph.m
        retime_column(g, self.duration[:, replica], self.lag[:, replica], self.sink,
                      self.end[:, replica], self.to_sink[:, replica], microbatch, g.nv * m + microbatch)

    def finish(self) -> np.ndarray:
        """[R] each replica's finish (last action's end + its stage's sink time, max over stages)."""
        g = self.graph
        return (self.end[g.last] + self.sink[:, None]).max(axis=0)

    def finish_if(self, r: np.ndarray, j: np.ndarray, new: np.ndarray) -> np.ndarray:
        """[C] finish of replica ``r[c]`` if micro-batch ``j[c]`` took durations ``new[c]``
        ([C, 2V]: F of vstages 0..V-1, then B). Exact (module docstring)."""
        w, n = self.win, self.graph.n
        r, j = np.asarray(r, dtype=np.int64), np.asarray(j, dtype=np.int64)
        c = len(r)
        if n <= SMALL_GRAPH:  # a full re-timing of every question at once costs less here
            g, nv, m = self.graph, self.graph.nv, self.graph.m
            own_nodes = np.concatenate([np.arange(nv) * m, nv * m + np.arange(nv) * m])[None, :] + j[:, None]
            d = self.duration[:, r]  # [n, C]
            d[own_nodes.T, np.arange(c)[None, :]] = new.T
            _, end = time_graph(g, d, self.lag[:, r], starts=False)
            return (end[g.last] + self.sink[:, None]).max(axis=0)
        end, tos, lag, dur = self.end, self.to_sink, self.lag, self.duration
        dur_ext = np.vstack([dur, np.zeros((1, dur.shape[1]))])
        thr = tos + dur_ext  # duration + time to the end, from a node's start
        best = np.full(c, -np.inf)
        rc = r[:, None]
        for idx in (w.nset[j],):  # paths through N
            best = np.maximum(best, (end[idx, rc] + tos[idx, rc]).max(axis=1))
        cx, cy, cl = w.cx[j], w.cy[j], w.cl[j]
        best = np.maximum(best, (end[cx, rc] + lag[cl, rc] + thr[cy, rc]).max(axis=1))
        a = w.asink[j]
        stage = w.sink_stage[a]
        best = np.maximum(best, np.where(stage >= 0, end[a, rc] + self.sink[stage], -np.inf).max(axis=1))
        best = np.maximum(best, thr[w.dsrc[j], rc].max(axis=1))
        win, own = w.win[j], w.own[j]  # [C, W]
        pg, pl, plag = w.pred_global[j], w.pred_local[j], w.pred_lag[j]
        r3 = r[:, None, None]
        exit_v = np.where(w.sink_stage[win] >= 0, self.sink[w.sink_stage[win]], -np.inf)
        exit_v = np.maximum(exit_v, (lag[w.exit_lag[j], r3] + thr[w.exit_node[j], r3]).max(axis=2))
        lag_in = lag[plag, r3]  # [C, W, 2] lag of each predecessor edge
        outside = end[pg, r3] + lag_in  # predecessors outside the window: their times stand
        is_local = pl >= 0
        any_local = is_local.any(axis=0)  # [W, 2]
        dur_new = np.where(own >= 0, np.take_along_axis(new, np.maximum(own, 0), axis=1),
                           dur_ext[win, r[:, None]])
        local = np.zeros((c, win.shape[1]))
        rows = np.arange(c)
        for p in range(win.shape[1]):
            t = None
            for q in range(2):
                v = outside[:, p, q]
                if any_local[p, q]:
                    li = pl[:, p, q]
                    v = np.where(is_local[:, p, q], local[rows, np.maximum(li, 0)] + lag_in[:, p, q], v)
                t = v if t is None else np.maximum(t, v)
            local[:, p] = t + dur_new[:, p]
        through = np.where(win < n, local + exit_v, -np.inf).max(axis=1)
        return np.maximum(best, through)
