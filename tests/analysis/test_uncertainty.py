"""Speedup uncertainty: the t interval by hand, the predicted range collapsing to the point
prediction without profile error, and the consistency rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparsebalance.analysis.uncertainty import consistent, pooled_spread, predicted_interval, speedup_ci


def test_speedup_ci_is_the_t_interval_of_log_speedups():
    rounds = [1.10, 1.02, 0.95, 1.20]
    logs = np.log(rounds)
    se = logs.std(ddof=1) / 2.0
    t975_3dof = 3.182446305284263  # Student t, 3 degrees of freedom, 97.5 % quantile (tables)
    ci = speedup_ci(rounds)
    assert ci["se_log"] == pytest.approx(se)
    assert ci["lo"] == pytest.approx(math.exp(logs.mean() - t975_3dof * se), rel=1e-9)
    assert ci["hi"] == pytest.approx(math.exp(logs.mean() + t975_3dof * se), rel=1e-9)
    assert ci["lo"] < 1 < ci["hi"]  # this call would not resolve the ranking
    assert speedup_ci([1.2])["lo"] is None


def test_pooled_spread_weights_ops_by_degrees_of_freedom():
    assert pooled_spread({"a": 0.1, "b": 0.3}, {"a": 4, "b": 2}) == pytest.approx(
        math.sqrt((3 * 0.01 + 1 * 0.09) / 4))
    assert pooled_spread({"a": 0.0}, {"a": 1}) is None


def test_predicted_interval_without_profile_error_is_the_point_prediction():
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.simulator.config import ClusterConfig, tiny
    from sparsebalance.simulator.cost.catalog import load_profile
    from sparsebalance.simulator.cost.latency import LatencyModel
    from sparsebalance.simulator.engine.executor import SimulatorExecutor
    from sparsebalance.simulator.plan import Plan

    prof, m = load_profile("cpu-tiny"), tiny()
    c = ClusterConfig(device="cpu", pp=2, dp=1, global_batch=2)
    plan = Plan.from_lists([[[Sequence(id=0, length=2000)], [Sequence(id=1, length=300)]]])
    base = ([plan, plan], [((8, 8),), ((8, 8),)])
    pol = ([plan, plan], [((4, 8),), ((4, 8),)])
    iv = predicted_interval(prof, m, c, {"b": [base], "p": [pol, pol]}, executor=SimulatorExecutor, baseline="b",
                            policy="p", sigma=0.0, draws=3)
    ex = SimulatorExecutor(LatencyModel(prof, m, c), m, c)
    want = ex.execute(1, plan, base[1][1]).iteration_time_s / ex.execute(1, plan, pol[1][1]).iteration_time_s
    assert iv["lo"] == pytest.approx(want) and iv["hi"] == pytest.approx(want) and want > 1
    wide = predicted_interval(prof, m, c, {"b": [base], "p": [pol]}, executor=SimulatorExecutor, baseline="b",
                              policy="p", sigma=0.1, draws=24, seed=1)
    assert wide["lo"] < want < wide["hi"]


def test_consistency_uses_both_uncertainties():
    assert consistent(1.10, 0.02, 1.18, 0.02) is False   # |log 1.18/1.10| = 0.070 > 1.96 x 0.028
    assert consistent(1.10, 0.03, 1.18, 0.02) is True    # 0.070 < 1.96 x 0.036
    assert consistent(1.1, None, 1.2, None) is None
