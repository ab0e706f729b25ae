"""A layer on a CP group, step by step: the ring recurrence, its transfers and what it reports.

Given the seconds of each rank's step (each a kernel call of its own, :mod:`.calls`),
:func:`layer_time` times the exchange: each transfer's ``latency + bytes / bandwidth`` and the
recurrence of steps and hops.

**Communication**:

* ``ring``: step s of rank r works on the keys of rank (r - s) mod W, which its neighbour forwards;
  the next step starts when this rank's step is done and the neighbour's transfer has arrived
  (``start[r, s+1] = max(end[r, s], start[r-1, s] + transfer)``: the transfer of step s+1 overlaps
  the compute of step s). A sparse budget first exchanges the gate's pooled block means (one
  all-reduce over the group, :func:`gate_time`): every rank's step 0 waits for it. Forward moves K
  and V (bf16); backward K and V plus dK and dV in fp32 (as MTraining and Transformer Engine do),
  and the last hop brings dK/dV home. A hop inside a node runs at ``intra`` bytes/s, across nodes at
  ``inter``.
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
every step; a stripe layout of a local pattern is balanced within 2 / n. :func:`combine` joins
rings that run one after another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.simulator.config import CP_COMMS as COMMS

__all__ = ["COMMS", "RingReport", "combine", "gate_time", "layer_time", "ring_order"]


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
    start[:, 0] = transfers[:, 0]  # a ring's gate exchange (0 without one): every step 0 waits for it
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


def layer_time(t: np.ndarray, *, comm: str, kv_bytes: np.ndarray,
               intra: float, inter: float, latency: float, inner: int, backward: bool,
               layout: str = "", grad_ratio: float = 2.0, gate: float = 0.0) -> RingReport:
    """One layer on a CP group. ``t`` [W, S]: seconds of each rank's step (:func:`.calls.step_times`;
    for ``allgather`` S = 1: each rank's one call against every key); ``kv_bytes`` [W]: K and V
    bytes of each rank's shard; ``intra`` / ``inter``:
    bytes/s inside and across nodes; ``latency``: seconds per transfer; ``inner``: ranks of the group
    per node; ``grad_ratio``: bytes of dK + dV per byte of K + V (fp32 gradients: 2 for bf16 K/V, 1
    for fp32); ``gate``: seconds of a ring's gate exchange before its first step (forward; MoBA's
    pooled block means all-reduced over the group so that every rank gates its queries against
    every block: :func:`gate_time`), transfer 0 of every rank."""
    t = np.asarray(t, dtype=float)
    cp = len(t)
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
    transfers[:, 0] = 0.0 if backward else gate
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


GATE_BYTES = 4
"""Bytes per element of the gate's pooled block sums and counts (fp32, ``kernels/moba/cp_ring.py``)."""


def gate_time(n_blocks: int, kv_heads: int, head_dim: int, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of a MoBA ring's gate exchange: one ring all-reduce over the ``ranks`` of the group of
    every block's key sum (``kv_heads`` x ``head_dim``) and token count, fp32: ``latency`` +
    2 (n - 1) / n x bytes / ``bandwidth`` (the group's link, ``link.group_link``)."""
    nbytes = GATE_BYTES * n_blocks * (kv_heads * head_dim + 1)
    return latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def combine(reports: list[RingReport]) -> dict[str, float]:
    """The CP figures of a micro-batch whose sequences run their rings one after another
    (``cp_split = "per-sequence"``; the whole split runs one ring, ``CPPricing.joint``): seconds and
    exposed seconds add; worker and step imbalance are the slowest rank's (step's) sum over the
    mean's; efficiency the ideal's sum over the time's. Empty (no split sequence): imbalances 1,
    efficiency 1, seconds 0."""
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
