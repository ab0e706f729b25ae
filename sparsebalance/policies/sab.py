"""SAB, sparsity-aware batching: pack by predicted latency at the budget DST is likely to choose.

Decisions (the paper states the idea, not these details):

* **Cost of a sequence** = ``latency.microbatch_latency([length], k_est)`` (seconds, F + B over the
  model) where ``k_est`` is the EMA budget of the sequence's length bucket; a fractional ``k_est``
  is interpolated between its integer neighbours. A micro-batch's cost is the sum of its sequences'
  costs (the dense part is linear in tokens, so this is the single-sequence predictions' sum up to
  the fixed per-micro-batch terms).
* **Buckets**: ``floor(log_b(length))`` with ``b = policy.bucket_base`` (2: one bucket per octave,
  e.g. 16K-32K), so sequences of similar length share what DST did to their peers.
* **EMA**: every bucket starts at ``k0``. After each iteration, each bucket that occurred is updated
  once with the token-weighted mean budget its sequences received (a per-layer budget counts as its
  layer mean): ``ema = d * ema + (1 - d) * observed`` with ``d = policy.ema_decay``. One update per
  bucket per iteration keeps the state independent of the order of sequences in the plan.
* **Packing**: two stages within the current global batch (across DP ranks, then into micro-batches,
  see :func:`sparsebalance.policies.batching.two_stage`), LPT, then with ``packer = "lpt-swap"``
  at most ``swap_rounds`` improving pairwise swaps/moves per stage.
"""

from __future__ import annotations

import math

import numpy as np

from sparsebalance import jit
from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.batching import two_stage
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.predict import Predictor
from sparsebalance.simulator.plan import Budgets, Plan


class SparsityAware:
    """``sab``: see the module docstring."""

    name = "sab"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.ema: dict[int, float] = {}
        """EMA budget per length bucket (missing bucket = k0)."""
        self._predict: Predictor | None = None
        self._buckets: dict[int, int] = {}

    def bucket(self, length: int) -> int:
        b = self._buckets.get(length)
        if b is None:
            # a tiny epsilon keeps exact powers (e.g. 2**14) in their own bucket despite float log
            b = math.floor(math.log(length) / math.log(self.cfg.bucket_base) + 1e-9)
            if len(self._buckets) < 1_000_000:  # memo per length: lengths recur, logs add up
                self._buckets[length] = b
        return b

    def expected_budget(self, length: int) -> float:
        return self.ema.get(self.bucket(length), float(self.cfg.k0))

    def expected_budgets(self, lengths: np.ndarray) -> np.ndarray:
        """:meth:`expected_budget` of every length of ``lengths`` (int [N]) -> float [N]."""
        uniq, inv = np.unique(np.asarray(lengths, dtype=np.int64), return_inverse=True)
        return np.array([self.expected_budget(x) for x in uniq.tolist()], dtype=np.float64)[inv.reshape(-1)]

    def costs(self, batch: list[Sequence], ctx: PolicyContext) -> np.ndarray:
        """Predicted latency (seconds, shape [len(batch)]) of each sequence alone at its bucket's
        EMA budget: one vectorised prediction for the whole batch (two where k_est is fractional)."""
        if self._predict is None or self._predict.latency is not ctx.latency:
            self._predict = Predictor(ctx.latency)
        lengths = np.fromiter((s.length for s in batch), dtype=np.int64, count=len(batch))
        return self._predict.at_many(lengths, self.expected_budgets(lengths))

    def plan(self, batch: list[Sequence], ctx: PolicyContext) -> Plan:
        jit.warm(len(batch) >= 2048)  # LPT over thousands of items ahead (sparsebalance/jit.py)
        swaps = self.cfg.swap_rounds if self.cfg.packer == "lpt-swap" else 0
        if self.cfg.memory_aware:
            return self._memory_aware_plan(batch, ctx, swaps)
        return two_stage(batch, self.costs(batch, ctx), ctx, swaps=swaps)

    def _memory_aware_plan(self, batch: list[Sequence], ctx: PolicyContext, swaps: int) -> Plan:
        """Token-cap packing under min(``token_cap``, the memory model's cap): the most tokens per
        micro-batch with which every device fits when all micro-batches in flight are that large.
        In-flight counts come from the schedule's orders for the plan's micro-batch count, so the
        cap is recomputed when packing yields more micro-batches (GPipe keeps all in flight)."""
        from dataclasses import replace

        from sparsebalance.errors import ConfigError
        from sparsebalance.simulator.cost.memory import memory_report, token_cap_for_memory
        from sparsebalance.simulator.schedule.graph import schedule_graph

        cl = ctx.cluster
        costs = self.costs(batch, ctx)
        longest = max(s.length for s in batch)
        from sparsebalance.policies.batching import min_microbatches

        m = max(cl.pp, min_microbatches(ctx))
        plan: Plan | None = None
        for _ in range(8):
            cap = token_cap_for_memory(ctx.model, cl, schedule_graph(cl.schedule, cl.pp, m, cl.virtual_stages))
            if self.cfg.token_cap is not None:
                cap = min(cap, self.cfg.token_cap)
            if cap < longest:
                raise ConfigError(f"cluster.device_memory: a {longest}-token sequence does not fit "
                                  f"(at most {cap} tokens per micro-batch under the memory model); "
                                  "use more pp or tp, recompute, or dp_mode zero1 / zero3")
            sub = replace(ctx, policy=replace(self.cfg, token_cap=cap))
            plan = two_stage(batch, costs, sub, swaps=swaps)
            m_plan = plan.num_microbatches
            g = schedule_graph(cl.schedule, cl.pp, m_plan, cl.virtual_stages)
            tokens = [[mb.tokens for mb in r] for r in plan.ranks]
            if m_plan <= m or memory_report(ctx.model, cl, g, tokens).exceeded == 0:
                return plan
            m = m_plan
        assert plan is not None  # the loop ran
        return plan

    def observe(self, plan: Plan, budgets: Budgets, result=None) -> None:
        num: dict[int, float] = {}
        den: dict[int, float] = {}
        for r, j, mb in plan.microbatches():
            k = budgets[r][j].mean()
            for s in mb.sequences:
                key = self.bucket(s.length)
                num[key] = num.get(key, 0.0) + s.length * k
                den[key] = den.get(key, 0.0) + s.length
        d = self.cfg.ema_decay
        for key in sorted(num):
            prev = self.ema.get(key, float(self.cfg.k0))
            self.ema[key] = d * prev + (1.0 - d) * num[key] / den[key]
