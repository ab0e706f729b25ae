"""Speedup uncertainty: the t interval by hand, the predicted range collapsing to the point
prediction without profile error, and the consistency rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparsebalance.analysis.uncertainty import (
    consistent,
    pooled_spread,
    predicted_interval,
    rounds_to_resolve,
    speedup_ci,
)


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


def _rounds(n: int, mean_log: float, sd_log: float, seed: int) -> list[float]:
    """n round speedups whose logs have exactly this mean and standard deviation (ddof 1)."""
    z = np.random.default_rng(seed).normal(size=n)
    z = (z - z.mean()) / z.std(ddof=1)
    return list(np.exp(mean_log + sd_log * z))


@pytest.mark.parametrize(("speedup", "sd", "seed"), [(1.05, 0.10, 1), (1.044, 0.114, 2), (0.9, 0.2, 3), (1.2, 0.05, 4)])
def test_rounds_to_resolve_is_the_first_count_whose_interval_excludes_one(speedup, sd, seed):
    """Brute force with speedup_ci itself: n rounds of the predicted mean at this spread exclude 1,
    n - 1 rounds do not. By hand, 1.05 at sd 0.10: t_{0.975, 18} x 0.1 / sqrt(19) = 0.0482 < log 1.05
    = 0.0488 < t_{0.975, 17} x 0.1 / sqrt(18) = 0.0497, so 19."""
    n = rounds_to_resolve(_rounds(6, 0.0, sd, seed), speedup)  # the spread is what matters, not the mean
    assert n is not None and n >= 2
    ci = speedup_ci(_rounds(n, math.log(speedup), sd, seed))
    assert ci["lo"] > 1 or ci["hi"] < 1
    if n > 2:
        ci = speedup_ci(_rounds(n - 1, math.log(speedup), sd, seed))
        assert ci["lo"] < 1 < ci["hi"]
    if (speedup, sd) == (1.05, 0.10):
        assert n == 19


def test_rounds_to_resolve_without_an_answer():
    assert rounds_to_resolve([1.1], 1.05) is None  # one round: no spread
    assert rounds_to_resolve([1.1, 0.9], 1.0) is None  # no effect to resolve
    assert rounds_to_resolve([2.0, 0.5, 1.0], 1.001) is None  # beyond MAX_ROUNDS_ADVISED
    assert rounds_to_resolve([1.05, 1.05, 1.05], 1.05) == 2  # no spread: two rounds resolve it


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


def test_the_report_advises_rounds_only_where_the_ranking_is_not_resolved():
    from sparsebalance.commands._validate_report import resolve_advice

    s = {"ranking_resolved": False, "rounds_to_resolve": 30, "predicted_speedup": 1.0436}
    assert resolve_advice(s) == " (at this call's spread a +4.4 % effect needs about 30 rounds: --rounds 30)"
    assert resolve_advice(s | {"ranking_resolved": True}) == ""
    assert resolve_advice(s | {"ranking_resolved": None}) == ""  # one round: no spread to plan from
    assert resolve_advice(s | {"rounds_to_resolve": None}) == ""
