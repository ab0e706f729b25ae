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
summed over its sequences, affine in a stage's layer count; one vectorised call for all), then the
moves are priced exactly without re-timing the schedule (:mod:`sparsebalance.simulator.perturb`):
each replica's action times and times-to-end are kept, a move of micro-batch j re-times only the
window between F(0, j) and B(0, j) (about pp^2 actions for 1F1B), and an applied move updates the
kept times in one pass. So phase (a) costs O(rounds x (candidates x window + actions)) and phase
(b) O(micro-batches x k range x window + applied moves x actions), where the former closed-form
evaluator re-timed every action for every candidate (quadratic in micro-batches per rank).
``stats``: mean_budget, floor_share, lowered, raised (counts vs k0), rounds, and predicted seconds:
``predicted_fixed_s`` (all k0), ``lowered_s`` (after a), ``predicted_s`` (final).
"""

from __future__ import annotations

import numpy as np

from sparsebalance.errors import ConfigError
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.tuning import DynamicSparsity
from sparsebalance.simulator.graph import ActionGraph, schedule_graph
from sparsebalance.simulator.perturb import ReplicaTimes
from sparsebalance.simulator.plan import Budgets, Plan
from sparsebalance.simulator.timing import pack_lags


def graph_for(cluster, m: int) -> ActionGraph:
    """The (cached, read-only) dependency graph of ``cluster``'s schedule for ``m`` micro-batches."""
    return schedule_graph(cluster.schedule, cluster.pp, m, cluster.virtual_stages)


class CriticalPathDST:
    """``dst-cp``: see the module docstring."""

    name = "dst-cp"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.stats: dict[str, float] = {}
        self._dst = DynamicSparsity(cfg)  # kept for callers of .floor; budgets() reads floors off the curve
        self._latency = None
        self._tail: np.ndarray | None = None

    def stage_table(self, lm, lengths: tuple[int, ...], k_lo: int, k_hi: int, nv: int, pp: int,
                    split: bool = False):
        """Forward and backward seconds of every virtual stage at k = k_lo..k_hi: two arrays
        [k_hi - k_lo + 1, V] (:meth:`stage_tables` for one micro-batch); with ``split`` a third,
        the backward's input-gradient part I (its weight-gradient part W does not depend on k:
        :meth:`weight_times`)."""
        return self.stage_tables(lm, [lengths], [k_lo], [k_hi], nv, pp, split)[0]

    @staticmethod
    def weight_times(lm, lengths: tuple[int, ...], nv: int, pp: int) -> np.ndarray:
        """[V] seconds of the weight-gradient part W of each virtual stage's backward (attention
        has no weights, so W is the same at every budget)."""
        return np.array([lm.stage_time(lengths, 1, vs % pp, backward=True, chunk=vs // pp, part="weight")
                         for vs in range(nv)])

    def stage_tables(self, lm, lengths: list, k_lo: list[int], k_hi: list[int], nv: int, pp: int,
                     split: bool = False):
        """:meth:`stage_table` of many micro-batches (``lengths[i]`` at k = k_lo[i]..k_hi[i]).

        A stage's time is affine in its attention: n_layers(vs) x the sum over sequences of
        ``attention(L, k)`` + a budget-free part, the part being ``stage_time`` at k_lo minus its
        attention, computed term by term as ``LatencyModel.stage_time`` does (sums over a
        micro-batch's sequences left to right), so values equal ``stage_time``'s bit for bit.
        The attention of every (sequence, k) pair comes from one vectorised call."""
        n_layers = np.array([len(lm.stage_layers(vs % pp, vs // pp)) for vs in range(nv)], float)
        sizes = np.array([h - lo + 1 for lo, h in zip(k_lo, k_hi)], dtype=np.int64)
        offset = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        counts = np.array([len(x) for x in lengths], dtype=np.int64)
        many = getattr(lm, "attention_many", None)
        out = []
        acc_of: dict[bool, np.ndarray] = {}
        for bw, part in ((False, None), (True, None), *([(True, "input")] if split else [])):
            kw = {"part": part} if part else {}
            if bw in acc_of:  # I's attention is B's (attention's backward is all input gradient)
                out.append(self._tables(lm, lengths, acc_of[bw], offset, sizes, n_layers, nv, pp, bw, kw))
                continue
            acc = np.zeros(int(sizes.sum()))  # [sum of sizes]: attention sums per (micro-batch, k)
            for p in range(int(counts.max())):  # left to right over each micro-batch's sequences
                idx = np.flatnonzero(counts > p)
                L = np.repeat([lengths[i][p] for i in idx.tolist()], sizes[idx])
                k = np.concatenate([np.arange(k_lo[i], k_hi[i] + 1) for i in idx.tolist()])
                at = np.concatenate([offset[i] + np.arange(sizes[i]) for i in idx.tolist()])
                if many is None:
                    v = np.array([lm.attention(int(x), int(y), backward=bw) for x, y in zip(L, k)])
                else:
                    v = many(L, k, backward=bw)
                acc[at] = acc[at] + v
            acc_of[bw] = acc
            out.append(self._tables(lm, lengths, acc, offset, sizes, n_layers, nv, pp, bw, kw))
        return list(zip(*out))

    @staticmethod
    def _tables(lm, lengths, acc, offset, sizes, n_layers, nv, pp, bw, kw) -> list:
        """Per micro-batch [k, V] seconds from its attention sums ``acc`` (one mode)."""
        tabs = []
        for i, lens in enumerate(lengths):
            a = acc[offset[i]:offset[i] + sizes[i]]
            tokens = sum(lens)
            dense = lm.dense(tokens, backward=bw, **kw)
            base = np.empty(nv)
            for vs in range(nv):  # stage_time(lens, k_lo[i], vs) - its attention
                nl = len(lm.stage_layers(vs % pp, vs // pp))
                st = 0.0 + nl * a[0]
                st += nl * dense
                if vs == 0:
                    st += lm.embed(tokens, backward=bw, **kw)
                if vs == nv - 1:
                    st += lm.head(tokens, backward=bw, **kw)
                base[vs] = st - n_layers[vs] * a[0]
            tabs.append(base[None, :] + a[:, None] * n_layers[None, :])
        return tabs

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
        lo, hi, covs = [], [], []
        p2p = np.zeros((dp, max(nv - 1, 1), m))
        for r, j, mb in plan.microbatches():
            n_blocks = -(-max(mb.lengths) // ctx.model.block_size)
            k_hi = min(cfg.k_max, max(cfg.k0, n_blocks))
            cov = ctx.coverage.microbatch_curve(mb, k_hi)
            # DST's floor (DynamicSparsity.floor) read off the same curve: its C(1..min(k_hi, k0))
            # are this curve's first entries, computed alike
            k_top = min(k_hi, cfg.k0)
            ok = np.nonzero(cov[:k_top] >= 1.0 - cfg.p - 1e-12)[0]
            f = max(cfg.k_min, min(int(ok[0]) + 1 if ok.size else k_top, cfg.k0))
            lo.append(f)
            hi.append(k_hi)
            covs.append(cov)
            p2p[r, :, j] = lm.p2p_time(mb.tokens)
        split = g.split
        tabs = self.stage_tables(lm, [mb.lengths for _, _, mb in plan.microbatches()], lo, hi, nv, pp, split)
        p2p = p2p[:, : nv - 1]
        K = np.full((dp, m), cfg.k0, dtype=np.int64)

        # per micro-batch [k_hi - floor + 1, 2V]: F, then its backward node's seconds: B, or for a
        # split schedule I (B where the graph runs that backward whole); W is the same at every k
        both = [np.hstack(t[:2]) if not split else
                np.hstack([t[0], np.where(g.fused[:, i % m][None, :], t[1], t[2])])
                for i, t in enumerate(tabs)]

        def stage_vec(i: int, k: int) -> np.ndarray:  # [2V]: F then B of micro-batch i at budget k
            return both[i][k - lo[i]]

        f_nodes = np.arange(nv) * m  # node of F(vs, 0); + j for micro-batch j (B: + nv * m)
        own = np.concatenate([f_nodes, f_nodes + nv * m])
        dur = np.empty((g.n, dp))
        for r in range(dp):
            for j in range(m):
                dur[own + j, r] = stage_vec(r * m + j, cfg.k0)
        if split:  # the W nodes (an empty placeholder where the backward runs whole)
            for r, j, mb in plan.microbatches():
                w = np.where(g.fused[:, j], 0.0, self.weight_times(lm, mb.lengths, nv, pp))
                dur[2 * nv * m + f_nodes + j, r] = w
        times = ReplicaTimes(g, dur, pack_lags(g, p2p, dp), tail)

        def put(r: int, j: int, k: int) -> None:  # micro-batch (r, j) now runs at budget k
            K[r, j] = k
            times.duration[own + j, r] = stage_vec(r * m + j, k)

        R = times.finish()
        T_fixed = T = float(R.max())
        eps = 1e-12 * T
        step, rounds = max(1, cfg.k0 // 4), 0
        while rounds < cfg.cp_rounds:  # (a) lower critical micro-batches
            crit = np.flatnonzero(R >= T - eps)
            rest = float(np.max(R[R < T - eps])) if (R < T - eps).any() else -np.inf
            cand = [(r, j) for r in crit for j in range(m) if K[r, j] > lo[r * m + j]]
            if cand:
                cr = np.array([c[0] for c in cand])
                cj = np.array([c[1] for c in cand])
                kn = [max(lo[r * m + j], int(K[r, j]) - step) for r, j in cand]
                new = np.stack([stage_vec(r * m + j, k) for (r, j), k in zip(cand, kn)])
                obj = np.maximum(times.finish_if(cr, cj, new), rest)
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
                put(r, cand[row][1], kn[row])
                times.update(r, cand[row][1])
            R = times.finish()
            T = float(R.max())
        T_a = T
        bound = max(T_a, min(T_a * (1.0 + cfg.cp_raise_tol), T_fixed)) * (1 + 1e-12)
        for _ in range(2):  # (b) spend bubbles on coverage
            changed = False
            order = sorted(range(dp * m), key=lambda i: (covs[i][K[i // m, i % m] - 1], i))
            answers: dict[int, np.ndarray] = {}  # finish at each larger k, valid until r changes
            for pos, i in enumerate(order):
                r, j = divmod(i, m)
                ks = np.arange(K[r, j] + 1, hi[i] + 1)
                if ks.size == 0:
                    continue
                if i not in answers:  # price every micro-batch of r still to come in one call
                    todo = [x for x in order[pos:] if x // m == r and K[r, x % m] < hi[x]]
                    pairs = [(x, k) for x in todo for k in range(int(K[r, x % m]) + 1, hi[x] + 1)]
                    fin = times.finish_if(np.full(len(pairs), r), np.array([x % m for x, _ in pairs]),
                                          np.stack([stage_vec(x, k) for x, k in pairs]))
                    at = 0
                    for x in todo:
                        size = hi[x] - int(K[r, x % m])
                        answers[x] = fin[at:at + size]
                        at += size
                Rc = answers.pop(i)
                others = float(np.max(np.delete(R, r))) if dp > 1 else -np.inf
                ok = np.flatnonzero(np.maximum(Rc, others) <= bound)
                if ok.size:
                    put(r, j, int(ks[ok[-1]]))
                    times.update(r, j)
                    R = times.finish()
                    changed = True
                    for x in [x for x in answers if x // m == r]:  # r's times changed
                        del answers[x]
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
