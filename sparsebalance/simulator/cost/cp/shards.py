"""How a sequence lies on a CP group, and the work each rank does: layouts and expected pairs.

A sequence of ``n`` key blocks is dealt to the ``W = cp`` ranks of a CP group by a **layout**
(:func:`shards`; block granularity): ``contiguous`` (W runs of blocks), ``zigzag`` (2 W runs, rank r
holding runs r and 2 W - 1 - r: balanced for causal dense attention) or ``stripe`` (block j on rank
j mod W, as MTraining deals them). Each rank holds the queries, keys and values of its blocks.

**Work.** :func:`pair_weights` gives the expected attended (query, key) pairs of every (query block,
key block): a query block's own block causally, and its ``k - 1`` chosen past blocks, each past
block chosen with a probability set by ``selection`` -- ``uniform`` (any past block alike: the
neutral assumption without gate statistics) or ``local`` (the ``k - 1`` most recent, MoBA's
pattern on local text). Summed over all pairs this is exactly ``roofline.moba_pairs``, the count the
kernel cost model prices; a step's pairs set the call it runs (:mod:`.calls`: priced as the
profile's one-GPU call with as many pairs). No constant is set here: times come from the profile,
bytes from the model dims.

The kernel side deals tokens with the same functions (``kernels/moba/cp.py``). docs/costmodel.md
section 11 states the model and what it leaves out.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.simulator.config import CP_LAYOUTS as LAYOUTS
from sparsebalance.simulator.config import CP_SELECTIONS as SELECTIONS

__all__ = ["LAYOUTS", "SELECTIONS", "block_sizes", "min_blocks", "pair_weights", "rank_pairs", "rank_step_pairs",
           "shards"]


def min_blocks(layout: str, cp: int) -> int:
    """Fewest key blocks a sequence needs to be split by ``layout`` over ``cp`` ranks (a shorter one
    stays whole on one rank; ``best`` takes the fewest of its candidates')."""
    return 2 * cp if layout == "zigzag" else cp


def shards(n: int, cp: int, layout: str) -> list[np.ndarray]:
    """Block indices of each of the ``cp`` ranks (``n >= min_blocks(layout, cp)``)."""
    blocks = np.arange(n)
    if layout == "contiguous":
        return [np.asarray(x) for x in np.array_split(blocks, cp)]
    if layout == "zigzag":
        runs = np.array_split(blocks, 2 * cp)
        return [np.concatenate((runs[r], runs[2 * cp - 1 - r])) for r in range(cp)]
    if layout == "stripe":
        return [blocks[r::cp] for r in range(cp)]
    raise ValueError(f"layout: {layout!r} is not one of {', '.join(LAYOUTS)}")


def block_sizes(L: int, block: int) -> np.ndarray:
    """Tokens of each key block of a sequence of ``L`` tokens."""
    n = -(-L // block)
    sizes = np.full(n, float(block))
    sizes[-1] = L - (n - 1) * block
    return sizes


def pair_weights(L: int, block: int, k: int, selection: str = "uniform") -> np.ndarray:
    """[n, n] expected attended (query, key) pairs of query block c with key block j: own block
    ``s_c (s_c + 1) / 2``; a past block ``s_c x B x`` the probability that c chooses it
    (``uniform``: min(k-1, c) / c; ``local``: 1 for the ``k - 1`` most recent); later blocks 0.
    Sums to ``roofline.moba_pairs(L, block, k)``."""
    s = block_sizes(L, block)
    n = len(s)
    c = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    a = min(k, n) - 1
    if selection == "uniform":
        p = np.where(j < c, np.minimum(a, c) / np.maximum(c, 1), 0.0)
    elif selection == "local":
        p = np.where((j < c) & (c - j <= a), 1.0, 0.0)
    else:
        raise ValueError(f"selection: {selection!r} is not one of {', '.join(SELECTIONS)}")
    w = s[:, None] * block * p
    w[np.arange(n), np.arange(n)] = s * (s + 1) / 2
    return w


def rank_pairs(L: int, block: int, k: int, cp: int, layout: str, selection: str = "uniform") -> np.ndarray:
    """[cp, cp] expected pairs of rank q's queries with rank p's keys: :func:`pair_weights` summed
    over the two ranks' blocks, without the n x n matrix (prefix counts of each rank's blocks; a
    grid of profile points costs O(cp^2 n) each). Equal to the sums of :func:`pair_weights`."""
    s = block_sizes(L, block)
    n = len(s)
    own = np.zeros((cp, n))
    for r, part in enumerate(shards(n, cp, layout)):
        own[r, part] = 1.0
    before = np.cumsum(own, axis=1) - own  # [cp, n]: rank p's blocks before block c
    c = np.arange(n)
    a = min(k, n) - 1
    if selection == "uniform":
        f = s * block * np.minimum(a, c) / np.maximum(c, 1)
        seen = before
    elif selection == "local":
        f = s * block
        lo = np.maximum(c - a, 0)
        seen = before - np.take(np.cumsum(own, axis=1) - own, lo, axis=1)  # p's blocks in [c - a, c)
    else:
        raise ValueError(f"selection: {selection!r} is not one of {', '.join(SELECTIONS)}")
    out = (own * f) @ seen.T
    out[np.arange(cp), np.arange(cp)] += own @ (s * (s + 1) / 2)
    return out


def rank_step_pairs(w: np.ndarray, parts: list[np.ndarray], order: np.ndarray) -> np.ndarray:
    """[W, S] pairs rank r computes at step s, where it holds the keys of rank ``order[r, s]``."""
    cp = len(parts)
    by = np.array([[w[np.ix_(parts[q], parts[kv])].sum() for kv in range(cp)] for q in range(cp)])
    return np.take_along_axis(by, order, axis=1)
