"""``dst-cp``: critical-path DST. Budgets chosen against the pipeline schedule, not an anchor.

DST (:mod:`.tuning`) balances every micro-batch toward an anchor latency. What sets the pace of a
PP x DP iteration is the critical path of the schedule: the slowest replica's 1F1B/GPipe makespan,
then the all-reduce that waits for it. ``dst-cp`` predicts that iteration time exactly (the
simulator's timing core, :mod:`sparsebalance.simulator.timing`, on the schedule's graph) and:

(a) **lowers** budgets greedily, starting from ``k0`` everywhere: in every round each micro-batch
    of a *critical* replica (one whose finish sets the iteration time) is tried at
    ``max(floor, k - step)``; per critical replica the move with the largest saving of predicted
    iteration time per unit of coverage lost is applied (all critical replicas move together, since
    lowering one of two tied replicas saves nothing). When no critical replica has an improving
    move, ``step`` halves (``k0 // 4``, ..., 1); the phase ends at step 1 or after ``cp_rounds``
    rounds. Floors are DST's (smallest k with C(k) >= 1 - p, clamped to [k_min, k0]).
(b) **raises** budgets into bubbles: micro-batches in order of rising coverage take the largest
    k <= k_hi whose predicted iteration time stays <= ``T_a (1 + cp_raise_tol)`` (``T_a`` = end of
    phase a; never above the ``fixed`` time), all k of one micro-batch scored in one batched call;
    two passes. ``k_hi = min(k_max, max(k0, n_blocks))`` as in DST.

Never slower than ``fixed`` in prediction: (a) accepts only moves that lower the predicted time, (b)
is capped by it. Deterministic (ties go to the lowest flat index). Budgets are ints (one per
micro-batch). Limitation: a single-micro-batch move cannot shorten a replica whose makespan is set
by two disjoint paths at once; phase (a) then stops early.

Cost: stage times of every micro-batch at every k in [floor, k_hi] (``LatencyModel.attention``
summed over its sequences, affine in a stage's layer count; cached across iterations), then at most
``cp_rounds`` batched evaluations of <= dp * m candidates plus 2 * dp * m batched evaluations of
<= k_hi candidates, each O(2 V m) numpy row operations (V virtual stages, m micro-batches).
``stats``: mean_budget, floor_share, lowered, raised (counts vs k0), rounds, and predicted seconds:
``predicted_fixed_s`` (all k0), ``lowered_s`` (after a), ``predicted_s`` (final).
"""

from __future__ import annotations

import numpy as np

from sparsebalance.errors import ConfigError
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.tuning import DynamicSparsity
from sparsebalance.simulator.plan import Budgets, Plan
from sparsebalance.simulator.graph import ActionGraph, schedule_graph
from sparsebalance.simulator.timing import pack_durations, pack_lags, replica_finish, time_graph, time_to_sink


def graph_for(cluster, m: int) -> ActionGraph:
    """The (cached, read-only) dependency graph of ``cluster``'s schedule for ``m`` micro-batches."""
    return schedule_graph(cluster.schedule, cluster.pp, m, cluster.virtual_stages)


class CriticalPathDST:
    """``dst-cp``: see the module docstring."""

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
        ks = np.arange(k_lo, k_hi + 1)
        n_layers = np.array([len(lm.stage_layers(vs % pp, vs // pp)) for vs in range(nv)], float)
        many = getattr(lm, "attention_many", None)
        out = []
        for bw in (False, True):
            if many is None:
                a = np.array([sum(lm.attention(L, k, backward=bw) for L in lengths) for k in ks.tolist()])
            else:  # the same left-to-right sum over sequences as the scalar line above, per k
                a = np.zeros(len(ks))
                for L in lengths:
                    a = a + many(np.full(len(ks), L), ks, backward=bw)
            base = np.array([lm.stage_time(lengths, k_lo, vs % pp, backward=bw, chunk=vs // pp)
                             for vs in range(nv)]) - n_layers * a[0]
            out.append(base[None, :] + a[:, None] * n_layers[None, :])
        return out[0], out[1]

    def budgets(self, plan: Plan, ctx: PolicyContext) -> Budgets:
        cfg, lm, cl = self.cfg, ctx.latency, ctx.cluster
        if not hasattr(lm, "stage_time"):
            raise ConfigError("policy.tuning: dst-cp needs a latency model with stage_time "
                              "(sparsebalance.simulator.latency.LatencyModel)")
        dp, m = plan.dp, plan.num_microbatches
        pp, nv = cl.pp, cl.pp * cl.virtual_stages
        g = graph_for(cl, m)
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
            return (replica_finish(g, Fa, Ba, P) + tail[None, :]).max(axis=1)

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
        # Screening (exact): the longest path through an action x, start(x) + its duration + its
        # time to the end, is a lower bound on the iteration time; with x's duration at budget k
        # instead, still a lower bound. Budgets only rise in (b), so times computed once here stay
        # lower bounds throughout. A micro-batch none of whose larger budgets passes this bound
        # would be rejected by the exact evaluation below too; it is skipped without one.
        lag_all = pack_lags(g, p2p, dp)
        dur_all = pack_durations(g, {"F": F, "B": B})
        st, _ = time_graph(g, dur_all, lag_all)
        through = st + time_to_sink(g, dur_all, lag_all, tail)  # [n, dp], minus own duration
        f_nodes = np.arange(nv)[:, None] * m + np.arange(m)[None, :]  # [V, m] node ids of F
        b_nodes = f_nodes + nv * m
        limit = bound * (1 + 1e-9)  # a margin for the rounding of the bound's sums
        for _ in range(2):  # (b) spend bubbles on coverage
            changed = False
            order = sorted(range(dp * m), key=lambda i: (covs[i][K[i // m, i % m] - 1], i))
            for i in order:
                r, j = divmod(i, m)
                ks = np.arange(K[r, j] + 1, hi[i] + 1)
                if ks.size == 0:
                    continue
                lb = np.maximum((through[f_nodes[:, j], r][None, :] + tabs[i][0][ks - lo[i]]).max(axis=1),
                                (through[b_nodes[:, j], r][None, :] + tabs[i][1][ks - lo[i]]).max(axis=1))
                if (lb > limit).all():
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
