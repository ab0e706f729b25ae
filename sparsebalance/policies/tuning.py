"""Tuning policies: ``fixed`` (k0 everywhere) and ``dst`` (dynamic sparsity tuning).

DST, per iteration (decisions where the paper is silent are marked *ours*):

1. Predict every micro-batch's latency at ``k0`` (*ours*: every iteration starts from the default
   budget; a micro-batch position holds different sequences each iteration, so last iteration's
   budget at that position says nothing about this one, and SAB already carries the history).
2. Anchor ``A`` = mean | min | max of those predictions over the scope: all micro-batches of the
   iteration (``anchor_scope = "global"``: DP replicas wait for each other at the all-reduce) or
   the micro-batches of one DP pipeline (``"pipeline"``).
3. ``k*`` = the largest ``k`` in ``[k_min, k_hi]`` with predicted latency <= ``A`` (binary search,
   latency is non-decreasing in k). Stragglers (latency > A) thus lower their budget, fast ones raise
   it; ``k_hi = min(k_max, max(k0, n_blocks))`` where ``n_blocks`` is the block count of the
   micro-batch's longest sequence (*ours*: a larger top-k selects nothing more).
4. Coverage floor ``f`` = smallest k with micro-batch coverage >= 1 - p (see
   :mod:`sparsebalance.policies.coverage` for packed micro-batches), clamped to ``[k_min, k0]``
   (*ours*: the constraint bounds how far DST lowers a budget; a micro-batch already under 1 - p at
   k0 keeps k0 rather than being forced slower than the baseline).
5. Budget = ``k*`` when ``k* >= f``; otherwise the feasible set is empty: budget = ``f`` and the event
   is counted (*ours*: the paper defines no fallback; the floor keeps accuracy first).

Per-layer budgets (``per_layer = true``, *ours*): when ``k* < k_hi`` and ``k* >= f``, ``m`` of the
``L`` layers get ``k* + 1``: the largest ``m`` whose interpolated latency
``lat(k*) + m / L (lat(k*+1) - lat(k*))`` stays <= A (exact for a latency additive over layers).
Those layers are spread evenly over the depth (layer i gets k*+1 when floor((i+1)m/L) > floor(im/L))
so every pipeline stage takes its share. The budget is then a tuple of length L.

``stats`` after each call: ``mean_budget`` (mean over micro-batches, per-layer budgets by their mean),
``floor_share`` (share of micro-batches whose budget equals their floor f), ``infeasible`` (count of
empty feasible sets), ``lowered``/``raised`` (micro-batches below/above k0), ``anchor_s``.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.predict import Predictor
from sparsebalance.simulator.plan import Budget, Budgets, Plan, uniform_budgets

_ANCHOR = {"mean": np.mean, "min": np.min, "max": np.max}


class Fixed:
    """``fixed``: MoBA's default, ``k0`` for every micro-batch and layer."""

    name = "fixed"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.stats: dict[str, float] = {}

    def budgets(self, plan: Plan, ctx: PolicyContext) -> Budgets:
        self.stats = {"mean_budget": float(self.cfg.k0)}
        return uniform_budgets(plan, self.cfg.k0)

    def observe(self, plan: Plan, budgets: Budgets, result=None) -> None:
        """Stateless."""


class DynamicSparsity:
    """``dst``: see the module docstring."""

    name = "dst"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.stats: dict[str, float] = {}
        self._predict: Predictor | None = None

    def floor(self, mb, ctx: PolicyContext, k_hi: int) -> int:
        """Coverage floor of a micro-batch, clamped to [k_min, k0]."""
        c = ctx.coverage.microbatch_curve(mb, k_hi)
        ok = np.nonzero(c >= 1.0 - self.cfg.p - 1e-12)[0]
        f = int(ok[0]) + 1 if ok.size else k_hi
        return max(self.cfg.k_min, min(f, self.cfg.k0))

    def budgets(self, plan: Plan, ctx: PolicyContext) -> Budgets:
        cfg = self.cfg
        if self._predict is None or self._predict.latency is not ctx.latency:
            self._predict = Predictor(ctx.latency)
        P = self._predict
        mbs = list(plan.microbatches())
        lat0 = np.array([P(mb.lengths, cfg.k0) for _, _, mb in mbs])
        agg = _ANCHOR[cfg.anchor]
        if cfg.anchor_scope == "global":
            anchors = np.full(len(mbs), agg(lat0))
        else:
            rank = np.array([r for r, _, _ in mbs])
            anchors = np.array([agg(lat0[rank == r]) for r in rank])
        layers = ctx.model.layers
        out: list[list[Budget]] = [[] for _ in plan.ranks]
        at_floor = infeasible = 0
        means = []
        for (r, _, mb), A in zip(mbs, anchors):
            n_blocks = -(-max(mb.lengths) // ctx.model.block_size)
            k_hi = min(cfg.k_max, max(cfg.k0, n_blocks))
            k = P.largest_within(mb.lengths, A, cfg.k_min, k_hi, start=cfg.k0)
            # the floor (<= k0) can only bind when k* <= k0; skip the coverage work otherwise
            f = self.floor(mb, ctx, k_hi) if k is None or k <= cfg.k0 else cfg.k0
            budget: Budget
            if k is None or k < f:
                infeasible += 1
                k = f
                budget = (f,) * layers if cfg.per_layer else f
            elif cfg.per_layer:
                budget = self._per_layer(mb.lengths, k, k_hi, A, layers)
            else:
                budget = k
            at_floor += k == f and k <= cfg.k0
            means.append(float(np.mean(budget)))
            out[r].append(budget)
        n = max(len(mbs), 1)
        self.stats = {
            "mean_budget": float(np.mean(means)) if means else float(cfg.k0),
            "floor_share": at_floor / n,
            "infeasible": float(infeasible),
            "lowered": float(sum(m < cfg.k0 for m in means)),
            "raised": float(sum(m > cfg.k0 for m in means)),
            "anchor_s": float(np.mean(anchors)) if len(mbs) else 0.0,
        }
        return tuple(tuple(b) for b in out)

    def _per_layer(self, lengths, k: int, k_hi: int, A: float, layers: int) -> tuple[int, ...]:
        m = 0
        if k < k_hi:
            lo, hi = self._predict(lengths, k), self._predict(lengths, k + 1)
            if hi > lo:
                m = int(np.floor(layers * (A - lo) / (hi - lo) + 1e-9))
                m = max(0, min(m, layers - 1))
        return tuple(k + 1 if (i + 1) * m // layers > i * m // layers else k for i in range(layers))

    def observe(self, plan: Plan, budgets: Budgets, result=None) -> None:
        """Budgets carry no state across iterations (decision 1). Coverage curves measured by the
        executor (realrun: ``result.coverage``) reach the coverage model through the loop, so the
        next floors use real gate scores whatever the tuning policy."""
