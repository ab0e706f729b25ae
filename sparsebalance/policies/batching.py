"""Batching policies that need no latency model: sequential, lbb, sorted, quadratic.

Every policy returns a :class:`Plan` with ``dp`` ranks and the same number ``M`` of micro-batches on
each rank. Two modes:

* **fixed micro-batch size** (``policy.token_cap`` unset): every micro-batch holds exactly
  ``cluster.micro_batch_size`` sequences, ``M = len(batch) / (dp * micro_batch_size)``.
* **token-cap packing** (``policy.token_cap`` set): a micro-batch packs several sequences up to the
  cap. The balancing packers (lbb, quadratic, sab) start from
  ``M = max(min_microbatches, ceil(tokens / (dp * cap)))`` (the fewest micro-batches the cap allows,
  but at least ``policy.min_microbatches``, default ``cluster.pp``, so the pipeline fills) and
  raise ``M`` until no rank has to exceed the cap (galloping up in steps of M/32, M/16, ..., then
  bisecting the last gap down to M/64; at most ``len(batch) / dp``); a sequence longer
  than the cap gets a micro-batch of its own. A count is tried by LPT alone, which gives up at the
  first sequence that would push a multi-sequence micro-batch over the cap; improvement swaps run
  once, on the final packing (they never break the cap, so they cannot make it infeasible). The order-keeping policies (sequential, sorted) fill
  micro-batches greedily in their order, then split the fullest multi-sequence micro-batch at its
  token midpoint until the count is a multiple of ``dp`` and at least ``dp * min_microbatches``.

Balancing packers are two-stage (see :func:`two_stage`): LPT of the sequences across DP ranks by
cost, then LPT of each rank's sequences into its ``M`` micro-batches; micro-batches of a rank run in
decreasing cost order (largest first, so the pipeline fills with the long ones; the paper is silent).
"""

from __future__ import annotations

import math

import numpy as np

from sparsebalance.data.sequence import Sequence
from sparsebalance.errors import ConfigError
from sparsebalance.policies import packing
from sparsebalance.policies.base import PolicyContext
from sparsebalance.simulator.plan import Budgets, MicroBatch, Plan


def _check_batch(batch: list[Sequence], ctx: PolicyContext) -> tuple[int, int | None]:
    dp, cap = ctx.cluster.dp, ctx.policy.token_cap
    if cap is None and len(batch) % (dp * ctx.cluster.micro_batch_size):
        raise ConfigError(f"global_batch: {len(batch)} sequences do not split into dp x "
                          f"micro_batch_size = {dp * ctx.cluster.micro_batch_size}")
    if len(batch) < dp or len(batch) % dp:
        raise ConfigError(f"global_batch: {len(batch)} sequences do not split over dp = {dp} ranks")
    return dp, cap


def two_stage(batch: list[Sequence], costs: np.ndarray, ctx: PolicyContext, *,
              swaps: int = 0) -> Plan:
    """LPT across DP ranks, then LPT into micro-batches, optionally followed by ``swaps`` rounds of
    :func:`packing.improve` at each stage. ``costs``: shape [len(batch)], any additive unit."""
    if ctx.policy.slot_tokens is not None:
        return fixed_slots(batch, costs, ctx, swaps=swaps)
    dp, cap = _check_batch(batch, ctx)
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.array([s.length for s in batch], dtype=np.float64)
    n = len(batch)
    if cap is None:
        per_rank, mbs = n // dp, ctx.cluster.micro_batch_size
        ranks = packing.lpt(costs, dp, count=per_rank)
        if swaps:
            ranks = packing.improve(ranks, costs, rounds=swaps)
        plan = []
        for row in ranks:
            idx = np.asarray(row)
            mbs_idx = packing.lpt(costs[idx], per_rank // mbs, count=mbs)
            if swaps and mbs > 1:
                mbs_idx = packing.improve(mbs_idx, costs[idx], rounds=swaps)
            plan.append([[int(idx[i]) for i in mb] for mb in mbs_idx])
        return _to_plan(batch, plan, costs)
    m = min(n // dp, max(min_microbatches(ctx), math.ceil(tokens.sum() / (dp * cap))))
    hi = n // dp

    first: list = []

    def attempt(mm: int):
        if first and min(len(r) for r in first[0]) >= mm:
            ranks = first[0]  # stage 1 depends on the count only when min_count binds
        else:
            ranks = packing.lpt(costs, dp, min_count=mm)
            if swaps:
                ranks = packing.improve(ranks, costs, rounds=swaps, moves=True, min_count=mm)
            first[:] = [ranks]
        return ranks, _pack_ranks(ranks, costs, tokens, mm, cap)

    ranks, plan = attempt(m)
    if plan is None and m < hi:
        # gallop up in growing relative steps until the cap holds, then bisect the last gap for the
        # fewest micro-batches that keep it (feasibility taken as monotone in the count)
        bad, step, good = m, max(1, m // 32), None
        while good is None:
            cand = min(hi, bad + step)
            ranks_c, plan_c = attempt(cand)
            if plan_c is not None or cand == hi:
                good = (cand, ranks_c, plan_c)
            else:
                bad, step = cand, step * 2
        while good[0] - bad > max(1, bad // 64):  # to within 1/64: not worth more packings
            mid = (bad + good[0]) // 2
            ranks_c, plan_c = attempt(mid)
            if plan_c is not None:
                good = (mid, ranks_c, plan_c)
            else:
                bad = mid
        m, ranks, plan = good
    if plan is None:  # even the most micro-batches break it: keep the last packing, over the cap
        plan = _pack_ranks(ranks, costs, tokens, m, cap, force=True)
    if swaps:  # swaps never push a multi-sequence micro-batch over the cap: only the final packing
        plan = [packing.improve(mbs, costs[idx], rounds=swaps, moves=True, tokens=tokens[idx],
                                token_cap=cap) for idx, mbs in zip(ranks, plan)]
    return _to_plan(batch, [[[int(idx[i]) for i in mb] for mb in mbs]
                            for idx, mbs in zip(ranks, plan)], costs)


def fixed_slots(batch: list[Sequence], costs: np.ndarray, ctx: PolicyContext, *, swaps: int = 0) -> Plan:
    """Two-stage LPT into exactly ``min_microbatches`` slots of ``policy.slot_tokens`` tokens per DP
    rank, each slot holding at least one document, then each padded to the slot (``MicroBatch.pad``).
    Stage 1 balances cost across ranks preferring ranks whose slots still have room; stage 2 packs a
    rank's documents into its slots under the cap (strictly); swaps keep the cap. A batch that does not
    fit is refused: fixed slots cannot take more micro-batches."""
    dp, slot, m = ctx.cluster.dp, ctx.policy.slot_tokens, min_microbatches(ctx)
    if slot is None:  # the policy sends only slotted runs here; a library caller may not
        raise ConfigError("slot_tokens: fixed slots need policy.slot_tokens (tokens per slot), got none")
    if len(batch) < dp * m:
        raise ConfigError(f"global_batch: {len(batch)} documents cannot give each of the dp x slots = "
                          f"{dp} x {m} slots a document")
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.array([s.length for s in batch], dtype=np.float64)
    if tokens.max() > slot:
        raise ConfigError(f"slot_tokens: a {int(tokens.max())}-token document does not fit a slot of {slot}")
    ranks = packing.lpt(costs, dp, min_count=m, tokens=tokens, token_cap=m * slot)
    plan = _pack_ranks(ranks, costs, tokens, m, slot)
    if plan is None:
        raise ConfigError(f"slot_tokens: {int(tokens.sum())} tokens in {len(batch)} documents do not pack "
                          f"into dp x slots = {dp} x {m} slots of {slot} tokens; fewer documents per step "
                          "(global_batch) or longer slots")
    if swaps:
        plan = [packing.improve(mbs, costs[idx], rounds=swaps, moves=True, tokens=tokens[idx],
                                token_cap=slot) for idx, mbs in zip(ranks, plan)]
    out = _to_plan(batch, [[[int(idx[i]) for i in mb] for mb in mbs] for idx, mbs in zip(ranks, plan)], costs)
    return Plan(tuple(tuple(MicroBatch(mb.sequences, pad=slot - mb.tokens) for mb in r) for r in out.ranks))


def _pack_ranks(ranks, costs, tokens, m: int, cap: int, force: bool = False):
    """Stage 2: LPT of each rank's sequences into ``m`` micro-batches (indices into the rank's
    list); None as soon as a multi-sequence micro-batch would exceed the cap (unless ``force``)."""
    plan = []
    for idx in ranks:
        idx = np.asarray(idx)
        mbs_idx = packing.lpt(costs[idx], m, min_count=1, tokens=tokens[idx], token_cap=cap,
                              strict_cap=not force)
        if mbs_idx is None:
            return None
        plan.append(mbs_idx)
    return plan


def min_microbatches(ctx: PolicyContext) -> int:
    """Token-cap packing's lower bound on micro-batches per rank: policy.min_microbatches, or the
    least the schedule runs well with (pp; 2 pp for dualpipev, which torch refuses below it)."""
    from sparsebalance.simulator.schedule.schedules import fewest_microbatches

    m = ctx.policy.min_microbatches
    return m if m is not None else fewest_microbatches(ctx.cluster.schedule, ctx.cluster.pp)


def _to_plan(batch: list[Sequence], ranks: list[list[list[int]]], costs: np.ndarray) -> Plan:
    out = []
    for mbs in ranks:
        mbs = sorted(mbs, key=lambda mb: (-float(costs[mb].sum()), min(mb)))
        out.append([[batch[i] for i in sorted(mb, key=lambda i: (-costs[i], i))] for mb in mbs])
    return Plan.from_lists(out)


def ordered_plan(seqs: list[Sequence], ctx: PolicyContext, *, round_robin: bool) -> Plan:
    """Micro-batches in the given order (fixed size, or greedy fill to the token cap, then split
    until their count is a multiple of dp); contiguous blocks per rank, or dealt round-robin."""
    dp, cap = _check_batch(seqs, ctx)
    mbs: list[list[Sequence]]
    if cap is None:
        size = ctx.cluster.micro_batch_size
        mbs = [seqs[i:i + size] for i in range(0, len(seqs), size)]
    else:
        mbs = []
        cur: list[Sequence] = []
        tok = 0
        for s in seqs:
            if cur and tok + s.length > cap:
                mbs.append(cur)
                cur, tok = [], 0
            cur.append(s)
            tok += s.length
        mbs.append(cur)
        want = min(len(seqs), dp * min_microbatches(ctx))
        while len(mbs) % dp or len(mbs) < want:
            j = max((i for i, mb in enumerate(mbs) if len(mb) > 1),
                    key=lambda i: sum(s.length for s in mbs[i]))
            mb = mbs[j]
            half = sum(s.length for s in mb) / 2
            acc, cut = 0, 1
            for t, s in enumerate(mb[:-1]):  # first cut point at or past half the tokens
                acc += s.length
                cut = t + 1
                if acc >= half:
                    break
            mbs[j:j + 1] = [mb[:cut], mb[cut:]]
    m = len(mbs) // dp
    if round_robin:
        ranks = [[mbs[t] for t in range(r, len(mbs), dp)] for r in range(dp)]
    else:
        ranks = [mbs[r * m:(r + 1) * m] for r in range(dp)]
    return Plan.from_lists(ranks)


class _Stateless:
    name = ""

    def observe(self, plan: Plan, budgets: Budgets, result) -> None:
        """Nothing to learn: the plan depends on lengths only."""


class Sequential(_Stateless):
    """Data order: consecutive sequences form micro-batches, consecutive micro-batches a rank."""

    name = "sequential"

    def plan(self, batch: list[Sequence], ctx: PolicyContext) -> Plan:
        return ordered_plan(list(batch), ctx, round_robin=False)


class Sorted(_Stateless):
    """LongAlign-style sorted batching: sort by length (longest first, ties by id), cut into
    micro-batches of neighbours, deal them round-robin to the ranks (LongAlign shuffles the
    batches instead; round-robin keeps it deterministic and spreads long ones over ranks)."""

    name = "sorted"

    def plan(self, batch: list[Sequence], ctx: PolicyContext) -> Plan:
        seqs = sorted(batch, key=lambda s: (-s.length, s.id))
        return ordered_plan(seqs, ctx, round_robin=True)


class LengthBased(_Stateless):
    """LBB, the paper's baseline batching: balance token counts (cost = length) with two-stage LPT."""

    name = "lbb"

    def plan(self, batch: list[Sequence], ctx: PolicyContext) -> Plan:
        return two_stage(batch, np.array([s.length for s in batch], dtype=np.float64), ctx)


class Quadratic(_Stateless):
    """WLB-style: balance sum of length^2 (attention's quadratic term) with two-stage LPT."""

    name = "quadratic"

    def plan(self, batch: list[Sequence], ctx: PolicyContext) -> Plan:
        return two_stage(batch, np.array([float(s.length) ** 2 for s in batch]), ctx)
