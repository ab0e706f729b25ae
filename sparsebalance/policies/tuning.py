"""Tuning policies: ``fixed`` (k0 everywhere), ``fixed-dense`` (k0, or full attention where it is
predicted no slower) and ``dst`` (dynamic sparsity tuning).

DST, per iteration (decisions where the paper is silent are marked *ours*):

1. Predict every micro-batch's latency at ``k0`` (*ours*: every iteration starts from the default
   budget; a micro-batch position holds different sequences each iteration, so last iteration's
   budget at that position says nothing about this one, and SAB already carries the history).
2. Anchor ``A`` = mean | min | max of those predictions over the scope: all micro-batches of the
   iteration (``anchor_scope = "global"``: DP replicas wait for each other at the all-reduce) or
   the micro-batches of one DP pipeline (``"pipeline"``).
3. ``k*`` = the largest ``k`` in ``[k_min, k_hi]`` with predicted latency <= ``A`` (binary search,
   latency is non-decreasing in k; all micro-batches in lock-step, one vectorised prediction per
   step, see :meth:`Predictor.largest_within_many`). Stragglers (latency > A) thus lower their budget, fast ones raise
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

from collections.abc import Callable
from typing import Any

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.predict import Predictor
from sparsebalance.simulator.plan import Budget, Budgets, Plan, uniform_budgets

_ANCHOR: dict[str, Callable[[np.ndarray], Any]] = {"mean": np.mean, "min": np.min, "max": np.max}


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


class FixedDense:
    """``fixed-dense``: ``k0``, or full attention (the micro-batch's block count, at most ``k_max``)
    where the latency table predicts it no slower. A kernel whose sparse path costs more than dense
    attention when k0 selects most blocks (the CPU path at 1-2K tokens, k0 = 32) makes plain ``fixed``
    a slow reference; this one is never sparser than ``fixed`` and never predicted slower (*ours*:
    the paper's baseline is plain ``fixed``)."""

    name = "fixed-dense"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.stats: dict[str, float] = {}
        self._predict: Predictor | None = None

    def budgets(self, plan: Plan, ctx: PolicyContext) -> Budgets:
        cfg = self.cfg
        if self._predict is None or self._predict.latency is not ctx.latency:
            self._predict = Predictor(ctx.latency)
        mbs = list(plan.microbatches())
        lengths = [mb.lengths for _, _, mb in mbs]
        full = blocks(np.array([max(x) for x in lengths], dtype=np.int64), ctx.model.block_size)
        ks = np.full(len(mbs), cfg.k0, dtype=np.int64)
        cand = np.flatnonzero((full > cfg.k0) & (full <= cfg.k_max))
        if cand.size:
            sub = [lengths[i] for i in cand.tolist()]
            faster = self._predict.many(sub, full[cand]) <= self._predict.many(sub, cfg.k0)
            ks[cand[faster]] = full[cand[faster]]
        out: list[list[Budget]] = [[] for _ in plan.ranks]
        for (r, _, _), k in zip(mbs, ks.tolist(), strict=True):
            out[r].append(Budget.uniform(k))
        self.stats = {"mean_budget": float(ks.mean()) if len(mbs) else float(cfg.k0),
                      "raised": float((ks > cfg.k0).sum())}
        return tuple(tuple(b) for b in out)

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
        """Coverage floor of a micro-batch, clamped to [k_min, k0]. Only C(1..k0) is needed: a
        floor beyond k0 is clamped to k0 anyway (k_hi >= k0 always)."""
        return int(self.floors([mb], ctx, np.array([k_hi]))[0])

    def floors(self, mbs, ctx: PolicyContext, k_hi: np.ndarray) -> np.ndarray:
        """:meth:`floor` of many micro-batches (int [len(mbs)]): their curves as rows of one
        coverage matrix (``CoverageModel.microbatch_matrix``: a row does not depend on the other
        micro-batches or the width, so each is its ``microbatch_curve``)."""
        cfg = self.cfg
        k_top = np.minimum(np.asarray(k_hi, dtype=np.int64), cfg.k0)
        width = int(k_top.max()) if len(mbs) else 0
        ok = ctx.coverage.microbatch_matrix(list(mbs), width) >= 1.0 - cfg.p - 1e-12
        ok &= np.arange(width)[None, :] < k_top[:, None]  # C(1..k_top) only
        f = np.where(ok.any(axis=1), ok.argmax(axis=1) + 1, k_top)
        return np.maximum(cfg.k_min, np.minimum(f, cfg.k0))

    def budgets(self, plan: Plan, ctx: PolicyContext) -> Budgets:
        """All micro-batches at once: one vectorised prediction at k0, then a lock-step bisection
        for k* (see :meth:`Predictor.largest_within_many`); floors only where k* <= k0."""
        cfg = self.cfg
        if self._predict is None or self._predict.latency is not ctx.latency:
            self._predict = Predictor(ctx.latency)
        P = self._predict
        mbs = list(plan.microbatches())
        lengths = [mb.lengths for _, _, mb in mbs]
        rank = np.array([r for r, _, _ in mbs], dtype=np.int64)
        lat0 = P.many(lengths, cfg.k0)
        agg = _ANCHOR[cfg.anchor]
        if not mbs:
            anchors = np.zeros(0)
        elif cfg.anchor_scope == "global":
            anchors = np.full(len(mbs), agg(lat0))
        else:
            per_rank = {r: agg(lat0[rank == r]) for r in np.unique(rank).tolist()}
            anchors = np.array([per_rank[r] for r in rank.tolist()])
        n_blocks = blocks(np.array([max(x) for x in lengths], dtype=np.int64), ctx.model.block_size)
        k_hi = np.minimum(cfg.k_max, np.maximum(cfg.k0, n_blocks))
        kstar = P.largest_within_many(lengths, anchors, cfg.k_min, k_hi, start=cfg.k0,
                                      at_start=lat0)
        layers = ctx.model.layers
        step = self._per_layer_counts(lengths, kstar, k_hi, anchors, layers) if cfg.per_layer \
            else None
        out: list[list[Budget]] = [[] for _ in plan.ranks]
        at_floor = infeasible = 0
        means = []
        # the floor (<= k0) can only bind when k* <= k0; skip the coverage work otherwise
        floor = np.full(len(mbs), cfg.k0, dtype=np.int64)
        need = np.flatnonzero(kstar <= cfg.k0)
        if need.size:
            floor[need] = self.floors([mbs[i][2] for i in need.tolist()], ctx, k_hi[need])
        for i, (r, _, mb) in enumerate(mbs):
            k = int(kstar[i])
            f = int(floor[i])
            budget: Budget
            if k < f:  # k == -1: even k_min is too slow
                infeasible += 1
                k = f
                budget = Budget.per_layer((f,) * layers) if cfg.per_layer else Budget.uniform(f)
            elif step is not None:
                budget = Budget.per_layer(_spread(k, int(step[i]), layers))
            else:
                budget = Budget.uniform(k)
            at_floor += k == f and k <= cfg.k0
            means.append(budget.mean() if step is not None else float(k))
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

    def _per_layer_counts(self, lengths, kstar: np.ndarray, k_hi: np.ndarray, anchors: np.ndarray,
                          layers: int) -> np.ndarray:
        """Per micro-batch, how many layers get k* + 1: the largest m with
        lat(k*) + m / L (lat(k*+1) - lat(k*)) <= A (0 where k* is -1 or k_hi)."""
        m = np.zeros(len(lengths), dtype=np.int64)
        idx = np.flatnonzero((kstar >= 1) & (kstar < k_hi))
        if idx.size:
            assert self._predict is not None  # made by budgets(), which calls this
            sub = [lengths[i] for i in idx.tolist()]
            lo = self._predict.many(sub, kstar[idx])
            hi = self._predict.many(sub, kstar[idx] + 1)
            rise = hi > lo
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.floor(layers * (anchors[idx] - lo) / np.where(rise, hi - lo, 1.0) + 1e-9)
            m[idx] = np.where(rise, np.clip(q, 0, layers - 1), 0).astype(np.int64)
        return m

    def observe(self, plan: Plan, budgets: Budgets, result=None) -> None:
        """Budgets carry no state across iterations (decision 1). Coverage curves measured by the
        executor (realrun: ``result.coverage``) reach the coverage model through the loop, so the
        next floors use real gate scores whatever the tuning policy."""


def _spread(k: int, m: int, layers: int) -> tuple[int, ...]:
    """``m`` of ``layers`` layers at k + 1, evenly over the depth (layer i when floor((i+1)m/L) >
    floor(im/L)), the rest at k."""
    return tuple(k + 1 if (i + 1) * m // layers > i * m // layers else k for i in range(layers))
