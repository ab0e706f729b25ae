"""Cached latency predictions for policies, and the monotone budget search DST relies on.

``LatencyModel.microbatch_latency(lengths, k)`` (seconds, F + B over the whole model) is the only
latency call the policies make. Predictions are memoised per ``(lengths, k)``: in a run the same
lengths recur (epochs over a finite dataset) and DST probes each micro-batch at several budgets.
"""

from __future__ import annotations

import math
from typing import Any


class Predictor:
    """Memoised ``microbatch_latency`` (seconds). ``max_entries`` bounds the cache (cleared when
    full, which keeps memory flat over long runs at the cost of recomputation)."""

    def __init__(self, latency: Any, max_entries: int = 1_000_000) -> None:
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

    def at(self, lengths: tuple[int, ...], k: float) -> float:
        """Latency at a fractional budget: linear between the two neighbouring integers (SAB's EMA
        budgets are fractional; latency is additive over layers, so a fractional k is the mean of a
        mix of layers at floor(k) and ceil(k))."""
        lo = math.floor(k)
        frac = k - lo
        v = self(lengths, lo)
        return v if frac == 0 else v + frac * (self(lengths, lo + 1) - v)

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
