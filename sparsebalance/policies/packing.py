"""Packing items (sequences) with costs into bins (DP ranks or micro-batches): LPT and swaps.

Both packers are deterministic: ties in cost are broken by item index, ties in load by bin index.

* :func:`lpt` — longest processing time first: items in decreasing cost, each into the least-loaded
  bin that may still take it. Bins may have an exact item count (``count``: every bin gets exactly
  that many, which is how fixed-size micro-batches and equal-count ranks are built) or a minimum
  (``min_count``: every bin ends non-empty, an item is never placed where it would leave too few
  items to fill the bins still short) and a token cap (prefer bins the item fits in; if none fits,
  the bin with the fewest tokens). Without count constraints LPT's makespan is at most
  4/3 - 1/(3 m) of the optimum (Graham 1969).
* :func:`improve` — local search on the makespan: repeatedly take the most-loaded bin and apply the
  pairwise swap (or, when counts may change, single move) with one of the lightest bins that lowers
  that bin's load the most without raising the other above it. Every accepted step strictly lowers
  the loaded bin, so it terminates; ``rounds`` bounds the work.
"""

from __future__ import annotations

import heapq
from typing import Literal, overload

import numpy as np

from sparsebalance import jit
from sparsebalance.policies import packing_jit


@overload
def lpt(costs: np.ndarray, bins: int, *, count: int | None = None, min_count: int = 0,
        tokens: np.ndarray | None = None, token_cap: int | None = None,
        strict_cap: Literal[False] = False) -> list[list[int]]: ...


@overload
def lpt(costs: np.ndarray, bins: int, *, count: int | None = None, min_count: int = 0,
        tokens: np.ndarray | None = None, token_cap: int | None = None,
        strict_cap: bool) -> list[list[int]] | None: ...


def lpt(costs: np.ndarray, bins: int, *, count: int | None = None, min_count: int = 0,
        tokens: np.ndarray | None = None, token_cap: int | None = None,
        strict_cap: bool = False) -> list[list[int]] | None:
    """Item indices per bin (each list in placement order). ``costs``/``tokens``: shape [items].

    A heap of (load, bin) gives the least-loaded bin in O(log bins). The usual case (the top of the
    heap may take the item) costs one ``heapreplace``; otherwise bins that are full, not allowed
    (the min-count rule) or too full for the item's tokens are popped, set aside and pushed back.
    ``strict_cap``: return None as soon as an item would have to join a non-empty bin over the cap
    (a later LPT step only adds items, so that bin could never come back under it)."""
    cost = np.asarray(costs, dtype=np.float64)
    n = len(cost)
    if count is not None and count * bins != n:
        raise ValueError(f"lpt: {n} items cannot fill {bins} bins of exactly {count}")
    if min_count * bins > n:
        raise ValueError(f"lpt: {n} items cannot give {bins} bins at least {min_count} each")
    order_a = np.lexsort((np.arange(n), -cost))  # cost desc, index asc
    tok_a = np.zeros(n) if tokens is None else np.asarray(tokens, dtype=np.float64)
    cap = float("inf") if token_cap is None or tokens is None else float(token_cap)
    full = n + 1 if count is None else count           # no bin ever reaches n + 1 items
    if n >= packing_jit.MIN_ITEMS and jit.loaded():  # the same loop compiled (sparsebalance/jit.py)
        bin_of = packing_jit.place(order_a, cost, tok_a, bins, full, min_count, count is None, cap, strict_cap)
        assert bin_of is not None  # the loops are loaded (jit.loaded())
        if len(bin_of) != n:  # a status
            if bin_of[0] == packing_jit.STRICT_CAP_FAILED:
                return None
            raise ValueError(f"lpt: no bin can take another item ({bins} bins, count {count})")
        items = order_a[np.argsort(bin_of, kind="stable")]  # per bin, in placement order
        return [x.tolist() for x in np.split(items, np.cumsum(np.bincount(bin_of, minlength=bins))[:-1])]
    order, cost_l, tok_of = order_a.tolist(), cost.tolist(), tok_a.tolist()
    heap = [(0.0, b) for b in range(bins)]
    cnt, tok = [0] * bins, [0.0] * bins
    fallback: int | None
    out: list[list[int]] = [[] for _ in range(bins)]
    deficit = min_count * bins                          # items still owed to short bins
    heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
    chosen: int | None
    for placed, i in enumerate(order):
        t_i = tok_of[i]
        # only bins still short of min_count may take the item when the rest are owed to them
        only_short = count is None and deficit > n - placed - 1
        load, b = heap[0]
        if cnt[b] < full and not (only_short and cnt[b] >= min_count) and tok[b] + t_i <= cap:
            heapreplace(heap, (load + cost_l[i], b))    # fast path: the least-loaded bin takes it
            chosen = b
        else:
            aside: list[tuple[float, int]] = []
            chosen, fallback = None, None
            while heap:
                load, b = heappop(heap)
                if cnt[b] >= full:
                    continue                            # full for good: drop from the heap
                aside.append((load, b))
                if only_short and cnt[b] >= min_count:
                    continue
                if tok[b] + t_i > cap:
                    if fallback is None or tok[b] < tok[fallback]:
                        fallback = b
                    continue
                chosen = b
                break
            if chosen is None:  # nothing fits: the bin with the fewest tokens takes it (cap exceeded)
                chosen = fallback
                if chosen is None:
                    raise ValueError(f"lpt: no bin can take another item ({bins} bins, count {count})")
                if strict_cap and cnt[chosen]:
                    return None
            for entry in aside:
                if entry[1] == chosen:
                    heappush(heap, (entry[0] + cost_l[i], chosen))
                else:
                    heappush(heap, entry)
        out[chosen].append(i)
        if cnt[chosen] < min_count:
            deficit -= 1
        cnt[chosen] += 1
        tok[chosen] += t_i
    return out


def loads(assign: list[list[int]], costs: np.ndarray) -> np.ndarray:
    costs = np.asarray(costs, dtype=np.float64)
    return np.array([costs[b].sum() if b else 0.0 for b in assign])


def improve(assign: list[list[int]], costs: np.ndarray, *, rounds: int = 100, moves: bool = False,
            min_count: int = 1, tokens: np.ndarray | None = None, token_cap: int | None = None,
            partners: int = 8) -> list[list[int]]:
    """Pairwise swaps (and single moves when ``moves``) that lower the makespan; returns a new
    assignment. Token cap: a step may not push a bin of two or more items over ``token_cap``.

    Per round, the heaviest bin ``a`` is paired with the ``partners`` lightest bins. For a partner
    ``b`` the ideal transfer is ``d* = (load_a - load_b) / 2``; a sorted search finds, for each item
    of ``a``, the items of ``b`` whose cost is nearest to ``cost_i - d*`` (two neighbours), and moves
    take the item of ``a`` nearest to ``d*``. So a round is O(|a| log |b|) per partner, which keeps
    thousands of sequences per bin cheap; the best step over all partners is applied."""
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.zeros_like(costs) if tokens is None else np.asarray(tokens, dtype=np.float64)
    cap = np.inf if token_cap is None else float(token_cap)
    nb = len(assign)
    if nb < 2:
        return [list(b) for b in assign]
    if costs.size <= SMALL:
        return _improve_small(assign, costs, rounds, moves, min_count, tokens, cap)
    members = [list(b) for b in assign]
    ld = np.array([costs[b].sum() for b in members])
    tk = np.array([tokens[b].sum() for b in members])
    top = float(costs.max()) if costs.size and costs.min() >= 0 else np.inf
    for _ in range(rounds):
        a = int(np.argmax(ld))
        la = ld[a]
        if len(members[a]) == 1 and costs[members[a][0]] >= top:
            break  # a lone largest item: no move or swap can lower it (common at large n)
        best = la - 1e-12 * max(la, 1e-300)
        step: tuple[int, int | None, int] | None = None
        ia = np.asarray(members[a], dtype=np.int64)
        ca = costs[ia]
        light = [int(b) for b in np.argsort(ld, kind="stable")[:partners + 1] if b != a][:partners]
        for b in light:
            lb, ib = ld[b], np.asarray(members[b], dtype=np.int64)
            target = (la - lb) / 2.0
            if ib.size and ca.size:
                order = np.argsort(costs[ib], kind="stable")
                cb = costs[ib][order]
                pos = np.searchsorted(cb, ca - target)
                for cand in (np.clip(pos, 0, cb.size - 1), np.clip(pos - 1, 0, cb.size - 1)):
                    j = ib[order[cand]]
                    d = ca - costs[j]
                    worst = np.maximum(la - d, lb + d)
                    dt = tokens[ia] - tokens[j]
                    ok = (d > 0) & ((tk[a] - dt <= cap) | (ia.size < 2)) & \
                         ((tk[b] + dt <= cap) | (ib.size < 2))
                    worst = np.where(ok, worst, np.inf)
                    k = int(np.argmin(worst))
                    if worst[k] < best:
                        best, step = worst[k], (int(ia[k]), int(j[k]), b)
            if moves and ia.size > max(min_count, 1):
                worst = np.maximum(la - ca, lb + ca)
                ok = (tk[b] + tokens[ia] <= cap) | (ib.size == 0)
                worst = np.where(ok, worst, np.inf)
                k = int(np.argmin(worst))
                if worst[k] < best:
                    best, step = worst[k], (int(ia[k]), None, b)
        if step is None:
            break
        _apply(step, a, members, ld, tk, costs, tokens)
    return members


def _apply(step, a, members, ld, tk, costs, tokens) -> None:
    """Move item i from bin a to bin b (and item j back from b to a for a swap), in place."""
    i, j, b = step
    for item, src, dst in ((i, a, b),) + (((j, b, a),) if j is not None else ()):
        members[src].remove(item)
        members[dst].append(item)
        ld[src] -= costs[item]
        ld[dst] += costs[item]
        tk[src] -= tokens[item]
        tk[dst] += tokens[item]


SMALL = 64
"""Up to this many items, :func:`improve` searches every swap/move in plain Python (numpy's per-call
overhead dominates there); the result is the exhaustive best step per round."""


def _improve_small(assign, costs, rounds, moves, min_count, tokens, cap) -> list[list[int]]:
    c = costs.tolist()
    t = tokens.tolist()
    members = [list(b) for b in assign]
    ld = [sum(c[i] for i in b) for b in members]
    tk = [sum(t[i] for i in b) for b in members]
    for _ in range(rounds):
        a = max(range(len(members)), key=lambda b: (ld[b], -b))
        la = ld[a]
        best = la - 1e-12 * max(la, 1e-300)
        step: tuple[int, int | None, int] | None = None
        for b, mb in enumerate(members):
            if b == a:
                continue
            for i in members[a]:
                if moves and len(members[a]) > max(min_count, 1) and \
                        (tk[b] + t[i] <= cap or not mb):
                    w = max(la - c[i], ld[b] + c[i])
                    if w < best:
                        best, step = w, (i, None, b)
                for j in mb:
                    d = c[i] - c[j]
                    if d <= 0:
                        continue
                    dt = t[i] - t[j]
                    if (tk[a] - dt > cap and len(members[a]) > 1) or \
                            (tk[b] + dt > cap and len(mb) > 1):
                        continue
                    w = max(la - d, ld[b] + d)
                    if w < best:
                        best, step = w, (i, j, b)
        if step is None:
            break
        _apply(step, a, members, ld, tk, c, t)
    return members
