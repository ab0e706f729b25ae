"""StageCost, the array form of the stage cost, against the scalar ``LatencyModel.stage_time`` it
must equal bit for bit (the executor, dst-cp's stage tables and sab-order read only the arrays)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.config import h200_4x8, qwen25_3b
from sparsebalance.simulator.cost.latency import load_latency_model
from sparsebalance.simulator.cost.query import ScalarStageLatency


def _model(**cluster):
    cl = replace(h200_4x8(), **cluster)
    return load_latency_model("analytical-h200", qwen25_3b(), cl, extrapolate="clamp"), cl


def _microbatches(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return [tuple(int(x) for x in rng.integers(64, 40_000, rng.integers(1, 5))) for _ in range(n)]


@pytest.mark.parametrize("cluster", [{"pp": 4, "dp": 2, "tp": 2}, {"pp": 2, "dp": 2, "tp": 1, "schedule": "interleaved",
                                                                      "virtual_stages": 3, "global_batch": 16}])
def test_arrays_equal_stage_time_bitwise(cluster):
    lm, cl = _model(**cluster)
    rng = np.random.default_rng(1)
    mbs = _microbatches(1, 40)
    ks = [int(k) for k in rng.integers(1, 70, len(mbs))]
    got = lm.stage_times(mbs, ks, ("F", "B", "I", "W"))
    pp = cl.pp
    for mode, (bw, part) in {"F": (False, None), "B": (True, None), "I": (True, "input"),
                             "W": (True, "weight")}.items():
        want = np.array([[lm.stage_time(mb, k, vs % pp, backward=bw, chunk=vs // pp, part=part)
                          for mb, k in zip(mbs, ks)] for vs in range(pp * cl.virtual_stages)])
        assert got[mode].shape == want.shape and np.array_equal(got[mode], want), mode


def test_per_layer_budgets_take_stage_time_itself():
    lm, cl = _model(pp=4, dp=2, tp=2)
    rng = np.random.default_rng(2)
    mbs = _microbatches(2, 6)
    budgets = [Budget.per_layer(int(x) for x in rng.integers(1, 40, lm.model.layers)) for _ in mbs]
    budgets[2] = 7  # ints and per-layer budgets mixed
    got = lm.stage_times(mbs, budgets, ("F", "B"))
    for vs in range(cl.pp):
        for i, (mb, b) in enumerate(zip(mbs, budgets)):
            assert got["B"][vs, i] == lm.stage_time(mb, b, vs, backward=True)


def test_weight_part_has_no_attention_and_compose_adds_it_per_layer():
    lm, _ = _model(pp=4, dp=2, tp=2)
    mbs = _microbatches(3, 5)
    tokens = np.array([sum(mb) for mb in mbs])
    w = lm.cost.compose(np.zeros(len(mbs)), tokens, backward=True, part="weight")
    hi = lm.stage_times(mbs, [64] * len(mbs), ("W",))["W"]
    lo = lm.stage_times(mbs, [1] * len(mbs), ("W",))["W"]
    assert np.array_equal(w, hi) and np.array_equal(hi, lo)  # budget-free
    a = lm.cost.attention_sums(np.array([L for mb in mbs for L in mb]), np.array([len(mb) for mb in mbs]),
                               np.full(sum(len(mb) for mb in mbs), 5), backward=False)
    f = lm.cost.compose(a, tokens, backward=False)
    f0 = lm.cost.compose(np.zeros(len(mbs)), tokens, backward=False)
    assert np.allclose(f - f0, lm.cost.layers[:, None] * a, rtol=1e-12, atol=0)


def test_scalar_stage_latency_fills_every_virtual_stage_and_mode():
    class Linear(ScalarStageLatency):
        def __init__(self, cluster):
            self.cluster = cluster

        def stage_time(self, lengths, budget, stage, *, backward, chunk=0, part=None):
            return sum(lengths) * (1 + stage + 10 * chunk) * (2 if backward else 1) * (0.5 if part else 1) + budget

    _, cl = _model(pp=2, dp=2, tp=1, schedule="interleaved", virtual_stages=2, global_batch=16)
    got = Linear(cl).stage_times([(100,), (10, 20)], [3, 4], ("F", "I"))
    assert got["F"].tolist() == [[103, 34], [203, 64], [1103, 334], [1203, 364]]
    assert got["I"].tolist() == [[103, 34], [203, 64], [1103, 334], [1203, 364]]
