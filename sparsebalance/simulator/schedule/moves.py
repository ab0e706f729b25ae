"""Moves of :class:`~sparsebalance.simulator.schedule.perturb.ReplicaTimes`: give one micro-batch new stage
times and update the kept ends and times to the end locally (the rule and why it is exact: the
docstring of :mod:`.perturb`, 'A move'). A mixin: the kept arrays and the level cuts live on the
class that uses it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sparsebalance.simulator.schedule.levelcuts import LevelCuts

REACH = 3
"""A move's re-timing looks this many window widths (+ 4 levels) past its window for a settling
cut before it re-times the replica in full."""


class Moves:
    """:meth:`apply` and its forward / backward local re-timing, for
    :class:`~sparsebalance.simulator.schedule.perturb.ReplicaTimes` (which provides ``cuts``, ``D``, ``E``,
    ``S``, ``_lag_l``, ``_sink_l`` and ``refresh``)."""

    __slots__ = ()
    # what ReplicaTimes keeps (declared for the type checker; no slots, no values here)
    cuts: LevelCuts
    D: np.ndarray
    E: np.ndarray
    S: np.ndarray
    _lag_l: list[list[float]]
    _sink_l: list[float]

    if TYPE_CHECKING:
        def refresh(self, replicas) -> None: ...

    # -- moves -----------------------------------------------------------------------------------
    def apply(self, r: int, j: int, new) -> None:
        """Give micro-batch ``j`` of replica ``r`` the durations ``new`` ([2 V]) and update
        the kept times (module docstring)."""
        cx = self.cuts
        rows = cx.own[j].tolist()
        old = {x: self.D.item(x, r) for x in rows}
        tol = self._tol(r)  # the forward pass's tolerance: of the kept finish before the move
        self.D[cx.own[j], r] = new
        la, lb = cx.span[j]
        reach = REACH * (lb - la + 1) + 4
        fine = self._forward(r, la, lb, reach, tol) and self._backward(r, la, lb, reach, old)
        if not fine:
            self.refresh([r])

    def _tol(self, r: int) -> float:
        return 32.0 * float(np.spacing(max(self.E[self.cuts.last_rows, r].max(), 1e-300)))

    def _forward(self, r: int, la: int, lb: int, reach: int, tol: float) -> bool:
        cx, n = self.cuts, self.cuts.n
        ls = cx.level_start
        top = min(cx.levels, lb + 1 + reach)
        r0, r_top = ls[la], ls[top]
        lo = cx.pred_lo[la]
        before = self.E[lo:r_top, r].tolist()
        vals = list(before)
        dur = self.D[r0:r_top, r].tolist()
        lg = self._lag_l[r]
        prev, deps = cx.prev, cx.deps
        c = la
        while True:
            for x in range(ls[c], ls[c + 1]):  # re-time level c
                p = prev[x]
                t = vals[p - lo] if p >= 0 else 0.0
                for d, q in deps[x]:
                    v = vals[d - lo] + lg[q]
                    if v > t:  # noqa: PLR1730
                        t = v
                vals[x - lo] = t + dur[x - r0]
            c += 1
            if c == cx.levels:
                self.E[r0:n, r] = vals[r0 - lo:n - lo]
                return True
            if c <= lb:
                continue
            shift = self._settled_forward(c, vals, before, lo, r0, tol)
            if shift is not None:
                cut = ls[c]
                self.E[r0:cut, r] = vals[r0 - lo:cut - lo]
                if shift:
                    self.E[cut:n, r] -= shift
                return True
            if c >= top:
                return False

    def _settled_forward(self, c, vals, before, lo, r0, tol):
        """The common move of the sources of the edges into rows after cut ``c``, or None."""
        cx, n = self.cuts, self.cuts.n
        a, b = cx.cut_ptr[c], cx.cut_ptr[c + 1]
        shift = None
        for x, y in zip(cx.cut_src[a:b], cx.cut_dst[a:b]):
            if y == n:
                continue  # a sink edge: its source's end is written, nothing after depends on it
            dx = before[x - lo] - vals[x - lo] if x >= r0 else 0.0
            if shift is None:
                shift = dx
            elif abs(dx - shift) > tol:
                return None
        if shift is None:
            shift = 0.0
        if shift != 0.0 and cx.level_start[c] <= cx.last_source:
            return None  # a source after the cut starts at 0 s whatever happens before it
        return shift

    def _backward(self, r: int, la: int, lb: int, reach: int, old: dict) -> bool:
        cx = self.cuts
        ls = cx.level_start
        bottom = max(0, la - reach)
        r_lo, r1 = ls[bottom], ls[lb + 1]
        hi = max(cx.succ_hi[lb], r1)
        s_before = self.S[r_lo:hi, r].tolist()
        d_new = self.D[r_lo:hi, r].tolist()
        s_vals = list(s_before)
        thr = [s + d for s, d in zip(s_before, d_new)]
        lg, sk = self._lag_l[r], self._sink_l
        nxt, succ, sink = cx.next, cx.succ, cx.sink
        tol = self._tol(r)
        c = lb + 1
        while True:
            c -= 1
            for x in range(ls[c + 1] - 1, ls[c] - 1, -1):  # re-time level c, last row first
                s = sink[x]
                t = sk[s] if s >= 0 else -np.inf
                y = nxt[x]
                if y >= 0 and thr[y - r_lo] > t:
                    t = thr[y - r_lo]
                for y, q in succ[x]:
                    v = lg[q] + thr[y - r_lo]
                    if v > t:  # noqa: PLR1730
                        t = v
                s_vals[x - r_lo] = t
                thr[x - r_lo] = t + d_new[x - r_lo]
            if c == 0:
                self.S[0:r1, r] = s_vals[0 - r_lo:r1 - r_lo]
                return True
            if c > la:
                continue
            shift = self._settled_backward(c, thr, s_before, d_new, old, r_lo, r1, tol)
            if shift is not None:
                cut = ls[c]
                self.S[cut:r1, r] = s_vals[cut - r_lo:r1 - r_lo]
                if shift:
                    self.S[0:cut, r] -= shift
                return True
            if c <= bottom:
                return False

    def _settled_backward(self, c, thr, s_before, d_new, old, r_lo, r1, tol):
        """The common move of (duration + time to the end) of the targets of the edges out of rows
        before cut ``c``, or None (a sink edge across the cut pins it to 0). Their values before
        the move (time to the end + old duration) are formed here, for the few targets read."""
        cx, n = self.cuts, self.cuts.n
        a, b = cx.cut_ptr[c], cx.cut_ptr[c + 1]
        shift = None
        for y in cx.cut_dst[a:b]:
            if y == n or y >= r1:
                dy = 0.0
            else:
                before = s_before[y - r_lo] + old.get(y, d_new[y - r_lo])
                dy = before - thr[y - r_lo]
            if shift is None:
                shift = dy
            elif abs(dy - shift) > tol:
                return None
        return 0.0 if shift is None else shift
