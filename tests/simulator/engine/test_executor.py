"""SimulatorExecutor with a closed-form latency double (and the real latency model when present)."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.data.sequence import Sequence
from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.config import ClusterConfig, tiny
from sparsebalance.simulator.cost.query import ScalarStageLatency
from sparsebalance.simulator.engine.executor import SimulatorExecutor
from sparsebalance.simulator.engine.trace import TRACE_COLUMNS
from sparsebalance.simulator.plan import Plan, uniform_budgets


class LinearLatency(ScalarStageLatency):
    """Test double of the latency-model contract (``simulator/cost/query.py``; the executor asks
    ``stage_times``, inherited from ``stage_time``): seconds linear in tokens, independent of budget
    except through ``budget_cost``; chunk c of stage s costs (1 + c) x the stage's base."""

    def __init__(self, cluster: ClusterConfig, per_token=1e-4, bwd_factor=2.0, p2p=0.003, budget_cost=0.0):
        self.cluster, self.per_token, self.bwd_factor = cluster, per_token, bwd_factor
        self.p2p, self.budget_cost = p2p, budget_cost

    def stage_time(self, lengths, budget, stage, *, backward, chunk=0):
        k = Budget.of(budget).mean()
        base = sum(lengths) * self.per_token * (1 + chunk) + self.budget_cost * k
        return base * (self.bwd_factor if backward else 1.0)

    def p2p_time(self, tokens):
        return self.p2p

    def allreduce_time(self, stage):
        return 0.01 * (stage + 1)

    def optimizer_time(self, stage):
        return 0.002


def _plan(dp, m, length=1000):
    return Plan.from_lists([[[Sequence(id=r * m + j, length=length)] for j in range(m)] for r in range(dp)])


def test_uniform_gpipe_closed_form():
    dp, pp, m, L = 2, 3, 4, 1000
    cluster = ClusterConfig(pp=pp, dp=dp, schedule="gpipe", global_batch=dp * m)
    lat = LinearLatency(cluster)
    plan = _plan(dp, m, L)
    res = SimulatorExecutor(lat, tiny(), cluster).execute(0, plan, uniform_budgets(plan, 4))
    f, b, c = L * 1e-4, 2 * L * 1e-4, 0.003
    ends = (m + pp - 1) * (f + b) + 2 * (pp - 1) * c - np.arange(pp) * b
    assert res.iteration_time_s == pytest.approx(float(np.max(ends + 0.01 * (np.arange(pp) + 1) + 0.002)))
    assert res.stage_busy_s == pytest.approx([m * (f + b)] * pp)
    assert np.asarray(res.microbatch_latency_s) == pytest.approx(np.full((dp, m), pp * (f + b)))
    busy = dp * pp * m * (f + b)
    assert res.bubble_fraction == pytest.approx(1 - busy / (dp * pp * res.iteration_time_s))
    assert tuple(res.trace.columns) == TRACE_COLUMNS


def test_heterogeneous_plan_maps_chunks_budgets_and_tokens():
    dp, pp, v, m = 2, 2, 2, 4
    cluster = ClusterConfig(pp=pp, dp=dp, schedule="interleaved", virtual_stages=v, global_batch=dp * m)
    lat = LinearLatency(cluster, budget_cost=1e-3)
    lengths = [[100, 2000, 300, 4000], [50, 60, 7000, 800]]
    plan = Plan.from_lists([[[Sequence(id=10 * r + j, length=L)] for j, L in enumerate(row)]
                            for r, row in enumerate(lengths)])
    layers = tiny().layers
    budgets = ((4, 8, (2,) * layers, 16), (1, 2, 3, (4, 6) * (layers // 2)))
    ex = SimulatorExecutor(lat, tiny(), cluster)
    inp = ex.build_input(3, plan, budgets)
    for r in range(dp):
        for j in range(m):
            for c in range(v):
                for s in range(pp):
                    want = lat.stage_time([lengths[r][j]], budgets[r][j], s, backward=False, chunk=c)
                    assert inp.forward[r, c * pp + s, j] == pytest.approx(want)
                    assert inp.backward[r, c * pp + s, j] == pytest.approx(2 * want)
    res = ex.execute(3, plan, budgets)
    tr = res.trace
    f0 = tr[(tr["op"] == "F") & (tr["dp_rank"] == 1) & (tr["microbatch"] == 3)]
    assert (f0["tokens"] == 800).all() and np.allclose(f0["budget"], 5.0) and len(f0) == pp * v
    assert (tr["iteration"] == 3).all()
    lat_mb = np.asarray(res.microbatch_latency_s)
    assert lat_mb[0, 1] == pytest.approx(3 * sum(lat.stage_time([2000], 8, s, backward=False, chunk=c)
                                                 for s in range(pp) for c in range(v)))
    assert res.iteration_time_s >= lat_mb.max()  # one micro-batch's chain is a lower bound


def test_plan_shape_mismatch_is_a_config_error():
    from sparsebalance.errors import ConfigError

    cluster = ClusterConfig(pp=2, dp=2, schedule="gpipe", global_batch=4)
    ex = SimulatorExecutor(LinearLatency(cluster), tiny(), cluster)
    plan = _plan(1, 2)
    with pytest.raises(ConfigError, match="cluster.dp"):
        ex.execute(0, plan, uniform_budgets(plan, 4))


def test_with_the_shipped_latency_model():
    latency = pytest.importorskip("sparsebalance.simulator.cost.latency")
    from sparsebalance.simulator.config import h200_4x8, qwen25_3b

    model, cluster = qwen25_3b(), h200_4x8()
    lm = latency.load_latency_model("analytical-h200", model, cluster)
    rng = np.random.default_rng(0)
    plan = Plan.from_lists([[[Sequence(id=4 * r + j, length=int(rng.integers(1000, 30000)))]
                             for j in range(4)] for r in range(4)])
    res = SimulatorExecutor(lm, model, cluster).execute(0, plan, uniform_budgets(plan, 32))
    lat = np.asarray(res.microbatch_latency_s)
    for r, j, mb in plan.microbatches():
        assert lat[r, j] == pytest.approx(lm.microbatch_latency(mb.lengths, 32), rel=1e-9)
    assert res.iteration_time_s >= max(lat.max(), max(res.stage_busy_s))
    assert 0 < res.bubble_fraction < 1


def test_vectorised_stage_times_equal_stage_time_bitwise():
    """build_input prices int budgets in one vectorised pass; its values are stage_time's exactly
    (packed micro-batches, interleaved chunks, embedding and head stages)."""
    from dataclasses import replace as _replace

    import numpy as _np

    from sparsebalance.data.sequence import Sequence as _Seq
    from sparsebalance.simulator.config import h200_4x8, qwen25_3b
    from sparsebalance.simulator.cost.latency import load_latency_model as _load
    from sparsebalance.simulator.engine.executor import SimulatorExecutor as _Ex
    from sparsebalance.simulator.plan import Plan as _Plan

    cl = _replace(h200_4x8(), pp=4, dp=3, tp=1, global_batch=12, schedule="interleaved", virtual_stages=2)
    lm = _load("analytical-h200", qwen25_3b(), cl)
    rng = _np.random.default_rng(0)
    plan = _Plan.from_lists([[[_Seq(id=r * 100 + j * 10 + q, length=int(rng.integers(1000, 70000)))
                               for q in range(int(rng.integers(1, 4)))] for j in range(4)] for r in range(3)])
    budgets = tuple(tuple(int(rng.integers(1, 60)) for _ in range(4)) for _ in range(3))
    inp = _Ex(lm, qwen25_3b(), cl).build_input(0, plan, budgets)
    for r, j, mb in plan.microbatches():
        for vs in range(8):
            for bw, arr in ((False, inp.forward), (True, inp.backward)):
                assert arr[r, vs, j] == lm.stage_time(mb.lengths, budgets[r][j], vs % 4, backward=bw,
                                                      chunk=vs // 4)


@pytest.mark.parametrize("schedule,pp,v,m", [("zb-h1", 4, 1, 4), ("zbv", 2, 2, 3), ("dualpipev", 2, 2, 4)])
def test_split_schedules_price_input_and_weight_parts(schedule, pp, v, m):
    """I and W of every (vstage, micro-batch): the vectorised pass equals stage_time's parts
    bitwise, I + W = B (analytical profile), and the engine runs them (no B rows but DualPipeV's)."""
    from dataclasses import replace as _replace

    import numpy as _np

    from sparsebalance.data.sequence import Sequence as _Seq
    from sparsebalance.simulator.config import h200_4x8, qwen25_3b
    from sparsebalance.simulator.cost.latency import load_latency_model as _load
    from sparsebalance.simulator.engine.executor import SimulatorExecutor as _Ex
    from sparsebalance.simulator.plan import Plan as _Plan

    cl = _replace(h200_4x8(), pp=pp, dp=2, tp=2, global_batch=2 * m, schedule=schedule, virtual_stages=v)
    lm = _load("analytical-h200", qwen25_3b(), cl)
    rng = _np.random.default_rng(pp + m)
    plan = _Plan.from_lists([[[_Seq(id=r * 100 + j * 10 + q, length=int(rng.integers(1000, 70000)))
                               for q in range(int(rng.integers(1, 3)))] for j in range(m)] for r in range(2)])
    budgets = tuple(tuple(int(rng.integers(1, 60)) for _ in range(m)) for _ in range(2))
    ex = _Ex(lm, qwen25_3b(), cl)
    inp = ex.build_input(0, plan, budgets)
    for r, j, mb in plan.microbatches():
        for vs in range(pp * v):
            for part, arr in (("input", inp.backward_input), ("weight", inp.backward_weight)):
                assert arr[r, vs, j] == lm.stage_time(mb.lengths, budgets[r][j], vs % pp, backward=True,
                                                      chunk=vs // pp, part=part)
    _np.testing.assert_allclose(inp.backward_input + inp.backward_weight, inp.backward, rtol=1e-12)
    res = ex.execute(0, plan, budgets)
    ops = set(res.trace.op)
    assert {"I", "W"} <= ops and ("B" in ops) == (schedule == "dualpipev")


class OverlapLatency(LinearLatency):
    """Records the windows the executor hands to ``grad_sync_exposed`` (exposed = 1 ms + 10 % of it)."""

    def __init__(self, cluster):
        super().__init__(cluster)
        self.windows: dict[int, float] = {}

    def grad_sync_exposed(self, stage, window):
        self.windows[stage] = window
        return 0.001 + 0.1 * window


def test_dp_overlap_exposes_what_each_devices_last_backward_leaves():
    """With dp_overlap the gradient synchronisation after a device's last action is the latency
    model's exposed part, overlapped with that last action (1F1B: the backward of micro-batch
    m - 1), the shortest over DP replicas; without it, allreduce_time."""
    dp, pp, m, schedule = 2, 3, 4, "1f1b"
    cl = ClusterConfig(pp=pp, dp=dp, schedule=schedule, global_batch=dp * m, dp_overlap=True)
    lat = OverlapLatency(cl)
    # replica 1's last micro-batch is shorter: its backward is the window
    plan = Plan.from_lists([[[Sequence(id=r * m + j, length=2000 if (r, j) != (1, m - 1) else 500)]
                             for j in range(m)] for r in range(dp)])
    ex = SimulatorExecutor(lat, tiny(), cl)
    inp = ex.build_input(0, plan, uniform_budgets(plan, 4))
    last_bwd = 2 * 500 * 1e-4  # LinearLatency: backward = 2 x tokens x 1e-4
    assert lat.windows == pytest.approx({s: last_bwd for s in range(pp)})
    assert inp.allreduce == pytest.approx([0.001 + 0.1 * last_bwd] * pp)
    off = SimulatorExecutor(lat, tiny(), ClusterConfig(pp=pp, dp=dp, schedule=schedule, global_batch=dp * m))
    assert off.build_input(0, plan, uniform_budgets(plan, 4)).allreduce == pytest.approx(
        [0.01 * (s + 1) for s in range(pp)])
