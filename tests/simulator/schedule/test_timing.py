"""The timing core against the SimPy model of record and an independent fixed-point relaxation."""

from __future__ import annotations

import numpy as np
import pytest
from engines_agree import assert_engines_agree

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.engine import PipelineInput, simulate
from sparsebalance.simulator.engine.events import simulate_events
from sparsebalance.simulator.schedule.graph import build_graph, schedule_graph
from sparsebalance.simulator.schedule.schedules import one_f_one_b_order
from sparsebalance.simulator.schedule.timing import time_graph


def random_input(rng, schedule: str) -> PipelineInput:
    pp = int(rng.integers(1, 6))
    v = int(rng.integers(2, 4)) if schedule == "interleaved" else 1
    m = int(rng.integers(pp, 11)) if schedule != "gpipe" else int(rng.integers(1, 11))
    if schedule == "interleaved":
        m -= m % max(1, m // pp)
    dp = int(rng.integers(1, 5))
    nv = pp * v
    # ragged costs: spread over two orders of magnitude, some zero-length actions
    fwd = rng.lognormal(0, 1, (dp, nv, m)) * (rng.random((dp, nv, m)) > 0.05)
    return PipelineInput(schedule=schedule, pp=pp, virtual_stages=v, forward=fwd,
                         backward=rng.lognormal(0.5, 1, (dp, nv, m)),
                         p2p=rng.uniform(0, 0.5, (dp, max(nv - 1, 0), m)),
                         allreduce=rng.uniform(0, 2, pp), optimizer=rng.uniform(0, 0.3, pp))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("seed", range(8))
def test_core_equals_simpy(schedule, seed):
    assert_engines_agree(random_input(np.random.default_rng([seed, len(schedule)]), schedule))


def relax(orders, deps_of, dur, lag):
    """Earliest starts by repeated relaxation over explicit edges until nothing moves (oracle)."""
    start = {a: 0.0 for o in orders for a in o}
    changed = True
    while changed:
        changed = False
        for o in orders:
            for i, a in enumerate(o):
                t = start[o[i - 1]] + dur[o[i - 1]] if i else 0.0
                for d, boundary in deps_of(a):
                    t = max(t, start[d] + dur[d] + (lag[(boundary, a[2])] if boundary is not None else 0.0))
                if t > start[a] + 1e-15:
                    start[a], changed = t, True
    return start


def split_backward_orders(pp: int, m: int):
    """A zero-bubble-like order with the backward split: 1F1B with each B replaced by its input-
    gradient part I, and each W deferred until the stage's cool-down (the weight gradients fill
    the drain bubble). A schedule the simulator does not ship, built only from orders + the
    default dependency rule, to show new ones plug in."""
    out = []
    for s in range(pp):
        order = [("I" if k == "B" else k, vs, j) for k, vs, j in one_f_one_b_order(pp, m, s)]
        out.append(order + [("W", s, j) for j in range(m)])
    return out


@pytest.mark.parametrize("pp,m,seed", [(2, 3, 0), (3, 5, 1), (4, 4, 2)])
def test_split_backward_schedule_plugs_into_both_engines(pp, m, seed):
    from sparsebalance.simulator.schedule.graph import pipeline_dependencies

    rng = np.random.default_rng(seed)
    orders = split_backward_orders(pp, m)
    g = build_graph(orders, pp, m)
    assert g.kinds == ("F", "I", "W")
    dur = {a: float(rng.uniform(0.1, 2)) for o in orders for a in o}
    lag = {(b, j): float(rng.uniform(0, 0.3)) for b in range(pp - 1) for j in range(m)}
    d = np.zeros((g.n, 1))
    for a, x in dur.items():
        d[g.node(*a), 0] = x
    lg = np.zeros((g.zero_lag + 1, 1))
    for (b, j), x in lag.items():
        lg[b * m + j, 0] = x
    start, end = time_graph(g, d, lg)
    s2, e2, _ = simulate_events(g, d, lg, np.zeros(pp), np.zeros(pp))
    want = relax(orders, lambda a: pipeline_dependencies(a, pp), dur, lag)
    for a, t in want.items():
        assert start[g.node(*a), 0] == pytest.approx(t, rel=1e-12, abs=1e-12)
        assert s2[g.node(*a), 0] == pytest.approx(t, rel=1e-9, abs=1e-12)
    np.testing.assert_allclose(e2, end, rtol=1e-9)


def test_levels_are_topological_and_few():
    g = schedule_graph("1f1b", 8, 64)
    level = np.empty(g.n, dtype=int)
    for i, idx in enumerate(g.levels):
        level[idx] = i
    prev_ok = (g.prev == g.n) | (level[np.minimum(g.prev, g.n - 1)] < level)
    dep = g.deps[:, 0]
    dep_ok = (dep == g.n) | (level[np.minimum(dep, g.n - 1)] < level)
    assert prev_ok.all() and dep_ok.all()
    assert sum(len(x) for x in g.levels) == g.n == 2 * 8 * 64
    assert len(g.levels) <= 2 * (64 + 8)  # about 2 (m + pp) levels, whatever dp


def test_bad_orders():
    with pytest.raises(ConfigError, match="twice"):
        build_graph([[("F", 0, 0), ("F", 0, 0), ("B", 0, 0)]], 1, 1)
    with pytest.raises(ConfigError, match="never scheduled"):
        build_graph([[("F", 0, 0), ("B", 0, 0)]], 1, 2)
    with pytest.raises(RuntimeError, match="deadlock"):  # stage 1 wants B0 before F0 has arrived
        build_graph([[("F", 0, 0), ("B", 0, 0)], [("B", 1, 0), ("F", 1, 0)]], 2, 1)
    with pytest.raises(ConfigError, match="method"):
        simulate(PipelineInput(schedule="gpipe", pp=1, forward=np.ones((1, 1, 1)),
                               backward=np.ones((1, 1, 1))), method="fast")


@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 4, 40, 1), ("gpipe", 3, 25, 1), ("interleaved", 2, 24, 2)])
def test_plain_loops_equal_numpy_levels_bitwise(schedule, pp, m, v, monkeypatch):
    from sparsebalance.simulator.schedule import timing

    g = schedule_graph(schedule, pp, m, v)
    rng = np.random.default_rng(pp * m)
    d = rng.uniform(0.1, 2, (g.n, 2))
    lag = np.vstack([rng.uniform(0, .3, (g.zero_lag, 2)), np.zeros((1, 2))])
    sink = rng.uniform(0, 1, pp)
    assert timing._narrow(g, 2)
    loops = timing.time_graph(g, d, lag), timing.time_to_sink(g, d, lag, sink)
    monkeypatch.setattr(timing, "_narrow", lambda graph, columns: False)
    levels = timing.time_graph(g, d, lag), timing.time_to_sink(g, d, lag, sink)
    for a, b in zip(loops[0] + (loops[1],), levels[0] + (levels[1],)):
        assert np.array_equal(a, b)
    # the longest path through every action is at most the iteration time, and equal on some
    through = levels[0][1] + levels[1]
    T = (levels[0][1][g.last] + sink[:, None]).max(axis=0)
    assert np.allclose(through.max(axis=0), T, rtol=1e-12) and (through <= T * (1 + 1e-12)).all()


@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 4, 9, 1), ("interleaved", 2, 6, 2), ("zb-h1", 3, 6, 1),
                                             ("zbv", 2, 5, 2), ("gpipe", 3, 4, 1)])
def test_order_finish_equals_replica_finish_bitwise(schedule, pp, m, v):
    """Candidate orders gathered straight into the core's layout: the same finish times as
    replica_finish on the reordered arrays, bit for bit (what sab-order relies on)."""
    from sparsebalance.simulator.schedule.timing import order_finish, replica_finish

    g = schedule_graph(schedule, pp, m, v)
    rng = np.random.default_rng(m)
    nv = pp * v
    fwd, bwd = rng.uniform(0.1, 1, (nv, m)), rng.uniform(0.2, 2, (nv, m))
    inp, wgt = bwd * rng.uniform(0.3, 0.7, (nv, m)), bwd * rng.uniform(0.1, 0.3, (nv, m))
    p2p = rng.uniform(0, 0.05, m)
    orders = np.array([rng.permutation(m) for _ in range(17)])
    split = (inp, wgt) if g.split else ()
    got = order_finish(g, orders, fwd, bwd, p2p, *split)
    parts = [a[:, orders].transpose(1, 0, 2) for a in (fwd, bwd, *split)]
    p = np.broadcast_to(p2p[orders][:, None, :], (len(orders), max(nv - 1, 0), m))
    want = replica_finish(g, *parts[:2], p, *parts[2:])
    assert got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 4, 9, 1), ("interleaved", 2, 6, 2), ("zb-h1", 3, 6, 1),
                                             ("zbv", 2, 5, 2), ("gpipe", 3, 4, 1), ("dualpipev", 2, 6, 2)])
def test_compiled_core_equals_numpy_levels_bitwise(schedule, pp, m, v, monkeypatch):
    """The compiled recurrences (numba; taken for wide calls) against the numpy levels, every
    schedule: starts, ends, the order search's gathered form (order_finish) and the time to the
    iteration's end (time_to_sink)."""
    from sparsebalance import jit
    from sparsebalance.simulator.schedule import compiled, timing

    if not jit.available():
        pytest.skip("numba is not installed: the timing core runs its numpy and plain-loop paths only")
    g = schedule_graph(schedule, pp, m, v)
    rng = np.random.default_rng(pp * m + v)
    c = 37
    d = rng.uniform(0.1, 2, (g.n, c))
    lag = np.vstack([rng.uniform(0, .3, (g.zero_lag, c)), np.zeros((1, c))])
    f, b, bi, bw = (rng.uniform(0.1, 2, (g.nv, m)) for _ in range(4))
    p2p = rng.uniform(0, 0.3, m)
    orders = np.array([rng.permutation(m) for _ in range(c)])
    split = (bi, bw) if g.split else ()
    sink = rng.uniform(0, 1, pp)

    def run():
        return (*timing.time_graph(g, d, lag), timing.order_finish(g, orders, f, b, p2p, *split),
                timing.time_to_sink(g, d, lag, sink))

    monkeypatch.setattr(compiled, "worth", lambda work: True)
    fast = run()
    monkeypatch.setattr(compiled, "worth", lambda work: False)
    monkeypatch.setattr(timing, "_narrow", lambda graph, columns: False)
    slow = run()
    for x, y in zip(fast, slow):
        assert np.array_equal(x, y)
    # and the ends are a longest path: no action starts before its device predecessor ends
    start, end = fast[0], fast[1]
    prev_end = np.vstack([end, np.zeros((1, c))])[g.prev]
    assert (start >= prev_end).all()
