"""Cached latency predictions for policies, and the monotone budget search DST relies on.

``LatencyModel.microbatch_latency(lengths, k)`` (seconds, F + B over the whole model) is the latency
call the policies make, one micro-batch at a time. Predictions are memoised per ``(lengths, k)``: in a
run the same lengths recur (epochs over a finite dataset) and DST probes each micro-batch at several
budgets. For many micro-batches at once, :meth:`Predictor.many` uses the latency model's vectorised
``microbatch_latencies`` when it has one (one numpy pass instead of thousands of Python calls; a
global batch of 4,096 sequences brings mostly lengths never seen before, so the memo rarely hits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import numpy as np

from sparsebalance.simulator.cost.query import MicrobatchLatency

VECTOR_MIN = 64
"""Below this many micro-batches per call the memoised scalar path is faster than a numpy pass
(numpy's fixed cost per call is ~10 us; a global batch of 16 has 8 micro-batches)."""


class Predictor:
    """Memoised ``microbatch_latency`` (seconds). ``max_entries`` bounds the cache (cleared when
    full, which keeps memory flat over long runs at the cost of recomputation)."""

    def __init__(self, latency: MicrobatchLatency, max_entries: int = 1_000_000) -> None:
        self.latency = latency
        self.max_entries = max_entries
        self._cache: dict[tuple[tuple[int, ...], int], float] = {}

    def __call__(self, lengths: tuple[int, ...], k: int) -> float:
        key = (lengths, k)
        v = self._cache.get(key)
        if v is None:
            if len(self._cache) >= self.max_entries:
                self._cache.clear()
            v = float(self.latency.microbatch_latency(list(lengths), int(k)))
            self._cache[key] = v
        return v

    def many(self, microbatches: Seq[tuple[int, ...]], ks: np.ndarray | int) -> np.ndarray:
        """Latency (seconds, shape [M]) of micro-batch i (a tuple of lengths) at budget ``ks[i]``
        (or one int for all). From ``VECTOR_MIN`` micro-batches on the model's vectorised
        ``microbatch_latencies`` (uncached: a numpy pass is cheaper than the dictionary traffic);
        below, the memoised scalar path."""
        n = len(microbatches)
        ks = np.full(n, ks, dtype=np.int64) if np.ndim(ks) == 0 else np.asarray(ks, dtype=np.int64)
        if n == 0:
            return np.zeros(0)
        if n >= VECTOR_MIN:
            return np.asarray(self.latency.microbatch_latencies(microbatches, ks), dtype=np.float64)
        return np.array([self(mb, int(k)) for mb, k in zip(microbatches, ks.tolist())])

    def at(self, lengths: tuple[int, ...], k: float) -> float:
        """Latency at a fractional budget: linear between the two neighbouring integers (SAB's EMA
        budgets are fractional; latency is additive over layers, so a fractional k is the mean of a
        mix of layers at floor(k) and ceil(k))."""
        lo = math.floor(k)
        frac = k - lo
        v = self(lengths, lo)
        return v if frac == 0 else v + frac * (self(lengths, lo + 1) - v)

    def at_many(self, lengths: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """:meth:`at` for single-sequence micro-batches, vectorised: ``lengths`` and fractional
        budgets ``ks`` of shape [N] -> seconds [N] (same interpolation formula as :meth:`at`)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        ks = np.asarray(ks, dtype=np.float64)
        lo = np.floor(ks).astype(np.int64)
        frac = ks - lo
        mbs = list(zip(lengths.tolist()))  # one-sequence micro-batches (1-tuples)
        v = self.many(mbs, lo)
        up = np.flatnonzero(frac != 0)
        if up.size:
            hi = self.many([mbs[i] for i in up.tolist()], lo[up] + 1)
            v[up] = v[up] + frac[up] * (hi - v[up])
        return v

    def largest_within_many(self, microbatches: Seq[tuple[int, ...]], limits: np.ndarray,
                            lo: int | np.ndarray, hi: int | np.ndarray,
                            start: int | None = None, at_start: np.ndarray | None = None
                            ) -> np.ndarray:
        """:meth:`largest_within` for M micro-batches at once: per micro-batch the largest k in
        ``[lo, hi]`` with predicted latency <= ``limits[i]``, or -1 when even ``lo`` is too slow.
        Bisection on the whole batch in lock-step (latency is non-decreasing in k), one vectorised
        prediction per step over the micro-batches still open: about log2(hi - lo) + 2 numpy passes
        in all. ``start``: a k splitting every bracket first, ``at_start`` its known predictions."""
        m = len(microbatches)
        limits = np.asarray(limits, dtype=np.float64)
        if m < VECTOR_MIN:  # few: the memoised secant search per item
            los = np.broadcast_to(np.asarray(lo, dtype=np.int64), (m,)).tolist()
            his = np.broadcast_to(np.asarray(hi, dtype=np.int64), (m,)).tolist()
            got = [self.largest_within(mb, float(A), a, b, start=start)
                   for mb, A, a, b in zip(microbatches, limits.tolist(), los, his)]
            return np.array([-1 if k is None else k for k in got], dtype=np.int64)
        lim = limits + 1e-12 * np.abs(limits)  # the anchor is itself a prediction: compare with slack
        lo = np.broadcast_to(np.asarray(lo, dtype=np.int64), (m,)).copy()
        hi = np.broadcast_to(np.asarray(hi, dtype=np.int64), (m,)).copy()
        known = np.zeros(m, dtype=bool)  # f(lo) <= lim already established
        if start is not None:
            f0 = self.many(microbatches, start) if at_start is None else np.asarray(at_start)
            split = (lo <= start) & (start <= hi)
            good = split & (f0 <= lim)
            lo[good], known[good] = start, True
            bad = split & ~good
            hi[bad] = start - 1
        out = np.full(m, -1, dtype=np.int64)
        todo = np.flatnonzero(~known & (lo <= hi))
        if todo.size:
            f_lo = self.many([microbatches[i] for i in todo.tolist()], lo[todo])
            known[todo[f_lo <= lim[todo]]] = True
        act = np.flatnonzero(known)
        while act.size:
            open_ = act[lo[act] < hi[act]]
            if not open_.size:
                break
            mid = (lo[open_] + hi[open_] + 1) // 2
            ok = self.many([microbatches[i] for i in open_.tolist()], mid) <= lim[open_]
            lo[open_[ok]] = mid[ok]
            hi[open_[~ok]] = mid[~ok] - 1
            act = open_
        out[known] = lo[known]
        return out

    def largest_within(self, lengths: tuple[int, ...], limit: float, lo: int, hi: int,
                       start: int | None = None) -> int | None:
        """Largest k in [lo, hi] with predicted latency <= ``limit``, or None when even ``lo`` is
        too slow. Latency is non-decreasing in k and close to affine (piecewise linear between the
        profile's budgets), so the search interpolates between the bracket's ends (secant guess,
        then checks k and k + 1) and falls back to bisection; usually 3-4 predictions instead of
        log2(hi - lo) + 1. ``start``: a k whose prediction is likely cached (e.g. k0)."""
        tol = 1e-12 * abs(limit)  # the anchor is itself one of the predictions: compare with slack
        lim = limit + tol
        f = self
        if start is not None and lo <= start <= hi:  # split the bracket at a known point
            if f(lengths, start) <= lim:
                lo = start
            else:
                hi = start - 1
                if hi < lo:
                    return None
        f_lo = f(lengths, lo)
        if f_lo > lim:
            return None
        if f(lengths, hi) <= lim:
            return hi
        # invariant: f(lo) <= lim < f(hi)
        while hi - lo > 1:
            f_hi = f(lengths, hi)
            guess = lo + int((lim - f_lo) / (f_hi - f_lo) * (hi - lo)) if f_hi > f_lo else lo
            guess = min(max(guess, lo + 1), hi - 1)
            if f(lengths, guess) <= lim:
                lo, f_lo = guess, f(lengths, guess)
                if f(lengths, guess + 1) > lim:
                    return guess
                lo, f_lo = guess + 1, f(lengths, guess + 1)
            else:
                hi = guess
                mid = (lo + hi) // 2  # also halve, so a bad guess cannot make this linear
                if mid > lo:
                    if f(lengths, mid) <= lim:
                        lo, f_lo = mid, f(lengths, mid)
                    else:
                        hi = mid
        return lo
