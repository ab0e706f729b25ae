"""Routing coverage C(k): the one definition, shared by the kernel's measurement and the policy model.

The definition and why the own block is left out are in ``docs/coverage.md``; this module is its
code. In short: a query token in block ``i >= 1`` with head ``h`` spreads its gate probability
(softmax of gate scores over its ``i`` past blocks) and a budget ``k`` keeps the share held by the
``k - 1`` routed blocks, i.e. the ``min(k - 1, i)`` largest probabilities. ``C(k)`` of a sequence is
the mean of that share over every routed query (token with a past block, head); a sequence of one
block routes nothing and has ``C = 1``. Micro-batch coverage weights sequences by routed queries.

Two sources fill in the per-block shares: ``kernels/moba/coverage.py`` from real gate scores and
``policies/coverage.py`` from a parametric rank law; both reduce them with :func:`aggregate`.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.data.sequence import blocks


def routed_per_block(length: int, block_size: int) -> np.ndarray:
    """Query tokens of blocks ``1..n-1`` (float64 [n - 1]): the queries that route (block 0 has no
    past block); the last block may be partial."""
    n = blocks(int(length), int(block_size))
    q = np.full(max(n - 1, 0), float(block_size))
    if n >= 2:
        q[-1] = length - (n - 1) * block_size
    return q


def routed_queries(length: int, block_size: int) -> int:
    """Routed query tokens of a sequence: ``max(0, length - block_size)`` (the weight of the sequence
    in a micro-batch's coverage, per head)."""
    return max(0, int(length) - int(block_size))


def aggregate(shares: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """C(k) from per-query-block mean shares.

    ``shares[i - 1, c]`` = mean share kept (over the tokens and heads of query block ``i``) at the
    ``c``-th budget asked for; returns float64 ``[len(budgets)]`` = the routed-query-weighted mean over
    blocks. A sequence without past blocks (``shares`` with no rows) has coverage 1.
    """
    q = routed_per_block(length, block_size)
    s = np.asarray(shares, dtype=np.float64)
    if q.size == 0:
        return np.ones(s.shape[-1] if s.ndim == 2 else 0)
    if s.shape[0] != q.size:
        raise ValueError(f"shares: expected {q.size} query blocks for length {length}, got {s.shape[0]}")
    return np.clip(q @ s / q.sum(), 0.0, 1.0)


def microbatch(curves: list[np.ndarray], lengths: list[int], block_size: int) -> np.ndarray:
    """Token-weighted micro-batch coverage: sequences' curves (padded with 1 beyond their blocks,
    same length each) weighted by routed queries; 1 where nothing in the micro-batch routes."""
    w = np.array([routed_queries(n, block_size) for n in lengths], dtype=np.float64)
    c = np.asarray(curves, dtype=np.float64).reshape(len(w), -1)
    return microbatch_rows(c, w, np.zeros(len(w), dtype=np.int64), np.arange(len(w)), 1)[0]


def microbatch_rows(curves: np.ndarray, weights: np.ndarray, group: np.ndarray, slot: np.ndarray,
                    groups: int) -> np.ndarray:
    """:func:`microbatch` of many micro-batches at once: row x of ``curves`` [N, K] (weight
    ``weights[x]``) is sequence ``slot[x]`` of micro-batch ``group[x]``; returns [groups, K]. Summed
    slot after slot (slot 0 first), so a micro-batch's values do not depend on the others."""
    c = np.asarray(curves, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    group = np.asarray(group, dtype=np.int64)
    order = np.argsort(slot, kind="stable")
    edges = np.searchsorted(np.asarray(slot)[order], np.arange(int(np.max(slot, initial=-1)) + 2))
    acc, total = np.zeros((groups, c.shape[1])), np.zeros(groups)
    for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
        x = order[a:b]
        g = group[x]  # distinct: one sequence per micro-batch and slot
        acc[g] += w[x, None] * c[x]
        total[g] += w[x]
    out = np.ones((groups, c.shape[1]))
    some = total > 0
    out[some] = acc[some] / total[some, None]
    return out
