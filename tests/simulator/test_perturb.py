"""Single-micro-batch what-ifs (simulator/perturb.py) against re-timing the whole schedule."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.simulator.graph import schedule_graph
from sparsebalance.simulator.perturb import ReplicaTimes
from sparsebalance.simulator.timing import time_graph

CASES = [("1f1b", 4, 12, 1), ("gpipe", 3, 5, 1), ("interleaved", 2, 4, 2), ("1f1b", 3, 3, 1),
         ("1f1b", 1, 4, 1), ("interleaved", 3, 6, 2),
         # split backward: the questions move F and I (B where DualPipeV runs it whole); W stands
         ("zb-h1", 3, 6, 1), ("zbv", 2, 5, 2), ("dualpipev", 2, 5, 2)]


def setup(schedule, pp, m, v, seed=0, replicas=3):
    g = schedule_graph(schedule, pp, m, v)
    rng = np.random.default_rng(seed)
    dur = rng.uniform(0.1, 2, (g.n, replicas))
    lag = np.vstack([rng.uniform(0, .3, (g.zero_lag, replicas)), np.zeros((1, replicas))])
    return g, rng, dur, lag, rng.uniform(0, 1, pp)


def own(g, j):
    return np.concatenate([np.arange(g.nv) * g.m + j, g.nv * g.m + np.arange(g.nv) * g.m + j])


@pytest.fixture(params=["window", "full"])
def path(request, monkeypatch):
    """Both ways of answering: the window decomposition, and a full re-timing (small graphs)."""
    from sparsebalance.simulator import perturb

    monkeypatch.setattr(perturb, "SMALL_GRAPH", 0 if request.param == "window" else 10**9)
    return request.param


@pytest.mark.parametrize("case", CASES)
def test_finish_if_equals_retiming(case, path):
    g, rng, dur, lag, sink = setup(*case)
    times = ReplicaTimes(g, dur, lag, sink)
    c = 40
    r, j = rng.integers(0, 3, c), rng.integers(0, g.m, c)
    new = rng.uniform(0, 3, (c, 2 * g.nv))  # raises and cuts alike
    got = times.finish_if(r, j, new)
    for x in range(c):
        d = dur[:, r[x]].copy()
        d[own(g, j[x])] = new[x]
        _, end = time_graph(g, d[:, None], lag[:, [r[x]]], starts=False)
        assert got[x] == pytest.approx((end[g.last, 0] + sink).max(), rel=1e-14)


@pytest.mark.parametrize("case", CASES[:3] + CASES[-3:])
def test_update_equals_full_retiming(case):
    g, rng, dur, lag, sink = setup(*case, seed=3, replicas=2)
    a, b = ReplicaTimes(g, dur, lag, sink), ReplicaTimes(g, dur, lag, sink)
    for _ in range(5):
        j, r = int(rng.integers(0, g.m)), int(rng.integers(0, 2))
        idx = own(g, j)
        a.duration[idx, r] = b.duration[idx, r] = rng.uniform(0, 3, len(idx))
        a.update(r, j)
        b.refresh([r])
        assert np.array_equal(a.end, b.end) and np.array_equal(a.to_sink, b.to_sink)
