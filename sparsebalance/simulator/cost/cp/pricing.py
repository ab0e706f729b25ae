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

**A packed micro-batch runs one ring** (:meth:`CPPricing.joint`, ``cp_split = "whole"``): each
rank's step one call on every sequence it holds (each sequence's work at the rate of a call of its
own size, the fixed part once), one hop of every sequence's K/V, one gate exchange, a sequence too
short for the layout whole on rank ``i mod cp`` (as the real run deals it). The tables keep one sequence's ring; :meth:`CPPricing.joint_delta` (the joint ring
less each sequence alone) is what ``StageCost`` adds once per micro-batch of two or more.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.cp.calls import CallPrice, step_times, step_work
from sparsebalance.simulator.cost.cp.ring import RingReport, gate_time, layer_time, ring_order
from sparsebalance.simulator.cost.cp.shards import block_sizes, min_blocks, rank_pairs, shards
from sparsebalance.simulator.cost.hardware import Hardware
from sparsebalance.simulator.cost.link import group_link
from sparsebalance.simulator.cost.roofline import moba_pairs
from sparsebalance.simulator.cost.tables import ATTENTION, Curve, OpTables, Surface
from sparsebalance.simulator.layout import Layout


@dataclass(frozen=True, slots=True)
class _Part:
    """One sequence's share of a ring (:meth:`CPPricing._part`): W ranks, S steps."""

    steps: np.ndarray
    """[W, S] pairs each rank attends at each step (ring order; all-gather: S = 1)."""
    tokens: np.ndarray
    """[W] tokens (queries, and keys carried round) each rank holds."""
    k_len: np.ndarray
    """[W, S] keys each rank holds at each step."""
    scale: float
    """The measured CP work ratio of its calls' variable part (1 without one)."""
    blocks: int
    """Its key blocks (what the gate's exchange carries)."""
    sparse: bool
    """Whether its budget is below its block count (then the ring gates first)."""
    budget: int
    """Its effective budget (its calls are priced at it)."""


LAUNCH = next(f.default for f in fields(Hardware) if f.name == "launch_overhead")
"""Seconds per kernel launch of the merge and accumulation when the profile has no roofline."""


def _fastest(both: list[tuple[RingReport, RingReport]]) -> tuple[RingReport, RingReport]:
    """The (forward, backward) pair with the least forward + backward time (the first on a tie)."""
    return min(both, key=lambda fb: fb[0].time + fb[1].time)


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
        self._joint: dict[tuple[tuple[int, ...], int, bool], RingReport] = {}
        self._deltas: dict[tuple[tuple[int, ...], int, bool], float] = {}
        self._parts: dict[tuple, _Part] = {}
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
        cands = self._candidates(d, n)
        if len(cands) == 1:
            rep = self._reports[key] = self._layer(L, k, *cands[0], backward, d)
            return rep
        f, b = _fastest([(self._layer(L, k, lay, cm, False, d), self._layer(L, k, lay, cm, True, d))
                         for lay, cm in cands])
        self._reports[(L, k, False, d)], self._reports[(L, k, True, d)] = f, b
        return b if backward else f

    def _candidates(self, degree: int, n: int | None = None) -> list[tuple[str, str]]:
        """(layout, comm) pairs a layer on ``degree`` ranks may run on: the configured pair (a ring
        inside one node when the group fits in one), or with ``cp_layout = "best"`` zigzag and
        stripe on that comm (those a sequence of ``n`` blocks is long enough for) and the
        all-gather."""
        c = self.cluster
        comm = c.cp_comm if degree > c.cp_ranks_per_node or c.cp_comm != "hierarchical" else "ring"
        if c.cp_layout != "best":
            return [(c.cp_layout, comm)]
        cands = [(lay, comm) for lay in ("zigzag", "stripe") if n is None or n >= min_blocks(lay, degree)]
        return list(dict.fromkeys(cands + [("stripe", "allgather")]))

    def _layer(self, L: int, k: int, layout: str, comm: str, backward: bool, degree: int) -> RingReport:
        return self._ring([self._part(L, k, layout, comm, backward, degree)], layout, comm, backward, degree)

    def _part(self, L: int, k: int, layout: str, comm: str, backward: bool, degree: int,
              home: int | None = None) -> _Part:
        """What one sequence of ``L`` tokens at budget ``k`` brings to a ring's steps: split by
        ``layout`` over ``degree`` ranks, or, with ``home``, whole on that rank (its keys attended
        at its own step 0 only, carried round the ring like the rest)."""
        key = (L, k, layout, comm, backward, degree, home)
        hit = self._parts.get(key)
        if hit is not None:
            return hit
        c = self.cluster
        n = blocks(L, self.block_size)
        inner = min(c.cp_ranks_per_node, degree)
        order = ring_order(degree, comm, inner) if comm != "allgather" else None
        if home is None:
            pairs = rank_pairs(L, self.block_size, k, degree, layout, c.cp_selection)
            sizes = block_sizes(L, self.block_size)
            tokens = np.array([sizes[part].sum() for part in shards(n, degree, layout)])
            one = self.tables.read(self._one_gpu[backward], ATTENTION[backward], L, k)
            work = self.group_work(L, k, backward, layout, comm, degree)
            scale = work / one if one > 0 else 1.0
        else:
            pairs = np.zeros((degree, degree))
            pairs[home, home] = float(moba_pairs(L, self.block_size, min(k, n)))
            tokens = np.zeros(degree)
            tokens[home] = float(L)
            scale = 1.0
        if order is None:  # one call per rank: its queries against every key
            steps, k_len = pairs.sum(axis=1, keepdims=True), np.full((degree, 1), tokens.sum())
        else:
            steps, k_len = np.take_along_axis(pairs, order, axis=1), tokens[order]
        hit = self._parts[key] = _Part(steps=steps, tokens=tokens, k_len=k_len, scale=scale, blocks=n,
                                       sparse=k < n, budget=k)
        return hit

    def _ring(self, parts: list[_Part], layout: str, comm: str, backward: bool, degree: int) -> RingReport:
        """One layer of ``parts`` (one sequence's, or a packed micro-batch's) on one ring or
        all-gather: each rank's step one call on every part's pairs (each part's work at the rate of
        a call of its own size, the fixed part and the merge's launches once), one hop of every
        part's K/V, one gate exchange (module docstring)."""
        c, m = self.cluster, self.model
        inner = min(c.cp_ranks_per_node, degree)
        steps = np.sum([p.steps for p in parts], axis=0)
        tokens = np.sum([p.tokens for p in parts], axis=0)
        k_len = np.sum([p.k_len for p in parts], axis=0)
        heads, kv_heads = -(-m.heads // c.tp), -(-m.kv_heads // c.tp)
        kv_dim = kv_heads * m.head_dim
        measured = comm != "allgather" and backward in self.tables.cp_steps  # merge, launches inside
        prices = [self.price(p.budget, backward, steps=measured) for p in parts]
        # each sequence's work at the rate of its own call's size, the call's fixed part (the same at
        # every budget) once per step
        work = np.sum([step_work(p.steps, price, p.scale) for p, price in zip(parts, prices)], axis=0)
        t = step_times(steps, tokens, k_len, prices[0], backward=backward,
                       allgather=comm == "allgather", merge=c.cp_merge, heads=heads, kv_heads=kv_heads,
                       head_dim=m.head_dim, bandwidth=float("inf") if measured else self.bandwidth,
                       launch=0.0 if measured else self.launch, work=work)
        gate = 0.0
        if not backward and comm != "allgather" and any(p.sparse for p in parts):
            # a sparse budget gates every query first: every block's pooled keys all-reduced
            bandwidth, lat = group_link(c, degree, "allreduce")
            gate = gate_time(sum(p.blocks for p in parts), kv_heads, m.head_dim, degree, bandwidth, lat)
        return layer_time(t, comm=comm, kv_bytes=tokens * 2 * kv_dim * m.dtype_bytes, intra=c.tp_bandwidth,
                          inter=c.p2p_bandwidth, latency=c.p2p_latency, inner=inner,
                          backward=backward, layout=layout,
                          grad_ratio=max(4, m.dtype_bytes) / m.dtype_bytes, gate=gate)  # dK/dV in fp32

    def joint(self, lengths, k: int, *, backward: bool = False) -> RingReport | None:
        """One layer of a packed micro-batch of ``lengths`` at budget ``k`` on the CP group, as the
        real run (``kernels/moba/cp_ring.py``) and Transformer Engine's packed (THD) context
        parallelism run it: **one ring for the micro-batch**. Each rank's step is one call on the
        pairs of every sequence it holds at that step, a hop carries every sequence's K/V, the gate
        exchanges every block's pooled keys once; a sequence too short for the layout stays whole on
        rank ``i mod cp`` (its place in the micro-batch, as ``cp.cp_token_index`` puts it) and is
        attended in that rank's first step. ``cp_layout = "best"``: the candidate with the least
        forward + backward time for the whole micro-batch. None without CP, under ``cp_split =
        "per-sequence"`` (each sequence its own group) or without a sequence."""
        c = self.cluster
        docs = tuple(int(L) for L in lengths)
        if c.cp == 1 or c.cp_split != "whole" or not docs:
            return None
        key = (docs, int(k), backward)
        hit = self._joint.get(key)
        if hit is not None:
            return hit
        cands = self._candidates(c.cp)  # a sequence too short for a candidate's layout stays whole
        if len(cands) == 1:
            rep = self._joint[key] = self._joint_ring(docs, k, *cands[0], backward)
            return rep
        f, b = _fastest([(self._joint_ring(docs, k, lay, cm, False), self._joint_ring(docs, k, lay, cm, True))
                         for lay, cm in cands])
        self._joint[(docs, int(k), False)], self._joint[(docs, int(k), True)] = f, b
        return b if backward else f

    def _joint_ring(self, docs: tuple[int, ...], k: int, layout: str, comm: str, backward: bool) -> RingReport:
        c = self.cluster
        parts = [self._part(L, self.tables.effective_budget(L, k), layout, comm, backward, c.cp,
                            home=None if blocks(L, self.block_size) >= min_blocks(layout, c.cp) else i % c.cp)
                 for i, L in enumerate(docs)]
        return self._ring(parts, layout, comm, backward, c.cp)

    def joint_delta(self, lengths, k: int, *, backward: bool = False) -> float:
        """Seconds that running a packed micro-batch's sequences on one ring (:meth:`joint`) adds to
        one layer's attention summed one after another (what the tables hold; mostly negative):
        the joint ring's time less each sequence's on its own -- its ring (:meth:`report`), or for
        one that stays whole, its one call -- priced alike. 0.0 for a micro-batch of one sequence
        (the same ring). The backward's includes the forward's where recomputation folds the
        forward into it (``OpTables.fold_recompute``)."""
        docs = tuple(int(L) for L in lengths)
        if len(docs) < 2 or self.joint(docs, k) is None:
            return 0.0
        key = (docs, int(k), backward)
        hit = self._deltas.get(key)
        if hit is None:
            passes = (False, True) if backward and str(self.cluster.recompute) != "none" else (backward,)
            joint, alone = 0.0, 0.0
            for bw in passes:
                rep = self.joint(docs, k, backward=bw)
                assert rep is not None  # CP with the whole split, as checked above
                joint += rep.time
                alone += sum(self._alone(L, k, bw) for L in docs)
            hit = self._deltas[key] = joint - alone
        return hit

    def _alone(self, L: int, k: int, backward: bool) -> float:
        """One layer of a sequence on its own: its ring (:meth:`report`), or, too short for the
        layout, its one call on one rank (priced as a ring step's call)."""
        rep = self.report(L, k, backward=backward)
        if rep is not None:
            return rep.time
        kk = self.tables.effective_budget(L, k)
        c = self.cluster
        measured = c.cp_comm != "allgather" and backward in self.tables.cp_steps
        return float(self.price(kk, backward, steps=measured)(moba_pairs(L, self.block_size, kk)))

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
