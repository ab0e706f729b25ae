"""Single-micro-batch what-ifs and moves (simulator/schedule/perturb.py) against re-timing the whole schedule."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.simulator.schedule.graph import schedule_graph
from sparsebalance.simulator.schedule.perturb import ReplicaTimes
from sparsebalance.simulator.schedule.timing import time_graph, time_to_sink

CASES = [("1f1b", 4, 12, 1), ("gpipe", 3, 5, 1), ("interleaved", 2, 4, 2), ("1f1b", 3, 3, 1),
         ("1f1b", 1, 4, 1), ("interleaved", 3, 6, 2), ("1f1b", 4, 60, 1), ("gpipe", 2, 30, 1),
         # split backward: the questions move F and I (B where DualPipeV runs it whole); W stands
         ("zb-h1", 3, 6, 1), ("zbv", 2, 5, 2), ("dualpipev", 2, 5, 2),
         ("zb-h1", 4, 40, 1), ("zbv", 3, 24, 2), ("dualpipev", 3, 24, 2)]


def setup(schedule, pp, m, v, seed=0, replicas=3):
    g = schedule_graph(schedule, pp, m, v)
    rng = np.random.default_rng(seed)
    dur = rng.uniform(0.1, 2, (g.n, replicas))
    lag = np.vstack([rng.uniform(0, .3, (g.zero_lag, replicas)), np.zeros((1, replicas))])
    return g, rng, dur, lag, rng.uniform(0, 1, pp)


def own(g, j):
    return np.concatenate([np.arange(g.nv) * g.m + j, g.nv * g.m + np.arange(g.nv) * g.m + j])


def full_finish(g, d, lag, sink):
    _, end = time_graph(g, d[:, None], lag[:, None], starts=False)
    return (end[g.last, 0] + sink).max()


@pytest.fixture(params=["local", "full"])
def path(request, monkeypatch):
    """Both ways of answering: local re-timing over cuts, and a full re-timing (small graphs)."""
    from sparsebalance.simulator.schedule import perturb

    monkeypatch.setattr(perturb, "SMALL_GRAPH", 0 if request.param == "local" else 10**9)
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
        assert got[x] == pytest.approx(full_finish(g, d, lag[:, r[x]], sink), rel=1e-14)


@pytest.mark.parametrize("case", CASES)
def test_moves_keep_times_equal_to_full_retiming(case):
    """Many moves in a row (cuts and raises, critical or not): kept ends, times to the end and
    finishes stay those of a full re-timing (to rounding), and refresh() restores them bitwise."""
    g, rng, dur, lag, sink = setup(*case, seed=3, replicas=2)
    times = ReplicaTimes(g, dur, lag, sink)
    d = dur.copy()
    for step in range(30):
        j, r = int(rng.integers(0, g.m)), int(rng.integers(0, 2))
        new = d[own(g, j), r] * rng.uniform(0.5, 1.3 if step % 2 else 1.0, 2 * g.nv)
        d[own(g, j), r] = new
        times.apply(r, j, new)
        _, end = time_graph(g, d, lag, starts=False)
        scale = float(end.max())
        np.testing.assert_allclose(times.end, end, rtol=0, atol=1e-12 * scale)
        np.testing.assert_allclose(times.to_sink, time_to_sink(g, d, lag, sink), rtol=0, atol=1e-12 * scale)
        np.testing.assert_allclose(times.finish(), (end[g.last] + sink[:, None]).max(axis=0), rtol=1e-13)
    np.testing.assert_array_equal(times.duration, d)
    assert np.array_equal(times.exact_finish([0, 1]), (time_graph(g, d, lag)[1][g.last] + sink[:, None]).max(axis=0))
    times.refresh([0, 1])
    assert np.array_equal(times.end, time_graph(g, d, lag)[1])
    assert np.array_equal(times.to_sink, time_to_sink(g, d, lag, sink))


def test_a_move_on_the_critical_path_of_a_long_1f1b_settles_locally(monkeypatch):
    """Lowering a micro-batch in the middle of a long 1F1B shifts everything after it; the move
    re-times a few levels and shifts the rest (no full re-timing)."""
    from sparsebalance.simulator.schedule import perturb

    g, _, dur, lag, sink = setup("1f1b", 4, 200, 1, replicas=1)
    times = ReplicaTimes(g, dur, lag, sink)
    calls = []
    monkeypatch.setattr(times, "refresh", lambda reps: calls.append(reps))
    d = dur.copy()
    j = 100
    d[own(g, j), 0] *= 0.5
    times.apply(0, j, d[own(g, j), 0])
    assert not calls
    _, end = time_graph(g, d, lag, starts=False)
    np.testing.assert_allclose(times.end, end, rtol=1e-13)
    assert perturb.REACH >= 1
