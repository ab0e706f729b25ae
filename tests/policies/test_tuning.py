import itertools

import numpy as np
import pytest
from policy_doubles import make_ctx, random_batch

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.registry import make_batching, make_tuning
from sparsebalance.simulator.plan import Budget, Plan


def brute_floor(ctx, mb, p, k0, k_min=1):
    """Smallest k with token-weighted coverage >= 1 - p, clamped to [k_min, k0] (scan, no search).
    Weights are routed queries, max(0, length - block) (docs/coverage.md)."""
    B = ctx.model.block_size
    w = [max(0, s.length - B) for s in mb.sequences]
    for k in range(1, k0 + 1):
        c = (sum(wi * ctx.coverage.coverage(s, k) for wi, s in zip(w, mb.sequences)) / sum(w)
             if sum(w) else 1.0)
        if c >= 1 - p - 1e-12:
            return max(k, k_min)
    return k0


def lat(ctx, mb, b):
    return ctx.latency.microbatch_latency(mb.lengths, b)


def skewed_plan(seed=0):
    batch = random_batch(16, seed, lo=512, hi=65536)
    return batch, Plan.from_lists([[[s] for s in batch[:8]], [[s] for s in batch[8:]]])


@pytest.mark.parametrize("anchor", ["mean", "min", "max"])
@pytest.mark.parametrize("p", [0.05, 0.1, 0.3])
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_dst_stays_between_floor_and_k_max(anchor, p, per_layer, seed):
    _, plan = skewed_plan(seed)
    ctx = make_ctx(dp=2, global_batch=16, tuning="dst", anchor=anchor, p=p, per_layer=per_layer,
                   k0=16, k_max=40)
    budgets = make_tuning(ctx.policy).budgets(plan, ctx)
    for r, j, mb in plan.microbatches():
        ks = budgets[r][j].ks
        assert budgets[r][j].layers == (ctx.model.layers if per_layer else None)
        f = brute_floor(ctx, mb, p, 16)
        assert all(f <= k <= 40 for k in ks)


def test_max_anchor_never_slows_and_never_beats_fixed():
    for seed in range(5):
        _, plan = skewed_plan(seed)
        ctx = make_ctx(dp=2, global_batch=16, tuning="dst", anchor="max")
        budgets = make_tuning(ctx.policy).budgets(plan, ctx)
        base = [lat(ctx, mb, 32) for _, _, mb in plan.microbatches()]
        new = [lat(ctx, mb, budgets[r][j]) for r, j, mb in plan.microbatches()]
        assert max(new) <= max(base) * (1 + 1e-12)          # no straggler slowed further
        assert all(n >= b * (1 - 1e-12) for n, b in zip(new, base))  # nobody got faster than fixed


@pytest.mark.parametrize("scope", ["global", "pipeline"])
def test_mean_anchor_lowers_imbalance(scope):
    _, plan = skewed_plan(1)
    ctx = make_ctx(dp=2, global_batch=16, tuning="dst", anchor="mean", anchor_scope=scope, p=0.3)
    budgets = make_tuning(ctx.policy).budgets(plan, ctx)
    base = np.array([lat(ctx, mb, 32) for _, _, mb in plan.microbatches()])
    new = np.array([lat(ctx, mb, budgets[r][j]) for r, j, mb in plan.microbatches()])
    assert new.max() / new.mean() < base.max() / base.mean()


def test_dst_hits_the_anchor_exactly_when_unconstrained():
    """Closed form: with coverage ~1 everywhere (steep decay), each budget is the largest k whose
    latency is <= the mean anchor, found here by a linear scan."""
    batch = [Sequence(id=i, length=L, sensitivity=50.0) for i, L in enumerate([2048, 8192, 32768, 65536])]
    plan = Plan.from_lists([[[batch[0]], [batch[3]]], [[batch[1]], [batch[2]]]])
    ctx = make_ctx(dp=2, global_batch=4, tuning="dst", anchor="mean", p=0.1, k_max=64)
    budgets = make_tuning(ctx.policy).budgets(plan, ctx)
    A = np.mean([lat(ctx, mb, 32) for _, _, mb in plan.microbatches()])
    for r, j, mb in plan.microbatches():
        n_blocks = -(-max(mb.lengths) // 256)
        hi = min(64, max(32, n_blocks))
        want = max(k for k in range(1, hi + 1) if lat(ctx, mb, k) <= A * (1 + 1e-12))
        assert budgets[r][j] == Budget.uniform(want)


def test_infeasible_takes_the_floor_and_counts():
    batch = [Sequence(id=0, length=65536, sensitivity=1.0), Sequence(id=1, length=512, sensitivity=1.0)]
    plan = Plan.from_lists([[[batch[0]]], [[batch[1]]]])
    ctx = make_ctx(dp=2, global_batch=2, tuning="dst", anchor="min", p=0.1)
    tun = make_tuning(ctx.policy)
    budgets = tun.budgets(plan, ctx)
    f = brute_floor(ctx, plan.ranks[0][0], 0.1, 32)
    assert budgets[0][0] == Budget.uniform(f) and tun.stats["infeasible"] == 1.0
    assert tun.stats["floor_share"] >= 0.5


def test_per_layer_spreads_extra_layers_and_respects_anchor():
    _, plan = skewed_plan(2)
    ctx = make_ctx(dp=2, global_batch=16, tuning="dst", anchor="mean", per_layer=True, layers=8, p=0.3)
    budgets = make_tuning(ctx.policy).budgets(plan, ctx)
    A = np.mean([lat(ctx, mb, 32) for _, _, mb in plan.microbatches()])
    for r, j, mb in plan.microbatches():
        b = budgets[r][j]
        assert max(b.ks) - min(b.ks) <= 1
        if min(b.ks) > brute_floor(ctx, mb, 0.3, 32):  # not floored: within the anchor
            assert lat(ctx, mb, b) <= A * (1 + 1e-9)


def test_fixed_is_k0():
    _, plan = skewed_plan(0)
    ctx = make_ctx(dp=2, global_batch=16, k0=24)
    assert {b for r in make_tuning(ctx.policy).budgets(plan, ctx) for b in r} == {Budget.uniform(24)}


def test_measured_coverage_reaches_the_model_through_the_loop():
    """A curve measured by the executor (realrun's real gate scores) replaces the parametric one,
    whatever the tuning policy: the loop hands it to the coverage model."""
    import pandas as pd

    from sparsebalance.loop import run_loop
    from sparsebalance.simulator.engine.iteration import IterationResult

    class MeasuringExecutor:
        name = "measuring"

        def execute(self, iteration, plan, budgets):
            return IterationResult(iteration_time_s=1.0, trace=pd.DataFrame(),
                                   microbatch_latency_s=[[1.0]], stage_busy_s=[1.0],
                                   bubble_fraction=0.0, coverage={0: (1.0,)})

    batch = [Sequence(id=0, length=256 * 40, sensitivity=0.3)]
    ctx = make_ctx(dp=1, global_batch=1, tuning="fixed")
    assert ctx.coverage.coverage(batch[0], 1) < 1.0
    run_loop(batches=iter([batch]), batching=make_batching(ctx.policy), tuning=make_tuning(ctx.policy),
             executor=MeasuringExecutor(), ctx=ctx, iterations=1, progress=False)
    assert ctx.coverage.coverage(batch[0], 1) == 1.0


class VectorLatency:
    """ClosedFormLatency's formula with a numpy ``microbatch_latencies`` as well (so DST takes its
    vectorised path on many micro-batches); scalar calls stay available to the oracle."""

    def __init__(self, layers=4, block=256, a=1e-10, c=1e-7):
        self.layers, self.block, self.a, self.c = layers, block, a, c

    def microbatch_latency(self, lengths, budget):
        ks = Budget.of(budget).expand(self.layers)
        return sum(self.a * L * min(k, -(-L // self.block)) * self.block + self.c * L
                   for k in ks for L in lengths)

    def microbatch_latencies(self, microbatches, ks):
        ks = np.broadcast_to(np.asarray(ks), (len(microbatches),))
        return np.array([self.microbatch_latency(mb, int(k)) for mb, k in zip(microbatches, ks)])


@pytest.mark.parametrize("anchor,scope", [("mean", "global"), ("min", "pipeline"), ("max", "global")])
@pytest.mark.parametrize("per_layer", [False, True])
def test_dst_on_many_microbatches_matches_a_scan(anchor, scope, per_layer):
    """160 micro-batches (vectorised path): each budget equals the brute-force rule: the largest k
    in [k_min, k_hi] with latency <= anchor (linear scan), or the coverage floor when that is lower
    (or none exists); per-layer: m layers at k* + 1, m from the closed form."""
    rng = np.random.default_rng(7)
    batch = random_batch(320, 11, lo=300, hi=65536)
    mbs = [batch[i:i + int(n)] for i, n in zip(range(0, 320, 2), rng.integers(1, 3, 160))]
    plan = Plan.from_lists([[mb for mb in mbs[:80]], [mb for mb in mbs[80:]]])
    ctx = make_ctx(dp=2, global_batch=320, tuning="dst", anchor=anchor, anchor_scope=scope,
                   p=0.2, k0=16, k_max=48, per_layer=per_layer, latency=VectorLatency())
    dst = make_tuning(ctx.policy)
    budgets = dst.budgets(plan, ctx)
    lat0 = {(r, j): lat(ctx, mb, 16) for r, j, mb in plan.microbatches()}
    agg = {"mean": np.mean, "min": np.min, "max": np.max}[anchor]
    floors = 0
    for r, j, mb in plan.microbatches():
        pool = [v for (q, _), v in lat0.items() if scope == "global" or q == r]
        A = agg(pool)
        k_hi = min(48, max(16, -(-max(mb.lengths) // 256)))
        ok = [k for k in range(1, k_hi + 1) if lat(ctx, mb, k) <= A * (1 + 1e-12)]
        f = brute_floor(ctx, mb, 0.2, 16)
        if not ok or max(ok) < f:
            want = (f,) * 4 if per_layer else f
            floors += 1
        elif per_layer:
            k = max(ok)
            m = 0
            if k < k_hi:
                lo_, hi_ = lat(ctx, mb, k), lat(ctx, mb, k + 1)
                m = min(3, max(0, int(np.floor(4 * (A - lo_) / (hi_ - lo_) + 1e-9)))) if hi_ > lo_ else 0
            want = tuple(k + 1 if (i + 1) * m // 4 > i * m // 4 else k for i in range(4))
        else:
            want = max(ok)
        assert budgets[r][j] == Budget.of(want), (r, j)
    assert dst.stats["infeasible"] == floors


def test_dst_with_the_shipped_latency_model_matches_a_scan():
    """The real (analytical H200) latency model, 96 micro-batches: budgets equal a linear scan of
    ``microbatch_latency`` (scalar calls) under the mean anchor."""
    from sparsebalance.simulator.config import ClusterConfig, qwen25_3b
    from sparsebalance.simulator.cost.latency import load_latency_model

    model = qwen25_3b()
    latency = load_latency_model("analytical-h200", model, ClusterConfig(pp=4, dp=2))
    batch = random_batch(192, 5, lo=500, hi=65536)
    plan = Plan.from_lists([[[s] for s in batch[:96]], [[s] for s in batch[96:]]])
    ctx = make_ctx(dp=2, global_batch=192, tuning="dst", anchor="mean", p=0.1, latency=latency,
                   block=model.block_size)
    budgets = make_tuning(ctx.policy).budgets(plan, ctx)
    A = np.mean([latency.microbatch_latency(mb.lengths, 32) for _, _, mb in plan.microbatches()])
    for r, j, mb in plan.microbatches():
        k_hi = min(64, max(32, -(-max(mb.lengths) // model.block_size)))
        # the longest run of budgets from 1 that fit: the shipped tables are not monotone at the full
        # budget (the masked path below it pays the gate; docs/costmodel.md), and DST's bisection
        # stops at the first budget that does not fit
        ok = list(itertools.takewhile(lambda k, mb=mb: latency.microbatch_latency(mb.lengths, k) <= A * (1 + 1e-12),
                                      range(1, k_hi + 1)))
        f = brute_floor(ctx, mb, 0.1, 32)
        assert budgets[r][j] == Budget.uniform(max(ok) if ok and max(ok) >= f else f)


@pytest.mark.parametrize("agg", ["tokens", "min"])
@pytest.mark.parametrize("seed", range(3))
def test_dst_floors_of_many_microbatches_equal_each_alone(agg, seed):
    """Oracle: each micro-batch's own coverage curve (``microbatch_curve``, one micro-batch at a
    time) read for the first k reaching 1 - p: the batched floors (rows of one matrix) equal it,
    packed micro-batches of mixed lengths included."""
    from sparsebalance.policies.tuning import DynamicSparsity

    ctx = make_ctx(dp=1, global_batch=60, k0=6, k_min=1, p=0.15, coverage_agg=agg, seed=seed)
    seqs = random_batch(60, seed, lo=300, hi=20000)
    rng = np.random.default_rng(seed)
    cut = np.sort(rng.choice(np.arange(1, 60), 19, replace=False))
    mbs = Plan.from_lists([[list(x) for x in np.split(np.array(seqs, dtype=object), cut)]]).ranks[0]
    k_hi = rng.integers(1, 12, len(mbs))
    dst = DynamicSparsity(ctx.policy)
    cfg = ctx.policy
    alone = []
    for mb, kh in zip(mbs, k_hi.tolist()):
        k_top = min(kh, cfg.k0)
        c = ctx.coverage.microbatch_curve(mb, k_top)
        ok = np.nonzero(c >= 1.0 - cfg.p - 1e-12)[0]
        alone.append(max(cfg.k_min, min(int(ok[0]) + 1 if ok.size else k_top, cfg.k0)))
    assert dst.floors(mbs, ctx, k_hi).tolist() == alone
    assert len(set(alone)) > 1  # the case decides something
