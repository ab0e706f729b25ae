"""dst-cp and sab-order decide exactly as before the timing core (reference copies of the old logic
in reference_decisions.py): same budgets, same orders, same predicted seconds, on seeded cases."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from reference_decisions import OldCriticalPathDST, OldScheduleAwareOrder

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.coverage import make_coverage_model
from sparsebalance.policies.critical import CriticalPathDST
from sparsebalance.policies.ordering import ScheduleAwareOrder
from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.plan import Plan

MODEL = ModelConfig(name="qwen2.5-3b-8l", hidden=2048, layers=8, heads=16, kv_heads=2, head_dim=128,
                    ffn=11008, vocab=151936, tie_embeddings=True, block_size=2048)
CASES = [  # dp, pp, m, schedule, virtual stages, seed, policy overrides
    (2, 4, 12, "1f1b", 1, 0, {}),
    (3, 2, 7, "1f1b", 1, 1, {"cp_raise_tol": 0.02}),
    (2, 3, 5, "gpipe", 1, 2, {"p": 0.3}),
    (2, 2, 4, "interleaved", 2, 3, {}),
    (1, 4, 30, "1f1b", 1, 4, {"cp_rounds": 8}),
    (2, 4, 48, "1f1b", 1, 6, {"cp_rounds": 12, "p": 0.2}),
    (4, 2, 6, "1f1b", 1, 5, {"k0": 8, "k_max": 16, "p": 0.2}),
]


def values(budgets):
    """Budgets as the ints the reference logic returns."""
    return tuple(tuple(b.value for b in row) for row in budgets)


def context(dp, pp, m, schedule, v, seed, overrides, batching="sab"):
    from sparsebalance.simulator.cost.latency import load_latency_model

    cluster = ClusterConfig(pp=pp, dp=dp, global_batch=dp * m, schedule=schedule, virtual_stages=v)
    lm = load_latency_model("analytical-h200", MODEL, cluster)
    pol = PolicyConfig(batching=batching, tuning="dst-cp", **({"k0": 16, "k_max": 32} | overrides))
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(2048), np.log(64 * 1024), dp * m)).astype(int)
    seqs = [Sequence(id=i, length=int(L), sensitivity=float(np.exp(rng.normal(0, .5))))
            for i, L in enumerate(lengths)]
    ctx = PolicyContext(model=MODEL, cluster=cluster, policy=pol, latency=lm,
                        coverage=make_coverage_model(MODEL, pol, seed=seed))
    return seqs, ctx


@pytest.mark.parametrize("small_graph", [0, 10**9], ids=["window", "full"])
@pytest.mark.parametrize("case", CASES)
def test_dst_cp_budgets_unchanged(case, small_graph, monkeypatch):
    from sparsebalance.simulator.schedule import perturb

    monkeypatch.setattr(perturb, "SMALL_GRAPH", small_graph)  # both ways of pricing a move
    seqs, ctx = context(*case)
    dp, m = case[0], case[2]
    rng = np.random.default_rng(case[5])
    order = rng.permutation(len(seqs))
    plan = Plan.from_lists([[[seqs[order[r * m + j]]] for j in range(m)] for r in range(dp)])
    new, old = CriticalPathDST(ctx.policy), OldCriticalPathDST(ctx.policy)
    assert values(new.budgets(plan, ctx)) == old.budgets(plan, ctx)  # the old logic returned ints
    assert new.stats == old.stats


@pytest.mark.parametrize("case", CASES)
def test_sab_order_plans_unchanged(case):
    seqs, ctx = context(*case, batching="sab-order")
    for cap in (60, 400):
        new, old = ScheduleAwareOrder(ctx.policy, max_evaluations=cap), \
            OldScheduleAwareOrder(ctx.policy, max_evaluations=cap)
        assert new.plan(seqs, ctx) == old.plan(seqs, ctx)
        assert new.stats == old.stats


SPLIT_CASES = [  # schedules that split the backward (F, I, W; DualPipeV runs some backwards whole)
    (2, 3, 9, "zb-h1", 1, 7, {}),
    (1, 4, 24, "zb-h1", 1, 8, {"cp_rounds": 10}),
    (2, 2, 8, "zbv", 2, 9, {"p": 0.2}),
    (2, 3, 12, "dualpipev", 2, 10, {"cp_raise_tol": 0.02}),
]


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_dst_cp_split_schedules_decide_alike_with_local_or_full_pricing(case, monkeypatch):
    """The old logic has no split backward; here the oracle is pricing every move by re-timing the
    whole schedule (and every candidate, no bound pruning): same budgets, same predicted seconds."""
    from sparsebalance.simulator.schedule import perturb

    seqs, ctx = context(*case)
    dp, m = case[0], case[2]
    plan = Plan.from_lists([[[seqs[r * m + j]] for j in range(m)] for r in range(dp)])
    got = {}
    for small in (0, 10**9):
        monkeypatch.setattr(perturb, "SMALL_GRAPH", small)
        monkeypatch.setattr("sparsebalance.policies.critical_phases.SMALL_GRAPH", small)
        pol = CriticalPathDST(ctx.policy)
        got[small] = (pol.budgets(plan, ctx), pol.stats)
    assert got[0] == got[10**9]
    assert got[0][1]["predicted_s"] <= got[0][1]["predicted_fixed_s"]


def _wave(L, k):
    """A dip of the attention at every third effective budget (a measured profile can be noisy
    along k): the stage tables are then not monotone in k."""
    eff = np.minimum(k, -(-np.asarray(L) // MODEL.block_size))
    return 1.0 - 0.3 * (eff % 3 == 0)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]])
def test_dst_cp_budgets_unchanged_when_tables_are_not_monotone(case, monkeypatch):
    """Where rows dip as k grows, dst-cp prices every budget instead of bisecting (and computes
    every row up front): still the old decisions."""
    from sparsebalance.policies import critical
    from sparsebalance.simulator.cost.latency import LatencyModel

    class Wavy(LatencyModel):
        def attention(self, seq_len, budget, *, backward=False):
            return super().attention(seq_len, budget, backward=backward) * float(_wave(seq_len, budget))

        def attention_many(self, seq_len, budget, *, backward=False):
            return super().attention_many(seq_len, budget, backward=backward) * _wave(seq_len, budget)

    monkeypatch.setattr(critical, "budget_monotone_range", lambda lm: None)  # no lazy rows
    seqs, ctx = context(*case)
    ctx.latency.__class__ = Wavy
    dp, m = case[0], case[2]
    plan = Plan.from_lists([[[seqs[r * m + j]] for j in range(m)] for r in range(dp)])
    new, old = CriticalPathDST(ctx.policy), OldCriticalPathDST(ctx.policy)
    assert values(new.budgets(plan, ctx)) == old.budgets(plan, ctx)  # the old logic returned ints
    assert new.stats == old.stats
    assert not new.stats["raised"] == new.stats["lowered"] == 0  # it decided something


@pytest.mark.parametrize("case", CASES + SPLIT_CASES)
def test_compiled_loops_decide_alike(case, monkeypatch):
    """sab-order's plan and dst-cp's budgets with every compiled loop taken (sparsebalance/jit.py:
    the timing core's recurrences, LPT) against a machine without numba (the plain paths only):
    the same plans, budgets and stats, on every schedule."""
    from sparsebalance import jit
    from sparsebalance.policies import packing_jit
    from sparsebalance.simulator.schedule import compiled

    if not jit.available():
        pytest.skip("numba is not installed: only the plain paths exist here")
    seqs, ctx = context(*case, batching="sab-order")
    got = {}
    for ok in (True, False):
        monkeypatch.setitem(jit._STATE, "ok", ok)
        monkeypatch.setattr(compiled, "MIN_WORK", 1 if ok else compiled.MIN_WORK)
        monkeypatch.setattr(packing_jit, "MIN_ITEMS", 1 if ok else packing_jit.MIN_ITEMS)
        order, tune = ScheduleAwareOrder(ctx.policy), CriticalPathDST(ctx.policy)
        plan = order.plan(seqs, ctx)
        got[ok] = (plan, order.stats, tune.budgets(plan, ctx), tune.stats)
    assert got[True] == got[False]


class _OnTheProtocol:
    """Exactly :class:`LatencyQuery`: each declared member forwards to a latency model, nothing else
    is there (so a policy that reads anything undeclared fails with AttributeError)."""

    def __init__(self, lm) -> None:
        from sparsebalance.simulator.cost.query import LatencyQuery

        members = {n for n in dir(LatencyQuery) if not n.startswith("_")} | set(LatencyQuery.__annotations__)
        for name in members:
            object.__setattr__(self, name, getattr(lm, name))
        self.__dict__["_members"] = members

    def __setattr__(self, name, value):
        raise AttributeError(name)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], SPLIT_CASES[0]])
def test_schedule_aware_policies_decide_on_the_protocol_alone(case):
    """dst-cp and sab-order ask only what ``LatencyQuery`` declares (``cost`` included): on an object
    that holds nothing else they decide exactly as on the latency model itself."""
    seqs, ctx = context(*case, batching="sab-order")
    proto = replace(ctx, latency=_OnTheProtocol(ctx.latency))
    got = {}
    for name, c in (("model", ctx), ("protocol", proto)):
        order, tune = ScheduleAwareOrder(c.policy), CriticalPathDST(c.policy)
        plan = order.plan(seqs, c)
        got[name] = (plan, order.stats, tune.budgets(plan, c), tune.stats)
    assert got["protocol"] == got["model"]
