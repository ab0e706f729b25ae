
import pytest
from policy_doubles import make_ctx, random_batch

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.registry import make_batching, make_tuning
from sparsebalance.simulator.plan import Budget, Plan


def test_buckets_are_octaves():
    sab = make_batching(make_ctx(batching="sab").policy)
    assert [sab.bucket(L) for L in (1, 2, 3, 4, 1023, 1024, 16384, 16385, 32767)] == \
        [0, 1, 1, 2, 9, 10, 14, 14, 14]


def test_ema_update_closed_form():
    ctx = make_ctx(dp=1, global_batch=3, batching="sab", k0=32, ema_decay=0.75)
    sab = make_batching(ctx.policy)
    a, b, c = (Sequence(id=i, length=L) for i, L in enumerate((20000, 30000, 3000)))
    plan = Plan.from_lists([[[a, c], [b]]])
    sab.observe(plan, ((Budget.uniform(10), Budget.uniform(20)),), None)
    # bucket 14 holds a (budget 10) and b (budget 20): token-weighted 10*2/5 + 20*3/5 = 16
    assert sab.ema[14] == pytest.approx(0.75 * 32 + 0.25 * 16)
    assert sab.ema[11] == pytest.approx(0.75 * 32 + 0.25 * 10)
    sab.observe(plan, ((Budget.per_layer((4,) * 4), Budget.uniform(20)),), None)  # a per-layer budget counts as its mean
    assert sab.ema[11] == pytest.approx(0.75 * (0.75 * 32 + 0.25 * 10) + 0.25 * 4)
    assert sab.expected_budget(100) == 32


def test_ema_drives_costs():
    ctx = make_ctx(dp=1, global_batch=1, batching="sab")
    sab = make_batching(ctx.policy)
    s = Sequence(id=0, length=40000)
    before = sab.costs([s], ctx)[0]
    sab.ema[sab.bucket(40000)] = 8.5
    after = sab.costs([s], ctx)[0]
    lo, hi = (ctx.latency.microbatch_latency([40000], k) for k in (8, 9))
    assert after == pytest.approx(0.5 * (lo + hi)) and after < before


def test_sab_dst_loop_is_deterministic():
    def run():
        ctx = make_ctx(dp=2, global_batch=16, batching="sab", tuning="dst", token_cap=65536)
        sab, dst = make_batching(ctx.policy), make_tuning(ctx.policy)
        out = []
        for it in range(4):
            batch = random_batch(16, 100 + it)
            plan = sab.plan(batch, ctx)
            budgets = dst.budgets(plan, ctx)
            sab.observe(plan, budgets, None)
            out.append((plan, budgets, dict(sab.ema)))
        return out
    assert run() == run()


def test_costs_of_a_large_batch_interpolate_the_scalar_model():
    """300 sequences (the vectorised path) on the shipped latency model: each cost equals the
    scalar model at floor(k_est) and ceil(k_est), mixed linearly, k_est = its bucket's EMA."""
    from sparsebalance.simulator.config import ClusterConfig, qwen25_3b
    from sparsebalance.simulator.cost.latency import load_latency_model

    model = qwen25_3b()
    latency = load_latency_model("analytical-h200", model, ClusterConfig(pp=4, dp=2))
    ctx = make_ctx(dp=2, global_batch=300, batching="sab", latency=latency, block=model.block_size)
    sab = make_batching(ctx.policy)
    batch = random_batch(300, 3, lo=100, hi=65536)
    sab.ema.update({12: 20.25, 14: 9.0, 15: 40.5})
    got = sab.costs(batch, ctx)
    for s, c in zip(batch, got):
        k = sab.ema.get(sab.bucket(s.length), 32.0)
        lo, hi = (latency.microbatch_latency([s.length], kk) for kk in (int(k), int(k) + 1))
        assert c == pytest.approx(lo + (k - int(k)) * (hi - lo), rel=1e-12)
