import pytest
from policy_doubles import check_plan, make_ctx, random_batch

from sparsebalance.data.sequence import Sequence
from sparsebalance.errors import ConfigError
from sparsebalance.policies.registry import BATCHING, make_batching, make_tuning


def rank_times(plan, latency, k=32):
    """Independent oracle of a DP iteration without pipeline effects: the slowest rank's sum."""
    return max(sum(latency.microbatch_latency(mb.lengths, k) for mb in r) for r in plan.ranks)


@pytest.mark.parametrize("name", sorted(BATCHING))
@pytest.mark.parametrize("cap", [None, 40000])
@pytest.mark.parametrize("seed", range(3))
def test_plans_are_valid(name, cap, seed):
    batch = random_batch(16, seed)
    ctx = make_ctx(dp=2, global_batch=16, token_cap=cap, batching=name)
    plan = make_batching(ctx.policy).plan(batch, ctx)
    check_plan(plan, batch, 2)
    if cap is None:
        assert plan.num_microbatches == 8
    else:
        for _, _, mb in plan.microbatches():
            assert mb.tokens <= cap or len(mb.sequences) == 1


def test_fixed_size_micro_batches():
    batch = random_batch(16, 1)
    for name in BATCHING:
        ctx = make_ctx(dp=2, global_batch=16, micro_batch_size=2, batching=name)
        plan = make_batching(ctx.policy).plan(batch, ctx)
        check_plan(plan, batch, 2)
        assert all(len(mb.sequences) == 2 for _, _, mb in plan.microbatches())


@pytest.mark.parametrize("cap", [None, 16384])
def test_uniform_lengths_give_the_same_iteration_time(cap):
    batch = [Sequence(id=i, length=4096, sensitivity=1.0) for i in range(16)]
    times = {}
    for name in BATCHING:
        ctx = make_ctx(dp=2, global_batch=16, token_cap=cap, batching=name)
        plan = make_batching(ctx.policy).plan(batch, ctx)
        times[name] = rank_times(plan, ctx.latency)
    assert len({round(t, 15) for t in times.values()}) == 1, times


def test_sequential_keeps_data_order():
    batch = random_batch(8, 0)
    ctx = make_ctx(dp=2, global_batch=8)
    plan = make_batching(ctx.policy).plan(batch, ctx)
    assert [s.id for s in plan.sequences()] == list(range(8))


def test_sorted_deals_longest_first_round_robin():
    batch = random_batch(8, 0)
    ctx = make_ctx(dp=2, global_batch=8, batching="sorted")
    plan = make_batching(ctx.policy).plan(batch, ctx)
    order = sorted(batch, key=lambda s: -s.length)
    assert plan.ranks[0][0].sequences[0] == order[0] and plan.ranks[1][0].sequences[0] == order[1]


@pytest.mark.parametrize("seed", range(5))
def test_balancing_beats_data_order_on_its_own_cost(seed):
    batch = random_batch(32, seed)
    ctx = make_ctx(dp=4, global_batch=32, token_cap=65536)
    for name, cost in (("lbb", lambda s: s.length), ("quadratic", lambda s: s.length ** 2)):
        def spread(plan, cost=cost):
            per = [sum(cost(s) for s in mb.sequences) for _, _, mb in plan.microbatches()]
            return max(per)
        seq = make_batching(ctx.policy).plan(batch, ctx)
        bal = make_batching(ctx.policy.__class__(batching=name, token_cap=65536)).plan(batch, ctx)
        assert spread(bal) <= spread(seq)


def test_sab_balances_predicted_latency_better_than_lbb():
    wins = 0
    for seed in range(8):
        batch = random_batch(16, seed)
        ctx = make_ctx(dp=2, global_batch=16, token_cap=65536)
        lbb = make_batching(ctx.policy.__class__(batching="lbb", token_cap=65536)).plan(batch, ctx)
        sab = make_batching(ctx.policy.__class__(batching="sab", token_cap=65536)).plan(batch, ctx)
        wins += rank_times(sab, ctx.latency) <= rank_times(lbb, ctx.latency) + 1e-15
    assert wins >= 7


def test_packing_is_deterministic():
    batch = random_batch(64, 9)
    ctx = make_ctx(dp=4, global_batch=64, token_cap=65536, batching="sab")
    a = make_batching(ctx.policy).plan(batch, ctx)
    b = make_batching(ctx.policy).plan(list(batch), make_ctx(dp=4, global_batch=64, token_cap=65536,
                                                               batching="sab"))
    assert a == b


def test_bad_batch_size():
    ctx = make_ctx(dp=2, global_batch=8)
    with pytest.raises(ConfigError, match="global_batch"):
        make_batching(ctx.policy).plan(random_batch(7, 0), ctx)


def test_unknown_names_list_known():
    from sparsebalance.policies.config import PolicyConfig
    with pytest.raises(ConfigError, match="policy.batching.*sab"):
        make_batching(PolicyConfig(batching="nope"))
    with pytest.raises(ConfigError, match="policy.tuning.*dst"):
        make_tuning(PolicyConfig(tuning="nope"))


@pytest.mark.parametrize("kw,field", [({"anchor": "median"}, "anchor"), ({"p": 0.0}, "p"),
                                      ({"p": 1.0}, "p"), ({"k0": 32, "k_max": 16}, "k_max"),
                                      ({"packer": "ilp"}, "packer"), ({"anchor_scope": "x"}, "anchor_scope")])
def test_bad_policy_config(kw, field):
    from sparsebalance.policies.config import PolicyConfig
    with pytest.raises(ConfigError, match=f"^{field}:"):
        PolicyConfig(**kw)


@pytest.mark.parametrize("packer", ["lpt", "lpt-swap"])
def test_large_token_cap_packing_keeps_the_cap(packer):
    """600 sequences, dp 2: a valid plan, every multi-sequence micro-batch within the cap, and at
    least the token lower bound of micro-batches per rank."""
    cap = 65536
    batch = random_batch(600, 4, lo=200, hi=65536)
    ctx = make_ctx(dp=2, global_batch=600, token_cap=cap, batching="sab", packer=packer)
    plan = make_batching(ctx.policy).plan(batch, ctx)
    check_plan(plan, batch, 2)
    assert all(mb.tokens <= cap or len(mb.sequences) == 1 for _, _, mb in plan.microbatches())
    assert plan.num_microbatches >= -(-sum(s.length for s in batch) // (2 * cap))
