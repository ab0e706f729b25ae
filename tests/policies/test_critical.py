"""dst-cp (critical-path DST) against independent oracles: the SimPy engine and brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sparsebalance.data.sequence import Sequence
from sparsebalance.errors import ConfigError
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.coverage import make_coverage_model
from sparsebalance.policies.critical import CriticalPathDST, graph_for
from sparsebalance.policies.registry import make_tuning
from sparsebalance.policies.stage_tables import StageTable
from sparsebalance.policies.tuning import DynamicSparsity, Fixed
from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.latency import load_latency_model
from sparsebalance.simulator.engine import PipelineInput, simulate
from sparsebalance.simulator.engine.executor import SimulatorExecutor
from sparsebalance.simulator.plan import Plan
from sparsebalance.simulator.schedule.timing import replica_finish

BLOCK = 4096
MODEL = ModelConfig(name="qwen2.5-3b-4l", hidden=2048, layers=4, heads=16, kv_heads=2, head_dim=128,
                    ffn=11008, vocab=151936, tie_embeddings=True, block_size=BLOCK)
BRUTE_FACTOR = 1.02
"""dst-cp's iteration time is within this factor of the brute-force optimum (tiny instances)."""


def setting(dp: int, pp: int, m: int, schedule: str = "1f1b", virtual_stages: int = 1, seed: int = 0,
            lo: int = 2 * BLOCK, hi: int = 16 * BLOCK, **policy):
    """A plan of ``dp`` x ``m`` single-sequence micro-batches, context and executor."""
    cluster = ClusterConfig(pp=pp, dp=dp, global_batch=dp * m, schedule=schedule,
                            virtual_stages=virtual_stages)
    lm = load_latency_model("analytical-h200", MODEL, cluster)
    pol = PolicyConfig(tuning="dst-cp", **policy)
    rng = np.random.default_rng(seed)
    seqs = [Sequence(id=i, length=int(rng.integers(lo, hi)), sensitivity=float(np.exp(rng.normal(0, .5))))
            for i in range(dp * m)]
    plan = Plan.from_lists([[[seqs[r * m + j]] for j in range(m)] for r in range(dp)])
    ctx = PolicyContext(model=MODEL, cluster=cluster, policy=pol, latency=lm,
                        coverage=make_coverage_model(MODEL, pol, seed=seed))
    return plan, ctx, SimulatorExecutor(lm, MODEL, cluster)


def sim_time(ex: SimulatorExecutor, plan, budgets) -> float:
    return ex.execute(0, plan, budgets).iteration_time_s


@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 4, 6, 1), ("gpipe", 3, 2, 1), ("1f1b", 1, 3, 1),
                                             ("interleaved", 2, 4, 2), ("1f1b", 3, 3, 1)])
def test_evaluator_matches_the_simpy_engine(schedule, pp, m, v):
    rng = np.random.default_rng(pp * 10 + m)
    dp, nv = 2, pp * v
    for _ in range(5):
        fwd, bwd = rng.uniform(0.1, 2, (dp, nv, m)), rng.uniform(0.2, 4, (dp, nv, m))
        p2p = rng.uniform(0, 0.3, (dp, max(nv - 1, 0), m))
        ar, opt = rng.uniform(0, 1, pp), rng.uniform(0, 0.2, pp)
        res = simulate(PipelineInput(schedule=schedule, pp=pp, virtual_stages=v, forward=fwd,
                                     backward=bwd, p2p=p2p, allreduce=ar, optimizer=opt), method="simpy")
        g = graph_for(ClusterConfig(pp=pp, dp=dp, global_batch=dp * m, schedule=schedule,
                                    virtual_stages=v), m)
        fin = replica_finish(g, fwd, bwd, p2p)
        assert float((fin.max(axis=0) + ar + opt).max()) == pytest.approx(res.iteration_time, rel=1e-12)
        # the last action of every device ends where the engine says it ends
        last = np.maximum(res.forward_end, res.backward_end).reshape(dp, v, pp, m).max(axis=(1, 3))
        np.testing.assert_allclose(fin, last, rtol=1e-12)


def test_stage_table_equals_stage_time():
    _, ctx, _ = setting(1, 2, 2)
    lm, lengths = ctx.latency, (3 * BLOCK + 5, 7 * BLOCK)
    F, B = CriticalPathDST(ctx.policy).stage_table(lm, lengths, 2, 9, 2, 2)
    for k in range(2, 10):
        for vs in range(2):
            assert F[k - 2, vs] == pytest.approx(lm.stage_time(lengths, k, vs, backward=False), rel=1e-12)
            assert B[k - 2, vs] == pytest.approx(lm.stage_time(lengths, k, vs, backward=True), rel=1e-12)


@pytest.mark.parametrize("dp,m,p,seed", [(1, 2, 0.3, 0), (1, 3, 0.2, 1), (2, 2, 0.3, 2), (2, 2, 0.15, 3),
                                         (1, 3, 0.4, 4), (2, 2, 0.4, 5), (1, 2, 0.1, 6), (2, 3, 0.3, 7)])
def test_near_brute_force_optimum_and_never_worse_than_fixed(dp, m, p, seed):
    plan, ctx, ex = setting(dp, 2, m, seed=seed, k0=3, k_max=3, p=p)
    pol = CriticalPathDST(ctx.policy)
    got = pol.budgets(plan, ctx)
    t = sim_time(ex, plan, got)
    assert t == pytest.approx(pol.stats["predicted_s"], rel=1e-9)  # prediction = engine
    floors, best = [], np.inf
    for r, j, mb in plan.microbatches():
        floors.append(DynamicSparsity(ctx.policy).floor(mb, ctx, 3))
        assert floors[-1] <= got[r][j].value <= 3
    for ks in itertools.product(*[range(f, 4) for f in floors]):  # every assignment above the floors
        budgets = tuple(tuple(ks[r * m:(r + 1) * m]) for r in range(dp))
        best = min(best, sim_time(ex, plan, budgets))
    fixed = sim_time(ex, plan, Fixed(ctx.policy).budgets(plan, ctx))
    assert t <= fixed * (1 + 1e-12)
    assert t <= BRUTE_FACTOR * best


@pytest.mark.parametrize("tol", [0.0, 0.02])
def test_raising_never_grows_predicted_time_beyond_tolerance(tol):
    plan, ctx, ex = setting(2, 4, 6, seed=11, p=0.2, k0=8, k_max=16, cp_raise_tol=tol)
    pol = CriticalPathDST(ctx.policy)
    got = pol.budgets(plan, ctx)
    t = sim_time(ex, plan, got)
    assert t <= pol.stats["lowered_s"] * (1 + tol) * (1 + 1e-9)
    assert t <= pol.stats["predicted_fixed_s"] * (1 + 1e-9)
    assert pol.stats["raised"] > 0  # the faster replica's bubbles bought coverage


def test_lighter_replica_spends_its_slack_on_coverage():
    """Replica 1 holds short sequences: it sits off the critical path, so it may take k_max for free
    while the iteration time stays that of replica 0."""
    cluster = ClusterConfig(pp=2, dp=2, global_batch=4)
    lm = load_latency_model("analytical-h200", MODEL, cluster)
    pol_cfg = PolicyConfig(tuning="dst-cp", k0=4, k_max=8, p=0.2)
    long_, short = [Sequence(id=i, length=15 * BLOCK) for i in range(2)], \
        [Sequence(id=2 + i, length=8 * BLOCK) for i in range(2)]
    plan = Plan.from_lists([[[s] for s in long_], [[s] for s in short]])
    ctx = PolicyContext(model=MODEL, cluster=cluster, policy=pol_cfg, latency=lm,
                        coverage=make_coverage_model(MODEL, pol_cfg))
    got = CriticalPathDST(pol_cfg).budgets(plan, ctx)
    assert [b.value for b in got[1]] == [8, 8]
    assert max(b.value for b in got[0]) <= 4


def test_deterministic_and_budgets_within_bounds():
    plan, ctx, _ = setting(2, 4, 5, seed=3, p=0.2, k0=16, k_max=24)
    a = CriticalPathDST(ctx.policy).budgets(plan, ctx)
    b = CriticalPathDST(ctx.policy).budgets(plan, ctx)
    assert a == b
    for r, j, mb in plan.microbatches():
        k_hi = min(24, max(16, -(-max(mb.lengths) // BLOCK)))
        assert DynamicSparsity(ctx.policy).floor(mb, ctx, k_hi) <= a[r][j].value <= k_hi
        assert a[r][j].is_uniform and type(a[r][j].value) is int


def test_registry_and_bad_config():
    assert make_tuning(PolicyConfig(tuning="dst-cp")).name == "dst-cp"
    with pytest.raises(ConfigError, match="cp_rounds"):
        PolicyConfig(cp_rounds=-1)
    with pytest.raises(ConfigError, match="cp_raise_tol"):
        PolicyConfig(cp_raise_tol=1.5)
    with pytest.raises(ConfigError, match="dst-cp"):
        make_tuning(PolicyConfig(tuning="dst-cpx"))


@pytest.mark.parametrize("schedule,v,pp,m", [("zb-h1", 1, 3, 3), ("zbv", 2, 2, 3), ("dualpipev", 2, 2, 4)])
def test_split_schedules_prediction_equals_engine_and_never_worse_than_fixed(schedule, v, pp, m):
    plan, ctx, ex = setting(2, pp, m, schedule=schedule, virtual_stages=v, seed=pp + m)
    pol = CriticalPathDST(ctx.policy)
    got = pol.budgets(plan, ctx)
    t = sim_time(ex, plan, got)
    assert t == pytest.approx(pol.stats["predicted_s"], rel=1e-9)
    fixed = sim_time(ex, plan, Fixed(ctx.policy).budgets(plan, ctx))
    assert pol.stats["predicted_fixed_s"] == pytest.approx(fixed, rel=1e-9)
    assert t <= fixed * (1 + 1e-12)


def test_split_stage_table_equals_stage_time_parts():
    _, ctx, _ = setting(1, 2, 2, schedule="zb-h1")
    lm, lengths = ctx.latency, (3 * BLOCK + 5, 7 * BLOCK)
    pol = CriticalPathDST(ctx.policy)
    _, _, inp = pol.stage_table(lm, lengths, 2, 9, 2, 2, split=True)
    w = StageTable(lm, [lengths], [2], [9], [9], 2, 2).weight_times()[0]
    for vs in range(2):
        assert w[vs] == lm.stage_time(lengths, 5, vs, backward=True, part="weight")
        for k in range(2, 10):
            assert inp[k - 2, vs] == pytest.approx(lm.stage_time(lengths, k, vs, backward=True, part="input"),
                                                   rel=1e-12)
