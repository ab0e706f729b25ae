"""Context parallelism (CP) for MoBA attention: one sequence's layer split over ``cp`` GPUs, priced.

A sequence of ``n`` key blocks is dealt to the ``W = cp`` ranks of a CP group by a **layout**
(:func:`shards`; block granularity): ``contiguous`` (W runs of blocks), ``zigzag`` (2 W runs, rank r
holding runs r and 2 W - 1 - r: balanced for causal dense attention) or ``stripe`` (block j on rank
j mod W, as MTraining deals them). Each rank holds the queries, keys and values of its blocks.

**Work.** :func:`pair_weights` gives the expected attended (query, key) pairs of every (query block,
key block): a query block's own block causally, and its ``k - 1`` chosen past blocks, each past
block chosen with a probability set by ``selection`` -- ``uniform`` (any past block alike: the
neutral assumption without gate statistics) or ``local`` (the ``k - 1`` most recent, MoBA's
pattern on local text). Summed over all pairs this is exactly ``roofline.moba_pairs``, the count the
kernel cost model prices, so a rank's share of the pairs is its share of the sequence's attention
time (``attention(L, k)`` from the profile): a step's compute is that share, at least a launch
``floor``. No constant is set here: times come from the profile, bytes from the model dims.

**Communication** (:func:`layer_time`):

* ``ring``: step s of rank r works on the keys of rank (r - s) mod W, which its neighbour forwards;
  the next step starts when this rank's step is done and the neighbour's transfer has arrived
  (``start[r, s+1] = max(end[r, s], start[r-1, s] + transfer)``: the transfer of step s+1 overlaps
  the compute of step s). Forward moves K and V (bf16); backward K and V plus dK and dV in fp32
  (as MTraining and Transformer Engine do), and the last hop brings dK/dV home. A hop inside a node
  runs at ``intra`` bytes/s, across nodes at ``inter``.
* ``hierarchical``: ranks grouped by node (``inner`` per node); an inner ring over each node's
  shards, and before each new node's round the shards come over the inter-node link, sent at the
  start of the previous round: one inter-node transfer hidden behind a whole inner ring.
* ``allgather``: K and V all-gathered (ring all-gather, (W-1)/W of the bytes), each rank computes
  its queries against every key; backward gathers again and reduce-scatters dK/dV in fp32.

**Reported** (:class:`RingReport`): the layer's seconds (the slowest rank: every rank needs the
layer before the next), **worker imbalance** = max over ranks of its total compute / the mean,
**step imbalance** = the sum over steps of the slowest rank's step / the sum of the mean step (what
synchronising at every step costs), **exposed communication** = layer time - the same recurrence
with free transfers, and **ring efficiency** = ideal (total compute / W) / layer time. Closed forms
(tests): a contiguous causal dense ring reaches W / (2 W - 1); a dense zigzag ring is balanced at
every step; a stripe layout of a local pattern is balanced within 2 / n.

docs/costmodel.md section 11 states the model and what it leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.simulator.config import CP_COMMS as COMMS
from sparsebalance.simulator.config import CP_LAYOUTS as LAYOUTS
from sparsebalance.simulator.config import CP_SELECTIONS as SELECTIONS

__all__ = [
    "COMMS",
    "LAYOUTS",
    "SELECTIONS",
    "RingReport",
    "combine",
    "groups",
    "layer_time",
    "min_blocks",
    "pair_weights",
    "place",
    "rank_pairs",
    "rank_step_pairs",
    "ring_order",
    "shards",
]


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


def ring_order(cp: int, comm: str, inner: int) -> np.ndarray:
    """[W, W] whose keys rank r holds at step s: ``(r - s) mod W`` on a ring; on the hierarchical
    ring (``inner`` ranks per node, rank = node x inner + local), round o step t holds node
    ``(g - o) mod G``'s local rank ``(i - t) mod inner``."""
    r = np.arange(cp)[:, None]
    s = np.arange(cp)[None, :]
    if comm != "hierarchical":
        return (r - s) % cp
    groups = cp // inner
    g, i = np.divmod(r, inner)
    o, t = np.divmod(s, inner)
    return ((g - o) % groups) * inner + (i - t) % inner


@dataclass(frozen=True, slots=True)
class RingReport:
    """One layer of one micro-batch on a CP group (module docstring); seconds."""

    time: float
    """The layer's seconds: its slowest rank."""
    worker_imbalance: float
    """Max over ranks of a rank's compute / the mean."""
    step_imbalance: float
    """Sum over steps of the slowest rank's step / sum of the mean step (1 = balanced steps)."""
    exposed: float
    """Seconds of communication not hidden behind compute."""
    efficiency: float
    """Ideal (total compute / W) / ``time``."""
    steps: np.ndarray
    """[W, S] seconds of each rank's step."""
    transfers: np.ndarray
    """[W, S + 1] seconds of each rank's incoming transfers: column s < S the one that brings step
    s's keys (ring: 0 at step 0, its own; all-gather: the gather), column S the one after the last
    step (backward: dK/dV's hop home, or the all-gather's reduce-scatter; 0 in the forward)."""
    layout: str = ""
    """The layout it ran on."""
    comm: str = ""
    """The exchange it ran on."""


def _recurrence(t: np.ndarray, transfers: np.ndarray, comm: str, inner: int) -> np.ndarray:
    """[W] end of each rank's last step: ``start[r, s+1] = max(end[r, s], arrival)``, arrival = the
    neighbour's start of step s + ``transfers[r, s+1]`` (ring; inner steps of the hierarchical ring)
    or, at a new node's round, the same local rank of the previous node's start of the previous round
    + ``transfers[r, s+1]`` (the inter-node transfer: :func:`_ring_transfers`)."""
    cp, steps = t.shape
    start = np.zeros((cp, steps))
    prev = (np.arange(cp) - 1) % cp
    if comm == "hierarchical":
        g, i = np.divmod(np.arange(cp), inner)
        prev = g * inner + (i - 1) % inner
        prev_node = ((g - 1) % (cp // inner)) * inner + i
    for s in range(steps - 1):
        end = start[:, s] + t[:, s]
        if comm == "hierarchical" and (s + 1) % inner == 0:
            begin = s + 1 - inner  # the previous round's first step
            arrival = start[prev_node, begin] + transfers[:, s + 1]
        else:
            arrival = start[prev, s] + transfers[:, s + 1]
        start[:, s + 1] = np.maximum(end, arrival)
    return start[:, -1] + t[:, -1]


def _ring_transfers(steps: int, hop: np.ndarray, inter_hop: np.ndarray, home_hop: np.ndarray | float, comm: str,
                    inner: int) -> np.ndarray:
    """[W, steps + 1] (``RingReport.transfers``): none before step 0 (a rank's own keys), the hop before
    each later step -- over the inter-node link at each new node's round of the hierarchical ring --
    and ``home_hop`` after the last."""
    out = np.zeros((len(hop), steps + 1))
    for s in range(1, steps):
        out[:, s] = inter_hop if comm == "hierarchical" and s % inner == 0 else hop
    out[:, -1] = home_hop
    return out


def layer_time(pairs: np.ndarray, seconds: float, floor: float, *, comm: str, kv_bytes: np.ndarray,
               intra: float, inter: float, latency: float, inner: int, backward: bool,
               layout: str = "", grad_ratio: float = 2.0) -> RingReport:
    """One layer on a CP group. ``pairs`` [W, S] per (rank, step) (:func:`rank_step_pairs`; for
    ``allgather`` S = 1: each rank's pairs against every key); ``seconds``: the attention of the
    whole on one GPU (the profile's), split in proportion to the pairs, each step at least
    ``floor``; ``kv_bytes`` [W]: K and V bytes of each rank's shard; ``intra`` / ``inter``:
    bytes/s inside and across nodes; ``latency``: seconds per transfer; ``inner``: ranks of the group
    per node; ``grad_ratio``: bytes of dK + dV per byte of K + V (fp32 gradients: 2 for bf16 K/V, 1
    for fp32)."""
    cp = len(pairs)
    total = pairs.sum()
    t = np.maximum(seconds * pairs / total if total > 0 else 0.0 * pairs, floor)
    node = np.arange(cp) // max(inner, 1)
    bw_in = np.where(node == node[(np.arange(cp) - 1) % cp], intra, inter)  # rank r's incoming hop
    grad = grad_ratio if backward else 0.0  # dK and dV (fp32) ride along in the backward
    if comm == "allgather":
        full = kv_bytes.sum()
        slow = inter if node.max() > 0 else intra
        gather = latency * (cp - 1) + (cp - 1) / cp * full / slow
        scatter = (latency * (cp - 1) + (cp - 1) / cp * grad_ratio * full / slow) if backward else 0.0
        busy = t[:, 0]
        time = gather + float(busy.max()) + scatter
        ideal = float(busy.sum()) / cp
        transfers = np.repeat([[gather, scatter]], cp, axis=0)
        return RingReport(time=time, worker_imbalance=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
                          step_imbalance=1.0, exposed=gather + scatter, efficiency=ideal / time if time > 0 else 1.0,
                          steps=t, transfers=transfers, layout=layout, comm=comm)
    src = (np.arange(cp) - 1) % cp
    if comm == "hierarchical":
        g, i = np.divmod(np.arange(cp), inner)
        src = g * inner + (i - 1) % inner
    hop = latency + kv_bytes[src] * (1 + grad) / np.where(comm == "hierarchical", intra, bw_in)
    prev_node = ((np.arange(cp) // inner - 1) % max(cp // inner, 1)) * inner + np.arange(cp) % inner
    inter_hop = latency + kv_bytes[prev_node] * (1 + grad) / inter
    home_hop = latency + kv_bytes * grad / bw_in if backward else 0.0  # dK/dV's last hop home
    transfers = _ring_transfers(t.shape[1], hop, inter_hop, home_hop, comm, inner)
    end = _recurrence(t, transfers, comm, inner)
    free = _recurrence(t, 0.0 * transfers, comm, inner)
    time = float(end.max()) + float(transfers[:, -1].max())
    busy = t.sum(axis=1)
    steps_max, steps_mean = t.max(axis=0).sum(), t.mean(axis=0).sum()
    ideal = float(busy.sum()) / cp
    return RingReport(time=time, worker_imbalance=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
                      step_imbalance=float(steps_max / steps_mean) if steps_mean > 0 else 1.0,
                      exposed=time - float(free.max()), efficiency=ideal / time if time > 0 else 1.0, steps=t,
                      transfers=transfers, layout=layout, comm=comm)


def combine(reports: list[RingReport]) -> dict[str, float]:
    """The CP figures of a micro-batch whose sequences run their rings one after another (how the
    latency model prices a packed micro-batch): seconds and exposed seconds add; worker and step
    imbalance are the slowest rank's (step's) sum over the mean's; efficiency the ideal's sum over
    the time's. Empty (no split sequence): imbalances 1, efficiency 1, seconds 0."""
    if not reports:
        return {"cp_time_s": 0.0, "cp_exposed_s": 0.0, "cp_worker_imbalance": 1.0, "cp_step_imbalance": 1.0,
                "cp_efficiency": 1.0}
    busy_max = sum(float(r.steps.sum(axis=1).max()) for r in reports)
    busy_mean = sum(float(r.steps.sum(axis=1).mean()) for r in reports)
    step_max = sum(float(r.steps.max(axis=0).sum()) for r in reports)
    step_mean = sum(float(r.steps.mean(axis=0).sum()) for r in reports)
    time = sum(r.time for r in reports)
    return {"cp_time_s": time, "cp_exposed_s": sum(r.exposed for r in reports),
            "cp_worker_imbalance": busy_max / busy_mean if busy_mean > 0 else 1.0,
            "cp_step_imbalance": step_max / step_mean if step_mean > 0 else 1.0,
            "cp_efficiency": sum(r.efficiency * r.time for r in reports) / time if time > 0 else 1.0}


def place(cost: np.ndarray, degrees: tuple[int, ...], cp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A CP degree and an aligned rank group for each sequence of a micro-batch (``cp_split =
    "per-sequence"``). ``cost`` [N, D]: seconds each rank of the group spends on sequence i at degree
    ``degrees[j]`` (inf where it may not take it); ``degrees`` ascending, each dividing ``cp``, their
    aligned groups nested. Returns (degree [N], first rank [N], load [cp] seconds per rank).

    Degrees are searched, groups follow from them (:func:`groups`: by decreasing degree, then cost,
    each sequence on the aligned group whose busiest rank ends first). Steepest descent over one
    sequence's degree one allowed step up or down, minimising the makespan, then the total work (a
    ring's transfers and launch floors are work the other ranks could do), from three starts: every
    sequence at its least allowed degree; at its largest (the whole group where it may, as ``cp_split
    = "whole"``); and the least raised while a sequence's per-rank cost exceeds the lower bound on
    the makespan (the mean load, and the largest of the pieces' least costs). Within 1.25x of the
    optimum on enumerated small cases (tests). A rank's load is the sum of its pieces, which is the
    time it needs when a layer's rings run in decreasing degree: every rank of a group has then done
    the same larger rings (the groups nest), so a ring's ranks start it together."""
    cost = np.asarray(cost, dtype=float)
    n = cost.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(cp)
    finite = np.isfinite(cost)
    if not finite.any(axis=1).all():
        raise ValueError("place: every sequence needs at least one degree it may take")
    deg = np.asarray(degrees, dtype=np.int64)
    rows = np.arange(n)
    up = [[q for q in range(len(degrees)) if finite[i, q]] for i in range(n)]  # allowed, ascending

    def score(j):
        start, load = groups(cost[rows, j], deg[j], cp)
        return (float(load.max()), float((deg[j] * cost[rows, j]).sum())), start, load, j

    def descend(j):  # steepest descent over one sequence's degree one allowed step up or down
        best = score(j)
        while True:
            moves = []
            for i in range(n):
                at = up[i].index(int(best[3][i]))
                for q in (at - 1, at + 1):
                    if 0 <= q < len(up[i]):
                        x = best[3].copy()
                        x[i] = up[i][q]
                        moves.append(score(x))
            if not moves:
                return best
            step = min(moves, key=lambda t: t[0])
            if not step[0] < best[0]:
                return best
            best = step

    least = np.array([u[0] for u in up])
    floor = float(np.where(finite, cost, np.inf).min(axis=1).max())  # no makespan is below any piece's least
    j = least.copy()
    for _ in range(len(degrees)):
        c = cost[rows, j]
        target = max(float((deg[j] * c).sum()) / cp, floor)
        step = np.array([next((q for q in up[i] if q > x), -1) for i, x in enumerate(j.tolist())])
        grow = (c > target) & (step >= 0)
        if not grow.any():
            break
        j = np.where(grow, step, j)
    starts = {tuple(x.tolist()): x for x in (j, least, np.array([u[-1] for u in up]))}
    _, start, load, j = min((descend(x) for x in starts.values()), key=lambda t: t[0])
    return deg[j], start, load


def groups(c: np.ndarray, d: np.ndarray, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """(first rank [N], load [cp]): sequences of per-rank cost ``c`` at degrees ``d``, by decreasing
    degree then cost (then index), each on the aligned group of ``d`` ranks whose busiest rank ends
    first (the lower rank on ties)."""
    start = np.zeros(len(c), dtype=np.int64)
    load = np.zeros(cp)
    for i in np.lexsort((np.arange(len(c)), -c, -d)).tolist():
        w = int(d[i])
        g = int(np.argmin(load.reshape(-1, w).max(axis=1)))
        start[i] = g * w
        load[g * w:(g + 1) * w] += c[i]
    return start, load
