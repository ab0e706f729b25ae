"""What a sequence's attention costs on its CP group: the ring (or all-gather) of section 11 priced
from the profile, folded into the latency model's tables once.

**The fold** (:meth:`CPPricing.fold`, ``cluster.cp > 1``, docs/costmodel.md section 11): every
per-token op runs on 1/cp of the tokens (its curve's token axis stretched by cp:
``Layout.group_tokens``), and attention at each profiled (length, budget) becomes the CP group's
layer time (:meth:`CPPricing.report`, from the profile's one-GPU time at that point), so every
consumer prices CP through the usual ops. A sequence too short for the layout stays whole on one
rank (the one-GPU surface). With ``cp_split = "per-sequence"`` the degrees below cp get surfaces of
their own (:meth:`CPPricing.attention_at_degree`).

**A layer on the group** (:meth:`CPPricing.report`): the pairs each rank computes at each step
(:mod:`.shards`), each step priced as a kernel call of its own with its merge or gradient
accumulation (:mod:`.calls`: the profile's one-GPU calls give the per-pair rate by call size, the
sidecar's per-call fixed part is paid at every step), and the ring recurrence with its transfers
(:mod:`.ring`). ``cp_layout = "best"``: per sequence and budget the candidate (zigzag or stripe on
``cp_comm``, or all-gather) with the least forward + backward time. Where the profile has CP
rows for this group, the calls' variable part is scaled by the measured ratio of the group's work to
the one-GPU time (:meth:`CPPricing.group_work`). Where the profile has measured ring steps
(``attn_*_cp_step``), a ring's step is priced at the seconds per pair of the measured step call of
its size instead, their merge or accumulation and launches included (:meth:`CPPricing.price`).
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.cp.calls import CallPrice, step_times
from sparsebalance.simulator.cost.cp.ring import RingReport, gate_time, layer_time, ring_order
from sparsebalance.simulator.cost.cp.shards import block_sizes, min_blocks, rank_pairs, shards
from sparsebalance.simulator.cost.hardware import Hardware
from sparsebalance.simulator.cost.link import group_link
from sparsebalance.simulator.cost.roofline import moba_pairs
from sparsebalance.simulator.cost.tables import ATTENTION, Curve, OpTables, Surface
from sparsebalance.simulator.layout import Layout

LAUNCH = next(f.default for f in fields(Hardware) if f.name == "launch_overhead")
"""Seconds per kernel launch of the merge and accumulation when the profile has no roofline."""


class CPPricing:
    """CP attention of one latency model's tables (module docstring); :meth:`fold` once, then
    reports and per-degree attention on demand (cached)."""

    def __init__(self, tables: OpTables, model: ModelConfig, cluster: ClusterConfig, layout: Layout) -> None:
        self.tables, self.model, self.cluster, self.layout = tables, model, cluster, layout
        self.block_size = model.block_size
        self.floor: dict[bool, float] = {}
        """Per pass: the least variable seconds of a ring step's call, the profile's cheapest point."""
        self.call: dict[bool, float] = {}
        """Per pass: the per-call fixed seconds every ring step's call pays (``OpTables.call`` at the
        fold, before recomputation adds the forward's to the backward's)."""
        meta = tables.profile.meta
        self.bandwidth = float(meta.memory_bandwidth) if meta.memory_bandwidth else float("inf")
        """Bytes/s of the merge and accumulation (the sidecar's effective HBM bandwidth; a sidecar
        without one leaves their bytes unpriced, said in the tables' notes at the fold)."""
        self.launch = float((meta.roofline or {}).get("launch_overhead", LAUNCH))
        """Seconds per kernel of the merge and accumulation (the roofline's, else its default)."""
        self._prices: dict[tuple[int, bool, bool], CallPrice] = {}
        self._reports: dict[tuple[int, int, bool, int], RingReport | None] = {}
        self._one_gpu: dict[bool, Surface] = {}
        self.degree_surfaces: dict[int, dict[bool, Surface]] = {}
        """Per CP degree d < cp (with CP): one layer's attention of a sequence on d ranks, per pass, on
        the profile's grid (d = 1: one GPU; recomputation folded in like the main surfaces)."""
        self._degree_attn: dict[tuple[int, int, int, bool], float] = {}
        self.description = ("the one-GPU attention rows split by pair counts" if not tables.cp_work else
                            f"the profile's measured CP rows (attn_*_cp) on all-gather groups of cp "
                            f"{meta.cp} laid out {meta.cp_layout}; the one-GPU rows split by "
                            "pair counts elsewhere")
        """What prices CP attention work (``cluster.cp`` > 1), in words: the profile's ``attn_*_cp``
        rows where they match the group (degree, layout, all-gather), else the one-GPU rows split by
        pairs (:meth:`group_work`); a ring's steps by the measured ``attn_*_cp_step`` calls."""
        if tables.cp_steps:
            self.description += ("; ring steps at the profile's measured step calls (attn_*_cp_step) "
                                 "by their pairs, merge and accumulation included")

    def fold(self) -> None:
        """Fold CP into the tables (module docstring); nothing without CP."""
        c, t = self.cluster, self.tables
        if c.cp == 1:
            return
        t.whole_max = (min_blocks(c.cp_layout, c.cp) - 1) * self.block_size
        # a ring step costs at least the profile's cheapest attention point (a near-empty call)
        self.floor = {bw: min(min(row) for row in t.surfaces[op].zs) for bw, op in ATTENTION.items()}
        self.call = dict(t.call)
        if self.bandwidth == float("inf") and not t.cp_steps:
            note = (f"profile {t.profile.source} has no memory_bandwidth: CP ring steps' merge and "
                    "gradient accumulation bytes are not priced (only their launches)")
            t.notes.append(note)
        for op, curve in list(t.curves.items()):
            if op != "optim":
                t.curves[op] = Curve([self.layout.group_tokens(x) for x in curve.xs], curve.ys)
        for bw, op in ATTENTION.items():  # the one-GPU surfaces, kept for report
            self._one_gpu[bw] = t.surfaces[op].copy()
        degrees = [1] + ([d for d in c.cp_degrees if 1 < d < c.cp] if c.cp_split == "per-sequence" else [])
        for d in degrees:  # before the fold below replaces the main surfaces' values
            self.degree_surfaces[d] = {bw: self._surface(self._one_gpu[bw], bw, d) for bw in (False, True)}
        for bw, op in ATTENTION.items():
            surf = t.surfaces[op]
            surf.zs = self._surface(surf, bw, c.cp).zs
        t.whole = self.degree_surfaces[1]

    def _surface(self, one: Surface, backward: bool, degree: int) -> Surface:
        """A copy of the one-GPU surface ``one`` whose points are one layer's time of the sequence on
        ``degree`` CP ranks (the one-GPU value where the sequence stays whole, and at degree 1)."""
        return Surface(one.xs, one.ks, [[z if degree == 1 or (rep := self.report(int(x), int(k), backward=backward,
                                                                                 degree=degree)) is None
                                         else rep.time for k, z in zip(one.ks, row)]
                                        for x, row in zip(one.xs, one.zs)])

    def report(self, L: int, k: int, *, backward: bool = False, degree: int | None = None) -> RingReport | None:
        """One layer of a sequence of ``L`` tokens at budget ``k`` on the CP group (with the layout
        and comm it ran on), or None when the sequence is too short for the layout and stays whole
        on one rank. ``cp_layout = "best"``: the candidate (zigzag or stripe on ``cp_comm``, or
        all-gather) with the least forward + backward time for this sequence and budget, the same
        for both passes. ``degree``: on an aligned group of that many of the CP ranks (default: all
        ``cp``; ``cp_split = "per-sequence"``), a ring inside one node when the group fits in one."""
        c = self.cluster
        d = c.cp if degree is None else int(degree)
        k = self.tables.effective_budget(L, k)
        key = (L, k, backward, d)
        hit = self._reports.get(key)
        if hit is not None or c.cp == 1 or d == 1:
            return hit
        n = blocks(L, self.block_size)
        if n < min_blocks(c.cp_layout, d):
            return None
        comm = c.cp_comm if d > c.cp_ranks_per_node or c.cp_comm != "hierarchical" else "ring"
        if c.cp_layout != "best":
            rep = self._layer(L, k, c.cp_layout, comm, backward, d)
        else:
            cands = [(lay, comm) for lay in ("zigzag", "stripe") if n >= min_blocks(lay, d)]
            cands += [("stripe", "allgather")] if comm != "allgather" else []
            both = [(self._layer(L, k, lay, cm, False, d), self._layer(L, k, lay, cm, True, d))
                    for lay, cm in dict.fromkeys(cands)]
            f, b = min(both, key=lambda fb: fb[0].time + fb[1].time)
            self._reports[(L, k, False, d)], self._reports[(L, k, True, d)] = f, b
            return b if backward else f
        self._reports[key] = rep
        return rep

    def _layer(self, L: int, k: int, layout: str, comm: str, backward: bool, degree: int) -> RingReport:
        c, m = self.cluster, self.model
        n = blocks(L, self.block_size)
        inner = min(c.cp_ranks_per_node, degree)
        pairs = rank_pairs(L, self.block_size, k, degree, layout, c.cp_selection)
        sizes = block_sizes(L, self.block_size)
        tokens = np.array([sizes[part].sum() for part in shards(n, degree, layout)])
        if comm == "allgather":  # one call per rank: its queries against every key
            steps, k_len = pairs.sum(axis=1, keepdims=True), np.full((degree, 1), tokens.sum())
        else:
            order = ring_order(degree, comm, inner)
            steps, k_len = np.take_along_axis(pairs, order, axis=1), tokens[order]
        heads, kv_heads = -(-m.heads // c.tp), -(-m.kv_heads // c.tp)
        kv_dim = kv_heads * m.head_dim
        one = self.tables.read(self._one_gpu[backward], ATTENTION[backward], L, k)
        work = self.group_work(L, k, backward, layout, comm, degree)
        measured = comm != "allgather" and backward in self.tables.cp_steps  # merge, launches inside
        t = step_times(steps, tokens, k_len, self.price(k, backward, steps=measured), backward=backward,
                       allgather=comm == "allgather", merge=c.cp_merge, heads=heads, kv_heads=kv_heads,
                       head_dim=m.head_dim, bandwidth=float("inf") if measured else self.bandwidth,
                       launch=0.0 if measured else self.launch, scale=work / one if one > 0 else 1.0)
        gate = 0.0
        if not backward and comm != "allgather" and k < n:  # a sparse budget gates every query first
            bandwidth, lat = group_link(c, degree, "allreduce")
            gate = gate_time(n, kv_heads, m.head_dim, degree, bandwidth, lat)
        return layer_time(t, comm=comm, kv_bytes=tokens * 2 * kv_dim * m.dtype_bytes, intra=c.tp_bandwidth,
                          inter=c.p2p_bandwidth, latency=c.p2p_latency, inner=inner,
                          backward=backward, layout=layout,
                          grad_ratio=max(4, m.dtype_bytes) / m.dtype_bytes, gate=gate)  # dK/dV in fp32

    def price(self, k: int, backward: bool, *, steps: bool = False) -> CallPrice:
        """The price of one attention call at budget ``k`` by its pairs (:class:`.calls.CallPrice`):
        the one-GPU calls at the profile's lengths (each at its effective budget), the fixed part
        of the fold's ``OpTables.call``; with ``steps``, the profile's measured ring-step calls
        (``attn_*_cp_step``) at the measured budget nearest ``k`` (by ratio), whose times hold
        their fixed costs (no fixed part on top) and whose cheapest is the floor."""
        key = (k, backward, steps)
        hit = self._prices.get(key)
        if hit is None and steps:
            rows = self.tables.cp_steps[backward]
            budgets = sorted(int(b) for b in rows["budget"].unique())
            near = min(budgets, key=lambda b: (abs(np.log(b / max(k, 1))), b))
            at = rows[rows["budget"] == near]
            hit = self._prices[key] = CallPrice.of(at["seq_len"], at["latency_s"], fixed=0.0,
                                                   floor=float(at["latency_s"].min()))
        if hit is None:
            one, B = self._one_gpu[backward], self.block_size
            xs = [int(x) for x in one.xs if x >= 1]
            kk = [min(k, blocks(x, B)) for x in xs]
            secs = [one(float(x), min(max(float(b), one.ks[0]), one.ks[-1])) for x, b in zip(xs, kk)]
            pairs = [float(moba_pairs(x, B, b)) for x, b in zip(xs, kk)]
            hit = self._prices[key] = CallPrice.of(pairs, secs, fixed=self.call.get(backward, 0.0),
                                                   floor=self.floor[backward])
        return hit

    def group_work(self, L: int, k: int, backward: bool, layout: str, comm: str, degree: int) -> float:
        """Seconds of a CP group's attention work on one sequence (summed over its ranks, before
        :func:`.ring.layer_time` spreads it over ranks and steps by pairs). The one-GPU time, times
        the measured ratio of the group's work to it where the profile has CP rows for this group
        (``attn_*_cp``: degree, layout, all-gather; the CP path's own work, such as placing every
        rank's K/V and a partial layout's fixed costs), read at the nearest profiled point: the ratio
        holds below the shortest split length of the grid and above its longest."""
        t = self.tables
        one = t.read(self._one_gpu[backward], ATTENTION[backward], L, k)
        work, meta = t.cp_work.get(backward), t.profile.meta
        if work is None or (comm, degree, layout) != ("allgather", meta.cp, meta.cp_layout):
            return one
        x = min(max(float(L), work.xs[0]), work.xs[-1])
        kk = min(max(float(k), work.ks[0]), work.ks[-1])
        base = self._one_gpu[backward](x, kk)
        return one * work(x, kk) / base if base > 0 else one

    def attention_at_degree(self, seq_len: int, budget: int, degree: int, *, backward: bool = False) -> float:
        """One layer's attention of one sequence split over ``degree`` < cp of the CP ranks (seconds;
        ``cp_split = "per-sequence"``): the degree's own surface, the one-GPU one at 1
        (recomputation folded in alike)."""
        key = (seq_len, budget, degree, backward)
        hit = self._degree_attn.get(key)
        if hit is None:
            t = self.tables
            k = t.effective_budget(seq_len, budget)
            hit = self._degree_attn[key] = t.read(self.degree_surfaces[degree][backward], ATTENTION[backward],
                                                  seq_len, k)
        return hit
