"""Action calibration (``simulator/cost/actioncalibration.py``): the fit against lines drawn by hand,
its fall-backs, and the executor's iteration with it against the gpipe closed form."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ClusterConfig, tiny
from sparsebalance.simulator.cost.actioncalibration import MIN_POINTS, ActionCalibration, Line, fit, fit_line
from sparsebalance.simulator.engine.executor import SimulatorExecutor
from sparsebalance.simulator.plan import uniform_budgets
from tests.simulator.engine.test_executor import LinearLatency, _plan


def test_a_line_through_noise_free_points_is_found():
    p = np.random.default_rng(3).uniform(0.01, 0.05, 12)
    ln = fit_line(p, 1.3 * p + 0.004)
    assert ln.method == "least-squares" and ln.points == 12
    assert (ln.scale, ln.offset_s, ln.r) == pytest.approx((1.3, 0.004, 1.0))


def test_without_spread_or_points_the_ratio_of_means():
    same = np.full(8, 0.02)
    ln = fit_line(same, same * 1.5 + 0.001)  # one duration: slope and offset cannot be told apart
    assert ln.method == "ratio" and ln.offset_s == 0.0 and ln.scale == pytest.approx(0.031 / 0.02)
    few = np.array([0.01, 0.02, 0.03])[: MIN_POINTS - 1]
    assert fit_line(few, 2 * few + 0.01).method == "ratio"
    # a line that would make the probe's shortest action negative is not used
    p = np.array([0.01, 0.02, 0.03, 0.04, 0.05])
    m = np.array([0.0005, 0.0005, 0.03, 0.06, 0.09])
    ln = fit_line(p, m)
    assert ln.method == "ratio" and ln.scale == pytest.approx(m.mean() / p.mean())


def test_bad_actions_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="> 0 s"):
        fit_line(np.array([0.01, 0.0]), np.array([0.01, 0.02]))
    with pytest.raises(ConfigError, match="one shape"):
        fit_line(np.array([0.01]), np.array([0.01, 0.02]))
    with pytest.raises(ConfigError, match="no F or B"):
        fit(pd.DataFrame({"stage": [0], "op": ["W"], "predicted": [0.1], "measured": [0.1]}))


def test_fit_groups_by_stage_and_op():
    rng = np.random.default_rng(5)
    rows = []
    for stage, op, a, b in ((0, "F", 1.2, 0.001), (0, "B", 0.9, 0.01), (1, "F", 1.0, 0.0), (1, "B", 2.0, 0.002)):
        for p in rng.uniform(0.01, 0.1, 6):
            rows.append({"stage": stage, "op": op, "predicted": p, "measured": a * p + b})
    lines = fit(pd.DataFrame(rows))
    assert set(lines) == {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
    assert (lines[(1, "B")].scale, lines[(1, "B")].offset_s) == pytest.approx((2.0, 0.002))
    assert (lines[(0, "B")].scale, lines[(0, "B")].offset_s) == pytest.approx((0.9, 0.01))


def test_apply_follows_each_virtual_stage_to_its_device():
    t = {"F": np.ones((2, 4, 3)), "W": np.ones((2, 4, 3))}
    cal = ActionCalibration(lines={(1, "F"): Line(2.0, 0.5, 10, 1.0, "least-squares")})
    got = cal.apply(t, [0, 1, 0, 1])  # interleaved: virtual stages 1 and 3 live on device 1
    assert got["F"][:, [1, 3]] == pytest.approx(np.full((2, 2, 3), 2.5))
    assert got["F"][:, [0, 2]] == pytest.approx(np.ones((2, 2, 3)))
    assert got["W"] == pytest.approx(t["W"]) and t["F"].max() == 1.0  # no line: untouched; input kept
    rec = cal.record()
    assert rec["lines"][0] == {"stage": 1, "op": "F", "scale": 2.0, "offset_s": 0.5, "points": 10,
                               "r": 1.0, "method": "least-squares"}


def test_the_executor_prices_calibrated_actions_and_the_step_constant():
    """gpipe, uniform micro-batches: the closed form of test_executor with f -> a f + b, etc."""
    dp, pp, m, L = 1, 3, 4, 1000
    cluster = ClusterConfig(pp=pp, dp=dp, schedule="gpipe", global_batch=dp * m)
    plan = _plan(dp, m, L)
    lines = {(s, "F"): Line(1.5, 0.002, 8, 1.0, "least-squares") for s in range(pp)}
    lines |= {(s, "B"): Line(0.5, 0.01, 8, 1.0, "least-squares") for s in range(pp)}
    cal = ActionCalibration(lines=lines, step_s=0.03)
    res = SimulatorExecutor(LinearLatency(cluster), tiny(), cluster, calibration=cal).execute(
        0, plan, uniform_budgets(plan, 4))
    f, b, c = 1.5 * L * 1e-4 + 0.002, 0.5 * 2 * L * 1e-4 + 0.01, 0.003
    ends = (m + pp - 1) * (f + b) + 2 * (pp - 1) * c - np.arange(pp) * b
    assert res.iteration_time_s == pytest.approx(float(np.max(ends + 0.01 * (np.arange(pp) + 1) + 0.002 + 0.03)))
    # a negative step constant shortens the optimizer step, never below 0
    neg = ActionCalibration(lines=lines, step_s=-1.0)
    res = SimulatorExecutor(LinearLatency(cluster), tiny(), cluster, calibration=neg).execute(
        0, plan, uniform_budgets(plan, 4))
    assert res.iteration_time_s == pytest.approx(float(np.max(ends + 0.01 * (np.arange(pp) + 1))))
