"""Exact iteration time when one micro-batch's stage times change, without re-timing the schedule.

The policies ask many questions of the form "what would replica r's finish be if micro-batch j ran
at budget k": ``dst-cp`` asks them in every round of lowering and when spending bubbles. Re-timing
the whole schedule per question costs O(actions); :class:`ReplicaTimes` keeps every action's end
and time to the end of the iteration, and answers each question, and applies each move, locally.

**A question** (:meth:`ReplicaTimes.finish_if`). Micro-batch j's actions lie between levels
``a`` and ``b`` of the graph (:mod:`.levelcuts`; for 1F1B about 2 pp levels, 4 pp^2 actions). Only
rows of those levels can end at another time before cut ``b + 1``; they are re-timed with the
new durations (their predecessors outside keep their ends), and the finish is the max over the
edges crossing cut ``b + 1`` of the source's new end + lag + the target's kept duration and time to
the end. Every path crosses that cut once, and after it nothing changed, so this is exact; it
costs O(rows of the levels a..b + crossing edges), about 40 actions at PP 4 whatever m.

**A move** (:meth:`ReplicaTimes.apply`, code in :mod:`.moves`). The same rows are re-timed forward, then level after level
until a cut where every crossing edge's source moved by the same amount: every later action then
moves by exactly that amount (each of its paths from the start crosses the cut), so the rest of
the kept ends is shifted with one slice operation. Times to the end are re-timed backward the same
way. In 1F1B a move typically settles within a few levels (the devices follow the slowest one).
A shift is accepted when the sources' moves agree to 32 ulps of the replica's finish, so kept
times may drift from a full re-timing by a few ulps per move; :meth:`refresh` re-times exactly.
When no settling cut is found near the window, the replica is re-timed exactly.

Values equal a full re-timing up to rounding (tests: 1e-12 relative, and bitwise after
:meth:`refresh`). Graphs up to :data:`SMALL_GRAPH` actions answer questions by re-timing the
whole schedule, all questions as columns of one numpy pass (cheaper than Python loops there).

Schedules that split the backward (F, I, W) are handled alike: a micro-batch's own actions are its
F and I (B where DualPipeV runs a backward whole); the budget moves attention, which is all input
gradient, so W keeps its seconds and lies outside the re-timed levels unless they hold it.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.simulator.schedule import compiled
from sparsebalance.simulator.schedule.graph import ActionGraph
from sparsebalance.simulator.schedule.levelcuts import backward, forward, level_cuts
from sparsebalance.simulator.schedule.moves import REACH, Moves  # noqa: F401 (REACH: re-exported)
from sparsebalance.simulator.schedule.timing import _narrow, time_graph, time_to_sink

SMALL_GRAPH = 64
"""Up to this many actions per replica, :meth:`ReplicaTimes.finish_if` re-times the whole schedule
for every question (one batched numpy pass beats per-question loops at this size)."""

class ReplicaTimes(Moves):
    """The current times of R replicas under one graph. ``duration`` [n, R] (node order), ``lag``
    [(V-1) m + 1, R], ``sink`` [pp] seconds after each stage's last action (all-reduce + optimizer).
    Internally rows are in level order (:mod:`.levelcuts`); :attr:`end`, :attr:`to_sink` and
    :attr:`duration` give node-order copies."""

    def __init__(self, graph: ActionGraph, duration: np.ndarray, lag: np.ndarray, sink: np.ndarray) -> None:
        self.graph, self.cuts = graph, level_cuts(graph)
        cx = self.cuts
        dur = np.asarray(duration, dtype=float)
        self.lag = np.asarray(lag, dtype=float)
        self.sink = np.asarray(sink, dtype=float)
        self._sink_l = self.sink.tolist()
        self._lag_l = self.lag.T.tolist()  # per replica, for the loops
        r = dur.shape[1]
        self.D = np.zeros((cx.n, r))  # row order
        self.D[:] = dur[cx.node]
        self.E = np.zeros((cx.n, r))  # end of each row
        self.S = np.zeros((cx.n, r))  # time from each row's end to the iteration's end
        self.refresh(range(r))

    # -- node-order views ----------------------------------------------------------------------
    @property
    def duration(self) -> np.ndarray:
        return self.D[self.cuts.row]

    @property
    def end(self) -> np.ndarray:
        return self.E[self.cuts.row]

    @property
    def to_sink(self) -> np.ndarray:
        return self.S[self.cuts.row]

    # -- exact re-timing -----------------------------------------------------------------------
    def refresh(self, replicas) -> None:
        """Re-time ``replicas`` exactly (the timing core's arithmetic, bitwise)."""
        cols = list(replicas)
        if not cols:
            return
        # the core's plain loops over rows (no per-graph rows to build), unless the core runs compiled
        if _narrow(self.graph, len(cols)) and not compiled.worth(self.graph.n * len(cols)):
            for r in cols:
                self.E[:, r] = self._forward_all(r)
                self.S[:, r] = self._backward_all(r)
            return
        row, node = self.cuts.row, self.cuts.node
        d, lg = self.D[row][:, cols], self.lag[:, cols]
        _, end = time_graph(self.graph, d, lg, starts=False)
        self.E[:, cols] = end[node]
        self.S[:, cols] = time_to_sink(self.graph, d, lg, self.sink)[node]

    def _forward_all(self, r: int) -> list[float]:
        return forward(self.cuts, self.D[:, r].tolist(), self._lag_l[r])

    def _backward_all(self, r: int) -> list[float]:
        return backward(self.cuts, self.D[:, r].tolist(), self._lag_l[r], self._sink_l)

    def finish(self) -> np.ndarray:
        """[R] each replica's finish (last action's end + its stage's sink time, max over stages)."""
        return (self.E[self.cuts.last_rows] + self.sink[:, None]).max(axis=0)

    def exact_finish(self, replicas) -> np.ndarray:
        """Finish of ``replicas`` from an exact forward re-timing (bitwise the timing core's)."""
        cols = list(replicas)
        last = self.cuts.last_rows
        if _narrow(self.graph, len(cols)) and not compiled.worth(self.graph.n * len(cols)):
            ends = np.array([self._forward_all(r) for r in cols]).T
            return (ends[last] + self.sink[:, None]).max(axis=0)
        g = self.graph
        _, end = time_graph(g, self.D[self.cuts.row][:, cols], self.lag[:, cols], starts=False)
        return (end[g.last] + self.sink[:, None]).max(axis=0)

    # -- per micro-batch reads -------------------------------------------------------------------
    def own_durations(self, r: int, js: np.ndarray) -> np.ndarray:
        """[C, 2 V] current durations of micro-batches ``js`` of replica ``r``."""
        return self.D[self.cuts.own[js], r]

    def own_through(self, r: int, js: np.ndarray) -> np.ndarray:
        """[C, 2 V] length of the longest path through each action of micro-batches ``js``
        (end + time to the end): the replica's finish on its critical actions."""
        rows = self.cuts.own[js]
        return self.E[rows, r] + self.S[rows, r]

    # -- questions -------------------------------------------------------------------------------
    def finish_if(self, r: np.ndarray, j: np.ndarray, new: np.ndarray) -> np.ndarray:
        """[C] finish of replica ``r[c]`` if micro-batch ``j[c]`` took durations ``new[c]``
        ([C, 2 V]: F of vstages 0..V-1, then B, or I where the backward is split). Exact (module docstring)."""
        r, j = np.asarray(r, dtype=np.int64), np.asarray(j, dtype=np.int64)
        new = np.asarray(new, dtype=float)
        if self.cuts.n <= SMALL_GRAPH:
            return self._finish_if_full(r, j, new)
        return np.array([self._question(int(a), int(b), row)
                         for a, b, row in zip(r.tolist(), j.tolist(), new.tolist())], dtype=float)

    def finish_one(self, r: int, j: int, new: np.ndarray) -> float:
        """:meth:`finish_if` of one question (``new`` [2 V]), without the arrays of a batch."""
        if self.cuts.n <= SMALL_GRAPH:
            return float(self._finish_if_full(np.array([r]), np.array([j]), np.asarray(new, dtype=float)[None])[0])
        return self._question(r, j, np.asarray(new, dtype=float).tolist())

    def _finish_if_full(self, r, j, new) -> np.ndarray:
        g, cx = self.graph, self.cuts
        c = len(r)
        d = self.D[cx.row][:, r]  # [n, C] node order
        nodes = cx.node[cx.own[j]]  # [C, 2 V]
        d[nodes.T, np.arange(c)[None, :]] = new.T
        _, end = time_graph(g, d, self.lag[:, r], starts=False)
        return (end[g.last] + self.sink[:, None]).max(axis=0)

    def _question(self, r: int, j: int, new: list) -> float:
        cx = self.cuts
        la, lb = cx.span[j]
        r0, r1 = cx.level_start[la], cx.level_start[lb + 1]
        lo = cx.pred_lo[la]
        vals = self.E[lo:r1, r].tolist()
        dur = self.D[r0:r1, r].tolist()
        for x, v in zip(cx.own[j].tolist(), new):
            dur[x - r0] = v
        lg = self._lag_l[r]
        prev, deps = cx.prev, cx.deps
        for x in range(r0, r1):
            p = prev[x]
            t = vals[p - lo] if p >= 0 else 0.0
            for d, q in deps[x]:
                v = vals[d - lo] + lg[q]
                if v > t:  # noqa: PLR1730 (hot loop: cheaper than max())
                    t = v
            vals[x - lo] = t + dur[x - r0]
        return self._across(r, lb + 1, vals, lo)

    def _across(self, r: int, c: int, vals: list, lo: int) -> float:
        """Finish = max over the edges crossing cut ``c`` of source end (``vals`` from row ``lo``,
        else kept) + lag + target's kept duration and time to the end."""
        cx, n = self.cuts, self.cuts.n
        a, b = cx.cut_ptr[c], cx.cut_ptr[c + 1]
        lg, sk = self._lag_l[r], self._sink_l
        E, S, D = self.E, self.S, self.D
        best = -np.inf
        for x, y, q in zip(cx.cut_src[a:b], cx.cut_dst[a:b], cx.cut_lag[a:b]):
            ex = vals[x - lo] if x >= lo else E.item(x, r)
            v = ex + sk[q] if y == n else ex + lg[q] + (S.item(y, r) + D.item(y, r))
            if v > best:  # noqa: PLR1730
                best = v
        return best
