""":func:`.packing.lpt`'s placement loop compiled (numba), for large item counts.

SAB at global batch 4,096 runs LPT about eight times per decision, each placing 2,048-4,096
sequences into up to ~400 micro-batches; in Python the heap operations are most of SAB's time.
This is the same loop over arrays: a binary min-heap keyed by (load, bin) - keys are unique (one
entry per bin), so any correct heap pops bins in the same order as :mod:`heapq` does on the
same (load, bin) tuples - with the same rules for full bins, the min-count rule and the token cap,
and the same float additions, so the placement is the same item for item (tests hold it equal to
the Python loop). :func:`.packing.lpt` takes it when numba is importable and the input is large.
"""

from __future__ import annotations

import numpy as np

from sparsebalance import jit

MIN_ITEMS = 1024
"""Items from which :func:`.packing.lpt` uses the compiled loop once loaded (below, Python's heap
is about as fast)."""

STRICT_CAP_FAILED = -1
NO_BIN = -2


@jit.compiled
def _place(order, cost, tok_of, bins, full, min_count, count_is_none, cap, strict_cap):  # pragma: no cover
    """Bin per placed item (in placement order), or a one-element status: STRICT_CAP_FAILED, NO_BIN."""
    n = order.shape[0]
    hl = np.zeros(bins)                       # heap: loads
    hb = np.arange(bins)                      # heap: bins
    size = bins
    cnt = np.zeros(bins, dtype=np.int64)
    tok = np.zeros(bins)
    out = np.empty(n, dtype=np.int64)
    al = np.empty(bins)                       # entries set aside while searching
    ab = np.empty(bins, dtype=np.int64)

    def less(la, ba, lb, bb):
        return la < lb or (la == lb and ba < bb)

    def sift_down(size, load, b):  # (load, b) at the root of a heap of size entries, restored
        pos = 0
        while True:
            child = 2 * pos + 1
            if child >= size:
                break
            if child + 1 < size and less(hl[child + 1], hb[child + 1], hl[child], hb[child]):
                child += 1
            if not less(hl[child], hb[child], load, b):
                break
            hl[pos], hb[pos] = hl[child], hb[child]
            pos = child
        hl[pos], hb[pos] = load, b

    def push(size, load, b):
        pos = size
        while pos > 0:
            parent = (pos - 1) // 2
            if not less(load, b, hl[parent], hb[parent]):
                break
            hl[pos], hb[pos] = hl[parent], hb[parent]
            pos = parent
        hl[pos], hb[pos] = load, b

    deficit = min_count * bins
    for placed in range(n):
        i = order[placed]
        t_i = tok_of[i]
        only_short = count_is_none and deficit > n - placed - 1
        b = hb[0]
        if cnt[b] < full and not (only_short and cnt[b] >= min_count) and tok[b] + t_i <= cap:
            sift_down(size, hl[0] + cost[i], b)  # the least-loaded bin takes it: replace the top
            chosen = b
        else:
            na, chosen, fallback = 0, -1, -1
            while size > 0:
                load, b = hl[0], hb[0]
                size -= 1
                if size > 0:
                    sift_down(size, hl[size], hb[size])
                if cnt[b] >= full:
                    continue                  # full for good: dropped from the heap
                al[na], ab[na] = load, b
                na += 1
                if only_short and cnt[b] >= min_count:
                    continue
                if tok[b] + t_i > cap:
                    if fallback < 0 or tok[b] < tok[fallback]:
                        fallback = b
                    continue
                chosen = b
                break
            if chosen < 0:
                chosen = fallback
                if chosen < 0:
                    return np.full(1, NO_BIN, dtype=np.int64)
                if strict_cap and cnt[chosen] > 0:
                    return np.full(1, STRICT_CAP_FAILED, dtype=np.int64)
            for e in range(na):
                push(size, al[e] + cost[i] if ab[e] == chosen else al[e], ab[e])
                size += 1
        out[placed] = chosen
        if cnt[chosen] < min_count:
            deficit -= 1
        cnt[chosen] += 1
        tok[chosen] += t_i
    return out


def place(order: np.ndarray, cost: np.ndarray, tok_of: np.ndarray, bins: int, full: int, min_count: int,
          count_is_none: bool, cap: float, strict_cap: bool) -> np.ndarray | None:
    """Bin per placed item (int64 [items], placement order), or a one-element status array
    (``STRICT_CAP_FAILED``, ``NO_BIN``). Only once the compiled loops are loaded (``jit.loaded()``)."""
    return _place.get()(order, cost, tok_of, bins, full, min_count, count_is_none, cap, strict_cap)
