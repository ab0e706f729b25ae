"""Reference copies of the decision logic of dst-cp and sab-order as they were before the timing
core (commit 301d238), with their own closed-form evaluator: the oracle that the new, faster
decisions are the same decisions (tests/policies/test_decisions_unchanged.py). Not used by the package.
"""

from __future__ import annotations

import functools

import numpy as np

from sparsebalance.data.sequence import Sequence
from sparsebalance.errors import ConfigError
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.sab import SparsityAware
from sparsebalance.policies.tuning import DynamicSparsity
from sparsebalance.simulator.plan import Budgets, MicroBatch, Plan
from sparsebalance.simulator.schedule.schedules import stage_orders


class PipelineEvaluator:
    """The engine's timing model (:mod:`sparsebalance.simulator.engine`) as a recurrence.

    Each device runs its actions in schedule order; an action starts at max(device free, input
    ready) where the input of F(vs, j) is F(vs-1, j) + p2p[vs-1, j] (time 0 for vs = 0), of
    B(vs, j) is B(vs+1, j) + p2p[vs, j], and of B(V-1, j) is F(V-1, j). Actions are visited once in
    a topological order fixed per (schedule, pp, m, virtual_stages), so many candidate duration
    sets are evaluated at once, one numpy row operation per action.
    """

    def __init__(self, schedule: str, pp: int, m: int, virtual_stages: int = 1) -> None:
        orders = stage_orders(schedule, pp, m, virtual_stages)
        self.pp, self.m, self.nv = pp, m, pp * virtual_stages
        nv, n = self.nv, 2 * self.nv * m
        self.sentinel = n  # a node that ends at 0: "no predecessor"

        def node(op: str, vs: int, j: int) -> int:
            return (0 if op == "F" else nv * m) + vs * m + j

        def dep(op: str, vs: int, j: int) -> int:
            if op == "F":
                return node("F", vs - 1, j) if vs > 0 else self.sentinel
            return node("F", vs, j) if vs == nv - 1 else node("B", vs + 1, j)

        ptr, done, prev = [0] * pp, [False] * (n + 1), [self.sentinel] * pp
        done[self.sentinel] = True
        steps: list[tuple[int, int, int]] = []
        while any(ptr[s] < len(orders[s]) for s in range(pp)):
            moved = False
            for s in range(pp):
                while ptr[s] < len(orders[s]):
                    a = orders[s][ptr[s]]
                    d = dep(*a)
                    if not done[d]:
                        break
                    i = node(*a)
                    steps.append((i, prev[s], d))
                    done[i], prev[s] = True, i
                    ptr[s] += 1
                    moved = True
            if not moved:
                raise RuntimeError(f"schedule {schedule!r} deadlocks")
        self.steps = steps
        self.last = prev  # last action of each physical stage

    def replica_finish(self, fwd: np.ndarray, bwd: np.ndarray, p2p) -> np.ndarray:
        """End of each physical stage's last action, seconds, [C, pp], for C candidate replicas.

        ``fwd``, ``bwd``: [C, V, m] seconds; ``p2p``: broadcastable to [C, V - 1, m] seconds."""
        fwd = np.asarray(fwd, dtype=float)
        c, nv, m = fwd.shape
        dur = np.concatenate([fwd.reshape(c, nv * m), np.asarray(bwd, float).reshape(c, nv * m)], 1).T
        lag = np.zeros((2 * nv, m, c))
        if nv > 1:
            p = np.broadcast_to(np.asarray(p2p, dtype=float), (c, nv - 1, m)).transpose(1, 2, 0)
            lag[1:nv] = p            # F(vs, j) waits for F(vs-1, j) + p2p[vs-1, j]
            lag[nv:2 * nv - 1] = p   # B(vs, j) waits for B(vs+1, j) + p2p[vs, j]
        lag = lag.reshape(2 * nv * m, c)
        end = np.zeros((2 * nv * m + 1, c))
        for i, pv, d in self.steps:
            end[i] = np.maximum(end[pv], end[d] + lag[i]) + dur[i]
        return end[self.last].T

    def iteration_time(self, fwd, bwd, p2p, allreduce, optimizer) -> float:
        """Seconds of one iteration, ``fwd``/``bwd`` [dp, V, m]; the engine's ``iteration_time``."""
        fin = self.replica_finish(fwd, bwd, p2p)
        tail = np.asarray(allreduce, float) + np.asarray(optimizer, float)
        return float((fin.max(axis=0) + tail).max())


@functools.lru_cache(maxsize=64)
def _evaluator_for(schedule: str, pp: int, m: int, virtual_stages: int) -> PipelineEvaluator:
    return PipelineEvaluator(schedule, pp, m, virtual_stages)


def evaluator_for(cluster, m: int) -> PipelineEvaluator:
    """The (cached, read-only) evaluator of ``cluster``'s schedule for ``m`` micro-batches per rank."""
    return _evaluator_for(cluster.schedule, cluster.pp, m, cluster.virtual_stages)


class OldCriticalPathDST:
    """dst-cp as it was before the timing core (the decisions the new one must reproduce)."""

    name = "dst-cp"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.stats: dict[str, float] = {}
        self._dst = DynamicSparsity(cfg)
        self._latency = None
        self._tail: np.ndarray | None = None

    def stage_table(self, lm, lengths: tuple[int, ...], k_lo: int, k_hi: int, nv: int, pp: int):
        """Forward and backward seconds of every virtual stage at k = k_lo..k_hi: two arrays
        [k_hi - k_lo + 1, V]. A stage's time is affine in its attention: n_layers(vs) x sum over
        sequences of ``attention(L, k)`` + a budget-free part, taken from one ``stage_time`` call."""
        ks = range(k_lo, k_hi + 1)
        n_layers = np.array([len(lm.stage_layers(vs % pp, vs // pp)) for vs in range(nv)], float)
        out = []
        for bw in (False, True):
            a = np.array([sum(lm.attention(L, k, backward=bw) for L in lengths) for k in ks])
            if lm.call[bw]:  # the attention call's fixed part, once per micro-batch (the cost model since 2026-11-26)
                a = a + lm.call[bw]
            base = np.array([lm.stage_time(lengths, k_lo, vs % pp, backward=bw, chunk=vs // pp)
                             for vs in range(nv)]) - n_layers * a[0]
            out.append(base[None, :] + a[:, None] * n_layers[None, :])
        return out[0], out[1]

    def budgets(self, plan: Plan, ctx: PolicyContext) -> Budgets:
        cfg, lm, cl = self.cfg, ctx.latency, ctx.cluster
        if not hasattr(lm, "stage_time"):
            raise ConfigError("policy.tuning: dst-cp needs a latency model with stage_time "
                              "(sparsebalance.simulator.cost.latency.LatencyModel)")
        dp, m = plan.dp, plan.num_microbatches
        pp, nv = cl.pp, cl.pp * cl.virtual_stages
        ev = evaluator_for(cl, m)
        if self._latency is not lm:
            self._latency = lm
            self._tail = np.array([lm.allreduce_time(s) + lm.optimizer_time(s) for s in range(pp)])
        tail = self._tail
        # per flat micro-batch i = r * m + j
        lo, hi, covs, tabs = [], [], [], []
        p2p = np.zeros((dp, max(nv - 1, 1), m))
        for r, j, mb in plan.microbatches():
            n_blocks = -(-max(mb.lengths) // ctx.model.block_size)
            k_hi = min(cfg.k_max, max(cfg.k0, n_blocks))
            f = self._dst.floor(mb, ctx, k_hi)
            lo.append(f)
            hi.append(k_hi)
            covs.append(ctx.coverage.microbatch_curve(mb, k_hi))
            tabs.append(self.stage_table(lm, mb.lengths, f, k_hi, nv, pp))
            p2p[r, :, j] = lm.p2p_time(mb.tokens)
        p2p = p2p[:, : nv - 1]
        K = np.full((dp, m), cfg.k0, dtype=np.int64)
        F = np.empty((dp, nv, m))
        B = np.empty((dp, nv, m))

        def put(Fa, Ba, rows, r, j, k):  # stage times of micro-batch (r, j) at budget k into rows
            i = r * m + j
            Fa[rows, :, j] = tabs[i][0][k - lo[i]]
            Ba[rows, :, j] = tabs[i][1][k - lo[i]]

        for r in range(dp):
            for j in range(m):
                put(F, B, r, r, j, cfg.k0)

        def finish(Fa, Ba, P):  # per replica time to the end of its slowest stage's optimizer step
            return (ev.replica_finish(Fa, Ba, P) + tail[None, :]).max(axis=1)

        R = finish(F, B, p2p)
        T_fixed = T = float(R.max())
        eps = 1e-12 * T
        step, rounds = max(1, cfg.k0 // 4), 0
        while rounds < cfg.cp_rounds:  # (a) lower critical micro-batches
            crit = np.flatnonzero(R >= T - eps)
            rest = float(np.max(R[R < T - eps])) if (R < T - eps).any() else -np.inf
            cand = [(r, j) for r in crit for j in range(m) if K[r, j] > lo[r * m + j]]
            if cand:
                cr = np.array([c[0] for c in cand])
                kn = [max(lo[r * m + j], int(K[r, j]) - step) for r, j in cand]
                Fc, Bc = F[cr], B[cr]
                for row, ((r, j), k) in enumerate(zip(cand, kn)):
                    put(Fc, Bc, row, r, j, k)
                obj = np.maximum(finish(Fc, Bc, p2p[cr]), rest)
                saving = T - obj
                loss = np.array([covs[r * m + j][K[r, j] - 1] - covs[r * m + j][k - 1]
                                 for (r, j), k in zip(cand, kn)])
                eff = saving / np.maximum(loss, 1e-15)
            best = {}
            for row, (r, j) in enumerate(cand):
                if saving[row] > eps and (r not in best or eff[row] > eff[best[r]]):
                    best[r] = row
            rounds += 1
            if len(best) < len(crit):  # some critical replica cannot be shortened at this step
                if step == 1:
                    break
                step //= 2
                continue
            for r, row in best.items():
                j = cand[row][1]
                K[r, j] = kn[row]
                put(F, B, r, r, j, kn[row])
            R = finish(F, B, p2p)
            T = float(R.max())
        T_a = T
        bound = max(T_a, min(T_a * (1.0 + cfg.cp_raise_tol), T_fixed)) * (1 + 1e-12)
        for _ in range(2):  # (b) spend bubbles on coverage
            changed = False
            order = sorted(range(dp * m), key=lambda i: (covs[i][K[i // m, i % m] - 1], i))
            for i in order:
                r, j = divmod(i, m)
                ks = np.arange(K[r, j] + 1, hi[i] + 1)
                if ks.size == 0:
                    continue
                Fc = np.repeat(F[r:r + 1], ks.size, axis=0)
                Bc = np.repeat(B[r:r + 1], ks.size, axis=0)
                Fc[:, :, j] = tabs[i][0][ks - lo[i]]
                Bc[:, :, j] = tabs[i][1][ks - lo[i]]
                others = float(np.max(np.delete(R, r))) if dp > 1 else -np.inf
                Rc = finish(Fc, Bc, p2p[r:r + 1])
                ok = np.flatnonzero(np.maximum(Rc, others) <= bound)
                if ok.size:
                    K[r, j] = int(ks[ok[-1]])
                    put(F, B, r, r, j, int(K[r, j]))
                    R[r] = Rc[ok[-1]]
                    changed = True
            if not changed:
                break
        n = dp * m
        floors = np.array(lo).reshape(dp, m)
        self.stats = {
            "mean_budget": float(K.mean()) if n else float(cfg.k0),
            "floor_share": float(((K == floors) & (K <= cfg.k0)).mean()) if n else 0.0,
            "lowered": float((K < cfg.k0).sum()),
            "raised": float((K > cfg.k0).sum()),
            "predicted_s": float(R.max()),
            "predicted_fixed_s": T_fixed,
            "lowered_s": T_a,
            "rounds": float(rounds),
        }
        return tuple(tuple(int(k) for k in row) for row in K)

    def observe(self, plan: Plan, budgets: Budgets, result=None) -> None:
        """Stateless across iterations, like DST (its decision 1)."""


class OldScheduleAwareOrder(SparsityAware):
    """``sab-order``: SAB's plan with each rank's micro-batches reordered against the schedule.

    **Objective** (per DP rank r, seconds): ``max_s(finish[r, s] + allreduce[s] + optimizer[s])``,
    the time that rank's slowest stage leaves for the iteration's end, predicted by
    :class:`~sparsebalance.policies.critical.PipelineEvaluator` (the SimPy engine's recurrence).
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
    With one virtual stage (pp = 1, no interleaving) the order cannot matter and SAB's is kept; so
    it is with a latency model without ``stage_time`` (e.g. a closed-form test double).
    ``stats`` (last ``plan``): predicted seconds with SAB's order and after reordering (max over
    ranks), ranks reordered, candidate orders evaluated.
    """

    name = "sab-order"

    def __init__(self, cfg: PolicyConfig, *, max_evaluations: int = 400) -> None:
        super().__init__(cfg)
        self.max_evaluations = max_evaluations
        """Candidate orders scored per DP rank at most (each costs O(2 V m) numpy row operations)."""
        self.stats: dict[str, float] = {}

    def stage_times(self, mb: MicroBatch, ctx: PolicyContext) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds of ``mb`` on every virtual stage, two arrays [V], each
        sequence at its bucket's EMA budget (affine in attention, as in ``dst-cp``'s table)."""
        lm, cl = ctx.latency, ctx.cluster
        pp, nv = cl.pp, cl.pp * cl.virtual_stages
        n_layers = np.array([len(lm.stage_layers(vs % pp, vs // pp)) for vs in range(nv)], float)
        out = []
        for bw in (False, True):
            attn1 = attn = 0.0
            for L in mb.lengths:
                k = max(1.0, self.expected_budget(L))
                lo = int(np.floor(k))
                a = lm.attention(L, lo, backward=bw)
                if k > lo:
                    a += (k - lo) * (lm.attention(L, lo + 1, backward=bw) - a)
                attn += a
                attn1 += lm.attention(L, 1, backward=bw)
            if lm.call[bw]:  # the attention call's fixed part, once per micro-batch (the cost model since 2026-11-26)
                attn, attn1 = attn + lm.call[bw], attn1 + lm.call[bw]
            base = np.array([lm.stage_time(mb.lengths, 1, vs % pp, backward=bw, chunk=vs // pp)
                             for vs in range(nv)]) - n_layers * attn1
            out.append(base + n_layers * attn)
        return out[0], out[1]

    def plan(self, batch: list[Sequence], ctx: PolicyContext) -> Plan:
        base = super().plan(batch, ctx)
        cl, lm = ctx.cluster, ctx.latency
        nv = cl.pp * cl.virtual_stages
        m = base.num_microbatches
        self.stats = {"evaluations": 0.0, "reordered_ranks": 0.0}
        if nv == 1 or m < 2 or not hasattr(lm, "stage_time"):
            return base
        tail = np.array([lm.allreduce_time(s) + lm.optimizer_time(s) for s in range(cl.pp)])
        ranks, before, after = [], [], []
        for mbs in base.ranks:
            times = [self.stage_times(mb, ctx) for mb in mbs]
            fwd = np.stack([t[0] for t in times], axis=1)  # [V, m]
            bwd = np.stack([t[1] for t in times], axis=1)
            p2p = np.array([lm.p2p_time(mb.tokens) for mb in mbs], float)
            order, t0, t1, n = self.best_order(fwd, bwd, p2p, tail, cl)
            ranks.append(tuple(mbs[i] for i in order))
            before.append(t0)
            after.append(t1)
            self.stats["evaluations"] += n
            self.stats["reordered_ranks"] += float(list(order) != list(range(m)))
        self.stats["predicted_sab_s"] = max(before)
        self.stats["predicted_s"] = max(after)
        return Plan(tuple(ranks))

    def best_order(self, fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, tail: np.ndarray,
                   cluster) -> tuple[list[int], float, float, int]:
        """Search over orders of one rank's m micro-batches. ``fwd``, ``bwd``: [V, m] seconds in
        SAB's order; ``p2p``: [m] seconds; ``tail``: [pp] all-reduce + optimizer seconds.
        Returns (order as indices into SAB's order, predicted seconds of SAB's order, of the
        chosen order, candidate orders evaluated)."""
        nv, m = fwd.shape
        budget = self.max_evaluations
        used = 0

        def score(orders: list[list[int]]) -> np.ndarray:
            nonlocal used
            idx = np.array(orders, dtype=np.int64)  # [C, k]
            ev = evaluator_for(cluster, idx.shape[1])
            pp2p = np.broadcast_to(p2p[idx][:, None, :], (len(orders), max(nv - 1, 0), idx.shape[1]))
            fin = ev.replica_finish(fwd[:, idx].transpose(1, 0, 2), bwd[:, idx].transpose(1, 0, 2), pp2p)
            used += len(orders)
            return (fin + tail[None, :]).max(axis=1)

        cost = (fwd + bwd).sum(axis=0)
        dec = list(range(m))  # SAB's order is decreasing predicted cost already
        inc = dec[::-1]
        valley = dec[1::2][::-1] + dec[0::2]  # small ... large ... small
        ramp = [dec[-1]] + dec[:-1]
        seeds = [dec]
        for o in (inc, valley, ramp):
            if o not in seeds:
                seeds.append(o)
        vals = list(score(seeds))
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
        all_pairs = [(i, j) for i in range(m) for j in range(i + 1, m)]
        edge_pairs = sorted({(i, i + 1) for i in range(m - 1)} | {(0, j) for j in range(1, m)}
                            | {(i, m - 1) for i in range(m - 1)})
        while used < budget:  # pairwise-swap local search
            pairs = all_pairs if len(all_pairs) <= budget - used else edge_pairs
            pairs = pairs[: budget - used]
            if not pairs:
                break
            cands = []
            for i, j in pairs:
                o = list(best)
                o[i], o[j] = o[j], o[i]
                cands.append(o)
            s = score(cands)
            k = int(np.argmin(s))
            if not s[k] < t_best * (1 - 1e-12):
                break
            best, t_best = cands[k], float(s[k])
        return best, t_sab, t_best, used
