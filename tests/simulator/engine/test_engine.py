"""The SimPy engine against closed forms and an independent longest-path computation."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.engine import PipelineInput, simulate
from sparsebalance.simulator.engine.trace import TRACE_COLUMNS, TRACE_OPS, to_chrome_trace
from sparsebalance.simulator.schedule.schedules import stage_orders


def uniform(schedule, p, m, f, b, *, v=1, dp=1, c=0.0, allreduce=0.0, optimizer=0.0):
    """Chunk times f / v and b / v so the whole model costs f + b per micro-batch."""
    nv = p * v
    return PipelineInput(schedule=schedule, pp=p, virtual_stages=v,
                         forward=np.full((dp, nv, m), f / v), backward=np.full((dp, nv, m), b / v),
                         p2p=c, allreduce=allreduce, optimizer=optimizer)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (2, 2), (4, 4), (4, 8), (3, 7), (8, 16)])
def test_uniform_time_and_bubble_closed_form(schedule, p, m):
    f, b = 1.25, 2.5
    res = simulate(uniform(schedule, p, m, f, b))
    assert res.iteration_time == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert res.stage_busy == pytest.approx(np.full(p, m * (f + b)))


@pytest.mark.parametrize("p,m", [(2, 3), (4, 6), (3, 1)])
def test_gpipe_p2p_adds_one_transfer_per_hop_each_way(p, m):
    # F0 reaches the last stage at (p-1)(f+c), which then runs m F and m B back to back; B0's
    # gradient returns through p-1 hops of (b+c) and stage 0 then runs its m B back to back:
    # T = (p-1)(f+c) + m f + (p-1)(b+c) + m b = (m+p-1)(f+b) + 2(p-1)c.
    f, b, c = 1.0, 2.0, 0.3
    res = simulate(uniform("gpipe", p, m, f, b, c=c))
    assert res.iteration_time == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * c, rel=1e-12)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 4, 2), (2, 4, 3), (2, 6, 2), (4, 12, 4)])
def test_interleaved_bubble_shrinks_by_virtual_stages(p, m, v):
    # With chunk times f/v, b/v, no P2P and m a multiple of p the fill/drain costs (p-1)(f+b)/v:
    # T = (v m + p - 1)(f + b) / v and bubble = (p - 1) / (v m + p - 1).
    f, b = 1.0, 2.0
    res = simulate(uniform("interleaved", p, m, f, b, v=v))
    assert res.iteration_time == pytest.approx((v * m + p - 1) * (f + b) / v, rel=1e-12)
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    one_f_one_b = simulate(uniform("1f1b", p, m, f, b)).bubble_fraction
    assert one_f_one_b / res.bubble_fraction == pytest.approx((v * m + p - 1) / (m + p - 1), rel=1e-12)


def test_ring_allreduce_enters_as_given():
    # Ring all-reduce of stage s: 2 (n-1)/n * bytes_s / bw, n = dp. With GPipe, uniform F/B, no P2P,
    # stage s ends its last B at (m+p-1)(f+b) - s b; then all-reduce, then the optimizer step.
    p, m, dp, f, b = 4, 6, 3, 1.0, 2.0
    grad_bytes = np.array([3e9, 2e9, 2e9, 4e9])
    bw = 50e9
    ring = 2 * (dp - 1) / dp * grad_bytes / bw
    opt = np.array([0.01, 0.02, 0.02, 0.03])
    res = simulate(uniform("gpipe", p, m, f, b, dp=dp, allreduce=ring, optimizer=opt))
    ends = (m + p - 1) * (f + b) - np.arange(p) * b
    assert res.iteration_time == pytest.approx(float(np.max(ends + ring + opt)), rel=1e-12)
    ar = res.trace[res.trace["op"] == "ALLREDUCE"]
    assert len(ar) == dp * p and (ar["microbatch"] == -1).all()
    assert (ar["end_s"] - ar["start_s"]).to_numpy() == pytest.approx(ring[ar["stage"].to_numpy()])


# ---- independent oracle: longest path over the dependency graph ----------------------------------

def longest_path(schedule, pp, v, fwd, bwd, p2p, allreduce, optimizer):
    """Earliest start of every action by fixed-point relaxation over the DAG:
    stage-order edges (previous action's end), data edges (F of vs-1 + P2P; B of vs+1 + P2P; own F
    for the last virtual stage's B); all-reduce of stage s after every replica's last action there.
    With pp = 1 every vstage is on the one device: its transfers are local (no P2P)."""
    dp, nv, m = fwd.shape
    if pp == 1:
        p2p = np.zeros_like(p2p)
    orders = stage_orders(schedule, pp, m, v)
    start = {}

    def end(key):
        op, r, vs, j = key
        return start[key] + (fwd if op == "F" else bwd)[r, vs, j]

    keys = [(op, r, vs, j) for r in range(dp) for s in range(pp) for (op, vs, j) in orders[s]]
    for k in keys:
        start[k] = 0.0
    changed = True
    while changed:
        changed = False
        for r in range(dp):
            for s in range(pp):
                prev = None
                for op, vs, j in orders[s]:
                    k = (op, r, vs, j)
                    deps = [end(prev)] if prev else []
                    if op == "F" and vs > 0:
                        deps.append(end(("F", r, vs - 1, j)) + p2p[r, vs - 1, j])
                    if op == "B":
                        deps.append(end(("F", r, vs, j)) if vs == nv - 1
                                    else end(("B", r, vs + 1, j)) + p2p[r, vs, j])
                    t = max(deps, default=0.0)
                    if t > start[k] + 1e-15:
                        start[k] = t
                        changed = True
                    prev = k
    last = [max(end((op, r, vs, j)) for r in range(dp) for (op, vs, j) in orders[s]) for s in range(pp)]
    T = max(last[s] + allreduce[s] + optimizer[s] for s in range(pp))
    return start, T


@pytest.mark.parametrize("method", ["core", "simpy"])
@pytest.mark.parametrize("seed", range(12))
def test_random_heterogeneous_matches_longest_path(seed, method):
    rng = np.random.default_rng(seed)
    schedule = ["gpipe", "1f1b", "interleaved"][seed % 3]
    pp = int(rng.integers(1, 5))
    v = int(rng.integers(2, 4)) if schedule == "interleaved" else 1
    m = int(rng.integers(pp, 9)) if schedule != "gpipe" else int(rng.integers(1, 9))
    if schedule == "interleaved":
        rounds = max(1, m // pp)
        m -= m % rounds
    dp = int(rng.integers(1, 4))
    nv = pp * v
    fwd = rng.uniform(0.1, 2.0, (dp, nv, m))
    bwd = rng.uniform(0.2, 4.0, (dp, nv, m))
    p2p = rng.uniform(0.0, 0.5, (dp, max(nv - 1, 0), m))
    ar, opt = rng.uniform(0, 1, pp), rng.uniform(0, 0.2, pp)
    res = simulate(PipelineInput(schedule=schedule, pp=pp, virtual_stages=v, forward=fwd, backward=bwd,
                                 p2p=p2p, allreduce=ar, optimizer=opt), method=method)
    start, T = longest_path(schedule, pp, v, fwd, bwd, p2p, ar, opt)
    assert res.iteration_time == pytest.approx(T, rel=1e-12)
    for (op, r, vs, j), t in start.items():
        got = (res.forward_start if op == "F" else res.backward_start)[r, vs, j]
        assert got == pytest.approx(t, rel=1e-12, abs=1e-12)
    work = (fwd + bwd).reshape(dp, v, pp, m).sum(axis=(1, 3))  # [dp, pp]
    assert res.stage_busy == pytest.approx(work.max(axis=0))
    assert res.bubble_fraction == pytest.approx(1 - work.sum() / (dp * pp * T), abs=1e-12)
    lat = (fwd + bwd).sum(axis=1)
    assert res.imbalance == pytest.approx(lat.max() / lat.mean())


def test_no_device_runs_two_actions_at_once():
    rng = np.random.default_rng(7)
    inp = PipelineInput(schedule="interleaved", pp=3, virtual_stages=2,
                        forward=rng.uniform(0.1, 1, (2, 6, 6)), backward=rng.uniform(0.1, 2, (2, 6, 6)),
                        p2p=0.05)
    tr = simulate(inp).trace
    for _, g in tr[tr["op"].isin(["F", "B"])].groupby(["dp_rank", "stage"]):
        s, e = g["start_s"].to_numpy(), g["end_s"].to_numpy()
        assert np.all(s[1:] >= e[:-1] - 1e-12)


# ---- trace ----------------------------------------------------------------------------------------

def _small():
    rng = np.random.default_rng(3)
    return PipelineInput(schedule="1f1b", pp=3, forward=rng.uniform(0.1, 1, (2, 3, 4)),
                         backward=rng.uniform(0.1, 2, (2, 3, 4)), p2p=rng.uniform(0, 0.1, (2, 2, 4)),
                         allreduce=0.2, optimizer=0.05, tokens=np.arange(8).reshape(2, 4) + 100,
                         budget=np.full((2, 4), 8.0), iteration=5)


def test_trace_rows_schema_and_p2p():
    inp = _small()
    tr = simulate(inp).trace
    assert tuple(tr.columns) == TRACE_COLUMNS
    assert set(tr["op"]) <= set(TRACE_OPS)
    counts = tr["op"].value_counts().to_dict()
    assert counts == {"F": 24, "B": 24, "P2P": 2 * 2 * 2 * 4, "ALLREDUCE": 6, "OPTIM": 6}
    assert (tr["iteration"] == 5).all()
    fb = tr[tr["op"].isin(["F", "B"])]
    assert (fb["tokens"] == 100 + 4 * fb["dp_rank"] + fb["microbatch"]).all()
    # every forward P2P starts when its sender's F ends and lasts the given transfer time
    fw = tr[tr["op"] == "F"].set_index(["dp_rank", "stage", "microbatch"])["end_s"]
    p2p = tr[tr["op"] == "P2P"]
    is_fwd = [abs(fw.get((r.dp_rank, r.stage, r.microbatch), -1) - r.start_s) < 1e-12
              for r in p2p.itertuples()]
    fwd_sends = p2p[is_fwd]
    assert len(fwd_sends) == 2 * 2 * 4
    want = inp.p2p[fwd_sends["dp_rank"], fwd_sends["stage"], fwd_sends["microbatch"]]
    assert (fwd_sends["end_s"] - fwd_sends["start_s"]).to_numpy() == pytest.approx(want)


def test_chrome_trace_round_trip(tmp_path):
    tr = simulate(_small()).trace
    csv_path, json_path = tmp_path / "trace.csv", tmp_path / "trace.json"
    tr.to_csv(csv_path, index=False, columns=list(TRACE_COLUMNS))
    json_path.write_text(json.dumps(to_chrome_trace(tr)))
    back = pd.read_csv(csv_path)
    assert len(back) == len(tr) and list(back.columns) == list(TRACE_COLUMNS)
    events = json.loads(json_path.read_text())["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(tr)
    # P2P slices have tracks of their own under the stage (tid 1000 + 10 stage + lane)
    got = sorted((e["pid"], e["tid"] if e["tid"] < 1000 else e["tid"] % 1000 // 10, e["name"],
                  round(e["ts"], 3), round(e["dur"], 3)) for e in xs)
    want = sorted((int(r.dp_rank), int(r.stage), f"{r.op}{r.microbatch}" if r.op in "FB" else r.op,
                   round(r.start_s * 1e6, 3), round((r.end_s - r.start_s) * 1e6, 3)) for r in tr.itertuples())
    assert got == want
    meta = {(e["name"], e["pid"], e["tid"]) for e in events if e["ph"] == "M"}
    assert {("process_name", r, 0) for r in (0, 1)} <= meta
    assert {("thread_name", r, s) for r in (0, 1) for s in range(3)} <= meta
    assert all(e["args"]["iteration"] == 5 for e in xs)


def test_chrome_trace_lays_simulated_iterations_end_to_end():
    a = simulate(_small()).trace.assign(iteration=0)
    b = a.assign(iteration=1)
    events = [e for e in to_chrome_trace(pd.concat([a, b]))["traceEvents"] if e["ph"] == "X"]
    first_end = a["end_s"].max() * 1e6
    second = [e["ts"] for e in events if e["args"]["iteration"] == 1]
    assert min(second) == pytest.approx(first_end)


def test_timeline_writes_png_and_svg(tmp_path):
    from sparsebalance.analysis.timeline import plot_timeline

    out = plot_timeline(simulate(_small()).trace, tmp_path / "tl.png", iteration=5, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "tl.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("kw,needle", [
    ({"forward": -np.ones((1, 2, 2))}, "forward"),
    ({"backward": np.ones((1, 2, 3))}, "backward"),
    ({"p2p": -0.1}, "p2p"),
    ({"allreduce": [1.0, 2.0, 3.0]}, "allreduce"),
    ({"forward": np.ones((1, 3, 2))}, "virtual stages"),
])
def test_bad_input_raises_config_error(kw, needle):
    args = {"schedule": "gpipe", "pp": 2, "forward": np.ones((1, 2, 2)), "backward": np.ones((1, 2, 2))} | kw
    with pytest.raises(ConfigError, match=needle):
        PipelineInput(**args)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2),
                                        ("dualpipev", 2)])
def test_a_whole_run_gives_the_same_times_on_either_engine(schedule, v):
    """The run config's ``engine`` through the whole loop (policies, executor, memory, trace): SimPy
    and the timing core agree on every iteration of every schedule."""
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.runner import prepare, run_simulation

    sets = {"iterations": 3, "cluster.pp": 2, "cluster.dp": 2, "cluster.tp": 1, "cluster.schedule": schedule,
            "cluster.virtual_stages": v, "cluster.global_batch": 16, "policy.batching": "sab",
            "policy.tuning": "dst"}
    runs = {}
    for engine in ("core", "simpy"):
        cfg = load_run_config("examples/qwen25-3b_h200_dp4pp4.toml", sets | {"engine": engine})
        runs[engine] = run_simulation(cfg, progress=False, prepared=prepare(cfg)).metrics
    np.testing.assert_allclose(runs["simpy"].iteration_time_s, runs["core"].iteration_time_s, rtol=1e-9)
    np.testing.assert_allclose(runs["simpy"].bubble_fraction, runs["core"].bubble_fraction, rtol=1e-9, atol=1e-12)


def test_engine_is_validated_when_the_config_loads():
    from sparsebalance.errors import ConfigError
    from sparsebalance.runconfig import load_run_config

    with pytest.raises(ConfigError, match="engine.*core, simpy"):
        load_run_config("examples/qwen25-3b_h200_dp4pp4.toml", {"engine": "events"})
