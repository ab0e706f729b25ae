"""``sab-order``: SAB's packing, then per DP rank the micro-batch order that shortens its pipeline.

Beyond the paper. SAB (:mod:`.sab`) runs each rank's micro-batches in decreasing predicted cost.
Under 1F1B / GPipe / interleaved schedules with heterogeneous micro-batches the order changes the
makespan: the first micro-batch sets how long the later stages wait (pipeline fill), the last one
how long the earlier stages wait for its backward (drain). ``sab-order`` keeps SAB's packing (same
micro-batches on the same ranks; SAB's EMA state and ``observe`` are inherited) and only permutes
each rank's micro-batches.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.critical import graph_for
from sparsebalance.policies.sab import SparsityAware
from sparsebalance.simulator.plan import Plan
from sparsebalance.simulator.schedule.schedules import splits_backward
from sparsebalance.simulator.schedule.timing import order_finish


class ScheduleAwareOrder(SparsityAware):
    """``sab-order``: SAB's plan with each rank's micro-batches reordered against the schedule.

    **Objective** (per DP rank r, seconds): ``max_s(finish[r, s] + allreduce[s] + optimizer[s])``,
    the time that rank's slowest stage leaves for the iteration's end, predicted by
    :func:`sparsebalance.simulator.schedule.timing.replica_finish` (the simulator's timing core).
    Ranks are independent (the iteration time is the max over ranks), so each is ordered alone.
    **Stage times** of a micro-batch are predicted at the budgets DST is likely to pick: every
    sequence at its length bucket's EMA budget ``k_est`` (SAB's estimate; fractional ``k_est``
    interpolated between integer neighbours), stage ``vs`` = its layers' attention + its dense,
    embedding and head parts (``LatencyModel.stage_time``); P2P = ``p2p_time(tokens)``.

    **Search** (deterministic; at most ``max_evaluations`` candidate orders per rank):

    1. seeds: SAB's order (decreasing cost), increasing, "valley" (largest in the middle, the
       smallest at both ends), "ramp" (the smallest first, then decreasing), and, when it fits in
       the budget (about m^2/2 evaluations), a greedy insertion (NEH): micro-batches in decreasing
       cost, each inserted where the predicted makespan is least (the micro-batches not yet placed
       follow in decreasing cost, so every candidate is a full order: 1F1B needs m >= pp);
    2. local search from the best seed: each round scores all pairwise swaps (or, when they no
       longer fit in the remaining budget, swaps of adjacent positions and with the first and last
       slot) in one batched call and applies the best strictly improving one; ends when none
       improves or the budget is spent.

    A candidate replaces SAB's order only when predicted strictly shorter (relative 1e-12), so in
    prediction ``sab-order`` is never slower than ``sab``; ties keep the earlier candidate.
    With one virtual stage (pp = 1, no interleaving) the order cannot matter and SAB's is kept.
    ``stats`` (last ``plan``): predicted seconds with SAB's order and after reordering (max over
    ranks), ranks reordered, candidate orders evaluated.
    """

    name = "sab-order"

    def __init__(self, cfg: PolicyConfig, *, max_evaluations: int = 400) -> None:
        super().__init__(cfg)
        self.max_evaluations = max_evaluations
        """Candidate orders scored per DP rank at most (each costs O(2 V m) numpy row operations)."""
        self.stats: dict[str, float] = {}

    def stage_times(self, mbs, ctx: PolicyContext) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds [V, len(mbs)] of micro-batches ``mbs`` on every virtual
        stage, each sequence at its bucket's EMA budget (affine in attention, as in ``dst-cp``'s
        table): the stage's budget-free part (``StageCost.budget_free``, taken at budget 1) + its
        layers x the attention at the estimated budgets (sums over a micro-batch's sequences left to
        right)."""
        lm = ctx.latency
        n_layers = lm.layout.layer_counts
        counts = [len(mb.sequences) for mb in mbs]
        L = np.fromiter((s.length for mb in mbs for s in mb.sequences), dtype=np.int64, count=sum(counts))
        k = np.maximum(1.0, self.expected_budgets(L))
        lo = np.floor(k).astype(np.int64)
        frac = k > lo
        ends = np.cumsum(np.concatenate(([0], L)))[np.cumsum([0] + counts)]
        tok = ends[1:] - ends[:-1]  # tokens per micro-batch (exact: integers)
        out = []
        for bw in (False, True):
            a = lm.attention_many(L, lo, backward=bw)
            if frac.any():
                up = lm.attention_many(L[frac], lo[frac] + 1, backward=bw)
                a[frac] = a[frac] + (k[frac] - lo[frac]) * (up - a[frac])
            attn = lm.cost.with_call(lm.cost.per_microbatch(a, counts), counts, backward=bw)
            attn1 = lm.cost.attention_sums(L, counts, np.ones_like(L), backward=bw)
            free = lm.cost.budget_free(attn1, tok, backward=bw)  # [V, M]: the stage less its attention
            out.append(free + n_layers[:, None] * attn)
        return out[0], out[1]

    def plan(self, batch: list[Sequence], ctx: PolicyContext) -> Plan:
        base = super().plan(batch, ctx)
        cl, lm = ctx.cluster, ctx.latency
        nv = cl.pp * cl.virtual_stages
        m = base.num_microbatches
        self.stats = {"evaluations": 0.0, "reordered_ranks": 0.0}
        if nv == 1 or m < 2:
            return base
        tail = np.array([lm.allreduce_time(s) + lm.optimizer_time(s) for s in range(cl.pp)])
        ranks, before, after = [], [], []
        times = []
        for mbs in base.ranks:
            fwd, bwd = self.stage_times(mbs, ctx)  # [V, m] each
            p2p = np.array([lm.p2p_time(mb.tokens) for mb in mbs], float)
            split = self.split_parts(mbs, ctx, bwd) if splits_backward(cl.schedule) else None
            times.append((fwd, bwd, p2p, split))
        seed_vals = self.seed_scores(times, tail, cl)  # every rank's seeds in one call of the core
        for r, mbs in enumerate(base.ranks):
            fwd, bwd, p2p, split = times[r]
            order, t0, t1, n = self.best_order(fwd, bwd, p2p, tail, cl, split, seed_vals=seed_vals[r])
            ranks.append(tuple(mbs[i] for i in order))
            before.append(t0)
            after.append(t1)
            self.stats["evaluations"] += n
            self.stats["reordered_ranks"] += float(list(order) != list(range(m)))
        self.stats["predicted_sab_s"] = max(before)
        self.stats["predicted_s"] = max(after)
        return Plan(tuple(ranks))

    @staticmethod
    def split_parts(mbs, ctx: PolicyContext, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(I, W) [V, m] of a split-backward schedule from the backward ``bwd``: attention's
        backward is all input gradient, so B - I and W do not depend on the budget and come from
        the stage times at budget 1."""
        at1 = ctx.latency.stage_times([mb.lengths for mb in mbs], [1] * len(mbs), ("B", "I", "W"))  # [V, m] each
        return bwd - (at1["B"] - at1["I"]), at1["W"]

    @staticmethod
    def edge_pairs(m: int) -> list[tuple[int, int]]:
        """The swaps tried when not all pairs fit the budget, sorted: adjacent positions, the first
        slot with every other, every other with the last slot (each pair once)."""
        out = [(0, j) for j in range(1, m)]
        for i in range(1, m - 1):
            out.append((i, i + 1))
            if i + 1 < m - 1:
                out.append((i, m - 1))
        return out

    @staticmethod
    def seed_orders(m: int) -> list[list[int]]:
        """The search's first candidates, as indices into SAB's (decreasing) order: SAB's order,
        increasing, valley (small ... large ... small) and ramp (the smallest first), distinct."""
        dec = list(range(m))
        seeds = [dec]
        for o in (dec[::-1], dec[1::2][::-1] + dec[0::2], [dec[-1]] + dec[:-1]):
            if o not in seeds:
                seeds.append(o)
        return seeds

    def seed_scores(self, times: list, tail: np.ndarray, cluster) -> np.ndarray:
        """[dp, seeds] predicted seconds of every rank's seed orders (:meth:`best_order`'s first
        candidates), in one call of the timing core over the ranks side by side: each column is
        timed alone, so these are the numbers a call per rank gives, bit for bit."""
        m = times[0][0].shape[1]
        seeds = np.array(self.seed_orders(m), dtype=np.int64)
        cat = [np.concatenate([t[i] for t in times], axis=-1) for i in range(3)]
        split = times[0][3]
        parts = () if split is None else tuple(np.concatenate([t[3][i] for t in times], axis=1) for i in range(2))
        idx = np.concatenate([seeds + r * m for r in range(len(times))])
        fin = order_finish(graph_for(cluster, m), idx, cat[0], cat[1], cat[2], *parts)
        return (fin + tail[None, :]).max(axis=1).reshape(len(times), len(seeds))

    def best_order(self, fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, tail: np.ndarray,
                   cluster, split: tuple[np.ndarray, np.ndarray] | None = None, *,
                   seed_vals: np.ndarray | None = None) -> tuple[list[int], float, float, int]:
        """Search over orders of one rank's m micro-batches. ``fwd``, ``bwd``: [V, m] seconds in
        SAB's order (and for a split-backward schedule ``split`` = its I and W, [V, m] each);
        ``p2p``: [m] seconds; ``tail``: [pp] all-reduce + optimizer seconds.
        ``seed_vals``: the seeds' scores when already made (:meth:`seed_scores`, all ranks at once).
        Returns (order as indices into SAB's order, predicted seconds of SAB's order, of the
        chosen order, candidate orders evaluated)."""
        m = fwd.shape[1]
        budget = self.max_evaluations
        used = 0

        def score(orders) -> np.ndarray:  # orders: lists, or an index array [C, k]
            nonlocal used
            idx = np.asarray(orders, dtype=np.int64)  # [C, k]
            g = graph_for(cluster, idx.shape[1])
            fin = order_finish(g, idx, fwd, bwd, p2p, *(split or ()))
            used += len(orders)
            return (fin + tail[None, :]).max(axis=1)

        cost = (fwd + bwd).sum(axis=0)
        seeds = self.seed_orders(m)  # SAB's order is decreasing predicted cost already
        if seed_vals is None:
            vals = list(score(seeds))
        else:  # scored with the other ranks' (seed_scores)
            vals = [float(v) for v in seed_vals]
            used += len(seeds)
        if m * (m + 1) // 2 <= budget - used:  # greedy insertion (NEH)
            by_cost = sorted(range(m), key=lambda i: (-cost[i], i))
            cur = [by_cost[0]]
            for n, i in enumerate(by_cost[1:], start=2):
                rest = by_cost[n:]  # not yet placed: appended, so every candidate is a full order
                cands = [cur[:p] + [i] + cur[p:] + rest for p in range(len(cur) + 1)]
                s = score(cands)
                cur = cands[int(np.argmin(s))][:n]
            if cur not in seeds:
                seeds.append(cur)
                vals.append(float(score([cur])[0]))
        t_sab = float(vals[0])
        best_i = 0
        for i, v in enumerate(vals):
            if v < vals[best_i] * (1 - 1e-12):
                best_i = i
        best, t_best = list(seeds[best_i]), float(vals[best_i])
        n_all = m * (m - 1) // 2  # all pairs (i < j), listed only when they fit the budget
        edge_pairs = self.edge_pairs(m)
        while used < budget:  # pairwise-swap local search
            if n_all <= budget - used:
                pairs = [(i, j) for i in range(m) for j in range(i + 1, m)]
            else:
                pairs = edge_pairs[: budget - used]
            if not pairs:
                break
            a, b = np.array(pairs, dtype=np.int64).T
            rows = np.arange(len(pairs))
            swapped = np.tile(np.asarray(best, dtype=np.int64), (len(pairs), 1))  # row c: best, a[c] <-> b[c]
            swapped[rows, a], swapped[rows, b] = swapped[rows, b], swapped[rows, a]
            s = score(swapped)
            k = int(np.argmin(s))
            if not s[k] < t_best * (1 - 1e-12):
                break
            best, t_best = swapped[k].tolist(), float(s[k])
        return best, t_sab, t_best, used
