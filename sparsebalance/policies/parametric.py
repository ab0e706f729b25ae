"""The parametric coverage model's curves C(k), many sequences at once, and its fit to measured ones.

A query in block ``i >= 1`` ranks its ``i`` past blocks; rank ``r`` has weight ``w_r = r ** -a``
(``"power"``) or ``exp(-a (r - 1))`` (``"geometric"``), ``W(m) = w_1 + ... + w_m``, and a budget
``k`` keeps the share ``W(min(k - 1, i)) / W(i)`` (:func:`parametric_shares`); C(k) is those shares
reduced by :func:`sparsebalance.data.coverage.aggregate` (the one definition: ``docs/coverage.md``).

**Evaluation.** Not through the ``[n - 1, n]`` share matrix (O(n^2) per sequence) but the closed
form of its ``aggregate`` given in ``docs/coverage.md`` ('The parametric model and its fit'), O(n):
prefix sums of the routed queries and weights, and a suffix sum of ``q_i / W(i)``.

All sequences are evaluated together in a ragged, position-major layout: sequences sorted longest
first, position ``p`` (block / ``m``) of every sequence that has it stored contiguously, so the
running sums (prefix over ``p``, suffix for the tail, the running max) are one slice operation per
position. A sequence's values come from the same elementwise operations in the same order whatever
the others: :func:`parametric_curve` (one sequence, 1-D accumulates) is bitwise a row of
:func:`parametric_curves` (tests), and equal to the share matrix's ``aggregate`` to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import numpy as np

from sparsebalance.data import coverage as cov
from sparsebalance.data.sequence import blocks

FEW = 4
"""With at most this many sequences, each is evaluated alone with 1-D accumulates (the same
arithmetic; the position-major loop costs one step per block of the longest sequence)."""


def parametric_shares(n: int, rate: float, shape: str = "power") -> np.ndarray:
    """Kept share ``[n - 1, n]``: row = query block ``i = 1..n-1``, column = budget ``k = 1..n``."""
    r = np.arange(1, n, dtype=np.float64)
    w = r ** -rate if shape == "power" else np.exp(-rate * (r - 1.0))
    W = np.concatenate(([0.0], np.cumsum(w)))          # W[m] = W(m), m = 0..n-1
    i = np.arange(1, n)[:, None]
    m = np.arange(n)[None, :]                          # routed blocks k - 1
    return W[np.minimum(m, i)] / W[i]


def _terms(p, n, L, a, B: int, shape: str):
    """Per entry (position ``p`` of a sequence of ``n`` blocks, ``L`` tokens, rate ``a``): the
    rank weight w_p (0 at p = 0) and the routed queries q_p of block p (0 for block 0)."""
    x = _log_ranks(int(p.max()) + 1)[p] if shape == "power" else np.maximum(p - 1, 0).astype(np.float64)
    w = np.exp(-a * x)                                 # r ** -a as exp(-a ln r): a third of pow's time
    w[p == 0] = 0.0
    q = np.where(p == n - 1, (L - (n - 1) * B).astype(np.float64), float(B))
    q[p == 0] = 0.0
    return w, q


_LOGS = [np.zeros(1)]


def _log_ranks(m: int) -> np.ndarray:
    """ln r for r = 1..m-1 at index r (index 0 unused), by ``math.log``: the same values for the
    one-sequence and the batched paths whatever numpy's vector log does. One table, grown by
    doubling and sliced (a cache per ``m`` missed whenever sequences of many block counts alternate)."""
    m = max(m, 1)
    have = _LOGS[0]
    if len(have) < m:
        size = max(m, 2 * len(have))
        have = np.concatenate((have, [math.log(r) for r in range(len(have), size)]))
        have.setflags(write=False)
        _LOGS[0] = have
    return have[:m]


def _finish(head, W, tail, Q):
    """C = (head + W tail) / Q; one-block sequences (Q = 0) are fixed by the caller."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (head + W * tail) / Q


def parametric_curve(length: int, block_size: int, rate: float, shape: str = "power") -> np.ndarray:
    """C(k) for k = 1..n_blocks of the parametric model (float64, shape [n_blocks], C(n) = 1)."""
    B = int(block_size)
    n = blocks(int(length), int(B))
    if n <= 1:
        return np.ones(max(n, 1))
    p = np.arange(n)
    # the rate as an array: a scalar exponent would take numpy's power shortcuts (-1, 0.5, 2, ...)
    w, q = _terms(p, n, np.int64(length), np.full(n, float(rate)), B, shape)
    W = np.cumsum(w)                                   # W(p)
    head = np.cumsum(q)                                # sum_{i <= p} q_i
    t = np.zeros(n)
    t[1:] = q[1:] / W[1:]
    tail = np.zeros(n)
    tail[:-1] = np.cumsum(t[::-1])[::-1][1:]           # sum_{i > p} q_i / W(i), from the last block
    c = np.maximum.accumulate(np.clip(_finish(head, W, tail, head[-1]), 0.0, 1.0))
    c[-1] = 1.0                                        # the clip and max guard against rounding only
    return c


def parametric_curves(lengths: Seq[int], block_size: int, rates: Seq[float],
                      shape: str = "power") -> list[np.ndarray]:
    """:func:`parametric_curve` of many sequences, bitwise (module docstring); the arrays are
    views of one buffer."""
    out, start = parametric_flat(lengths, block_size, rates, shape)
    return [out[start[x]:start[x + 1]] for x in range(len(start) - 1)]


def parametric_flat(lengths: Seq[int], block_size: int, rates: Seq[float],
                    shape: str = "power") -> tuple[np.ndarray, np.ndarray]:
    """:func:`parametric_curves` as one buffer ``out`` and offsets ``start`` [N + 1]: curve x is
    ``out[start[x]:start[x + 1]]`` (for callers that gather from all curves at once)."""
    L = np.asarray(lengths, dtype=np.int64).reshape(-1)
    a = np.asarray(rates, dtype=np.float64).reshape(-1)
    if len(L) != len(a):
        raise ValueError(f"parametric_curves: {len(L)} lengths but {len(a)} rates")
    if len(L) <= FEW:
        few = [parametric_curve(x, block_size, y, shape) for x, y in zip(L.tolist(), a.tolist())]
        start = np.concatenate(([0], np.cumsum([len(c) for c in few], dtype=np.int64)))
        return (np.concatenate(few) if few else np.zeros(0)), start
    B = int(block_size)
    n = np.maximum(blocks(L, B), 1)
    order = np.argsort(-n, kind="stable")              # longest first
    ns = n[order]
    M = int(ns[0])
    cnt = np.searchsorted(-ns, -np.arange(M), side="left")  # sequences with more than p blocks
    off = np.concatenate(([0], np.cumsum(cnt)))
    size = int(off[-1])
    p = np.repeat(np.arange(M), cnt)                   # entry e: position p of sorted sequence u
    u = np.arange(size) - np.repeat(off[:-1], cnt)
    # _terms in this layout: position 0 of every sequence is the first cnt[0] entries, its last
    # block one entry per sequence (same values: w = exp(-a x) at p >= 1, q = B but at the last)
    S = int(cnt[0])
    x = _log_ranks(M)[p[S:]] if shape == "power" else (p[S:] - 1).astype(np.float64)
    w = np.zeros(size)
    w[S:] = np.exp(-a[order][u[S:]] * x)
    q = np.full(size, float(B))
    last = off[ns - 1] + np.arange(len(ns))            # entry of each sequence's last block
    q[last] = (L[order] - (ns - 1) * B).astype(np.float64)
    q[:S] = 0.0
    cnt_l, off_l = cnt.tolist(), off.tolist()

    def prefix(op, x):                                 # x[p] = op(x[p - 1], x[p]), p = 1..M-1
        for k in range(1, M):
            c, s0, s1 = cnt_l[k], off_l[k - 1], off_l[k]
            op(x[s0:s0 + c], x[s1:s1 + c], out=x[s1:s1 + c])
        return x

    W = prefix(np.add, w)
    head = prefix(np.add, q.copy())
    t = np.zeros(size)
    np.divide(q, W, out=t, where=p >= 1)
    for k in range(M - 2, -1, -1):                     # suffix sums from the last block
        c, s0, s1 = cnt_l[k + 1], off_l[k], off_l[k + 1]
        np.add(t[s1:s1 + c], t[s0:s0 + c], out=t[s0:s0 + c])
    tail = np.zeros(size)                              # sum over i > p: the suffix at p + 1
    for k in range(M - 1):
        c = cnt_l[k + 1]
        tail[off_l[k]:off_l[k] + c] = t[off_l[k + 1]:off_l[k + 1] + c]
    c = prefix(np.maximum, np.clip(_finish(head, W, tail, head[last][u]), 0.0, 1.0))
    c[last] = 1.0                                      # also C = 1 of one-block sequences
    out = np.empty(size)                               # back to one run of entries per sequence
    start = np.concatenate(([0], np.cumsum(n)))
    out[start[order][u] + p] = c
    return out, start


def fit_rate(curves: Seq[tuple[int, Seq[float]]], block_size: int, shape: str = "power",
             bounds: tuple[float, float] = (1e-3, 20.0)) -> tuple[float, float]:
    """Rate ``a`` whose parametric curves best match measured ones (least squares over every
    ``(sequence, k)``, sequences weighted by routed queries); returns ``(a, max abs error)``.
    ``curves``: ``(length, C(1..n_blocks))`` pairs. Sequences of one block carry no information."""
    from scipy.optimize import minimize_scalar

    data = [(int(n), np.asarray(c, dtype=np.float64)) for n, c in curves
            if blocks(int(n), int(block_size)) > 1]
    if not data:
        raise ValueError("fit_rate: no curve of a sequence with more than one block")
    w = np.array([cov.routed_queries(n, block_size) for n, _ in data], dtype=np.float64)
    lengths = [n for n, _ in data]

    def model(a: float) -> list[np.ndarray]:
        return parametric_curves(lengths, block_size, [a] * len(lengths), shape)

    def loss(log_a: float) -> float:
        return sum(wi * float(np.sum((m - c) ** 2))
                   for wi, m, (_, c) in zip(w, model(math.exp(log_a)), data, strict=True))

    lo, hi = (math.log(b) for b in bounds)
    res = minimize_scalar(loss, bounds=(lo, hi), method="bounded", options={"xatol": 1e-4})
    a = math.exp(res.x)
    err = max(float(np.max(np.abs(m - c))) for m, (_, c) in zip(model(a), data, strict=True))
    return a, err
