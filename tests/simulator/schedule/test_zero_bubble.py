"""Zero-bubble schedules (zb-h1, zbv, dualpipev) in the timing core and the SimPy engine: equal to
each other, to an independent relaxation over explicit edges, and to the ZB paper's closed forms."""

from __future__ import annotations

import numpy as np
import pytest
from engines_agree import assert_engines_agree

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.engine import PipelineInput, simulate
from sparsebalance.simulator.layout import placement
from sparsebalance.simulator.schedule.schedules import stage_orders

SPLIT = [("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)]


def random_input(rng, schedule: str, v: int) -> PipelineInput:
    pp = int(rng.integers(1, 6))
    lo = 2 * pp if schedule == "dualpipev" else 1
    m = int(rng.integers(lo, lo + 9))
    if schedule == "zb-h1":
        m -= m % max(1, m // pp)
    dp = int(rng.integers(1, 4))
    nv = pp * v
    fwd = rng.lognormal(0, 1, (dp, nv, m)) * (rng.random((dp, nv, m)) > 0.05)
    i = rng.lognormal(0.3, 1, (dp, nv, m))
    w = rng.lognormal(0.0, 1, (dp, nv, m)) * (rng.random((dp, nv, m)) > 0.1)
    return PipelineInput(schedule=schedule, pp=pp, virtual_stages=v, forward=fwd,
                         backward=(i + w) * rng.uniform(0.8, 1.0, (dp, nv, m)), backward_input=i,
                         backward_weight=w, p2p=rng.uniform(0, 0.5, (dp, max(nv - 1, 0), m)),
                         allreduce=rng.uniform(0, 2, pp), optimizer=rng.uniform(0, 0.3, pp))


@pytest.mark.parametrize("schedule,v", SPLIT)
@pytest.mark.parametrize("seed", range(6))
def test_core_equals_simpy(schedule, v, seed):
    core = assert_engines_agree(random_input(np.random.default_rng([seed, len(schedule)]), schedule, v))
    assert core.kinds == ("F", "I", "W")


def relax(orders, dev, nv, dur, lag):
    """Earliest starts by repeated relaxation over explicit edges until nothing moves (oracle).
    Rules written out independently of the graph: F(vs) after F(vs-1); the backward of vs (B or I)
    after that of vs+1, the last vstage's after its own F; W after I; a transfer costs lag only
    between two devices."""
    start = {a: 0.0 for o in orders for a in o}
    back = {(vs, j): k for o in orders for k, vs, j in o if k in "BI"}

    def deps(a):
        k, vs, j = a
        if k == "F":
            return [(("F", vs - 1, j), vs - 1)] if vs else []
        if k == "W":
            return [(("I", vs, j), None)]
        if vs == nv - 1:
            return [(("F", vs, j), None)]
        return [((back[(vs + 1, j)], vs + 1, j), vs)]

    changed = True
    while changed:
        changed = False
        for o in orders:
            for i, a in enumerate(o):
                t = start[o[i - 1]] + dur[o[i - 1]] if i else 0.0
                for d, b in deps(a):
                    cross = b is not None and dev[d[1]] != dev[a[1]]
                    t = max(t, start[d] + dur[d] + (lag[(b, a[2])] if cross else 0.0))
                if t > start[a] + 1e-15:
                    start[a], changed = t, True
    return start


@pytest.mark.parametrize("schedule,v,pp,m", [("zb-h1", 1, 3, 5), ("zbv", 2, 3, 4), ("zbv", 2, 2, 7),
                                             ("dualpipev", 2, 2, 5), ("dualpipev", 2, 3, 7)])
def test_core_equals_relaxation_oracle(schedule, v, pp, m):
    rng = np.random.default_rng(pp * 31 + m)
    nv = pp * v
    F, I, W = (rng.uniform(0.1, 2, (1, nv, m)) for _ in range(3))
    B = I + W + rng.uniform(0, 0.5, (1, nv, m))  # a whole backward may cost more than I + W
    p2p = rng.uniform(0, 0.3, (1, nv - 1, m))
    res = simulate(PipelineInput(schedule=schedule, pp=pp, virtual_stages=v, forward=F, backward=B,
                                 backward_input=I, backward_weight=W, p2p=p2p))
    orders = stage_orders(schedule, pp, m, v)
    dur = {("F", vs, j): F[0, vs, j] for vs in range(nv) for j in range(m)}
    dur |= {(k, vs, j): a[0, vs, j] for k, a in (("B", B), ("I", I), ("W", W))
            for vs in range(nv) for j in range(m)}
    lag = {(b, j): p2p[0, b, j] for b in range(nv - 1) for j in range(m)}
    want = relax(orders, placement(schedule, pp, v), nv, dur, lag)
    tr = res.trace
    got = {(r.op, r.microbatch, r.start_s) for r in tr[tr.op.isin(["F", "B", "I", "W"])].itertuples()}
    assert len(got) == len(want)
    starts = res.start[0]
    for (k, vs, j), t in want.items():
        kk = "I" if k == "B" else k
        assert starts[res.kinds.index(kk), vs, j] == pytest.approx(t, rel=1e-12, abs=1e-12)
    ops = set(tr.op)
    assert ("B" in ops) == (schedule == "dualpipev") and {"I", "W"} <= ops


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 3), (4, 8), (4, 12), (6, 12)])
def test_zb_h1_bubble_is_the_papers_closed_form(pp, m):
    # Qi et al. (ICLR 2024): with T_F = T_I = T_W = 1 and no P2P, 1F1B idles (p - 1)(T_F + T_I + T_W)
    # per device and ZB-H1 only (p - 1)(T_F + T_I - T_W)
    def run(schedule):
        ones = np.ones((1, pp, m))
        return simulate(PipelineInput(schedule=schedule, pp=pp, forward=ones, backward=2 * ones,
                                      backward_input=ones, backward_weight=ones)).iteration_time

    assert run("1f1b") == 3 * m + 3 * (pp - 1)
    assert run("zb-h1") == 3 * m + (pp - 1)


def test_v_placement_keeps_the_bend_local_and_pairs_embedding_with_head():
    pp, m = 3, 6
    ones = np.ones((1, 2 * pp, m))
    res = simulate(PipelineInput(schedule="zbv", pp=pp, virtual_stages=2, forward=ones,
                                 backward=2 * ones, backward_input=ones, backward_weight=ones, p2p=0.25))
    p2p = res.trace[res.trace.op == "P2P"]
    # 2 pp - 1 boundaries per micro-batch and direction, minus the bend (vstage pp - 1 -> pp) on device pp - 1
    assert len(p2p) == 2 * (2 * pp - 2) * m
    assert np.array_equal(res.graph.vstage_device, [0, 1, 2, 2, 1, 0])
    assert res.device_busy[0].tolist() == [2 * 3 * m] * pp


def test_split_schedule_needs_split_durations():
    ones = np.ones((1, 2, 2))
    with pytest.raises(ConfigError, match="backward_input: schedule 'zb-h1' splits"):
        PipelineInput(schedule="zb-h1", pp=2, forward=ones, backward=ones)
