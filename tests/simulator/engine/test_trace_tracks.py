"""Chrome trace tracks: every (pid, tid) track holds disjoint slices (so Perfetto nests nothing
wrongly), P2P sits on tracks of its own under its stage, nothing is lost or moved in time."""

from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd

from sparsebalance.simulator.engine.trace import P2P_TID_BASE, TRACE_COLUMNS, to_chrome_trace


def _row(it, r, s, mb, op, a, b):
    return {"iteration": it, "dp_rank": r, "stage": s, "microbatch": mb, "op": op, "start_s": a,
            "end_s": b, "tokens": 10, "budget": 4}


def _disjoint(events) -> bool:
    by_track: dict = {}
    for e in events:
        by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        if any(b[0] < a[1] - 1e-6 for a, b in itertools.pairwise(spans)):
            return False
    return True


def test_overlapping_p2p_get_lanes_and_compute_keeps_tid_stage():
    rows = [_row(0, 0, 0, 0, "F", 0.0, 1.0), _row(0, 0, 0, 1, "F", 1.0, 2.0),
            _row(0, 0, 0, 0, "P2P", 0.9, 1.6),   # overlaps F1 on the sender's stage
            _row(0, 0, 0, 1, "P2P", 1.2, 2.5),   # overlaps the first transfer too: second lane
            _row(0, 0, 0, 2, "P2P", 1.7, 1.8),   # the first lane is free again
            _row(0, 0, 1, 0, "B", 0.5, 3.0)]
    events = [e for e in to_chrome_trace(pd.DataFrame(rows, columns=TRACE_COLUMNS))["traceEvents"]]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(rows) and _disjoint(xs)
    tid = {(e["name"], e["ts"]): e["tid"] for e in xs}
    assert tid[("F0", 0.0)] == tid[("F1", 1e6)] == 0 and tid[("B0", 0.5e6)] == 1
    assert tid[("P2P", 0.9e6)] == tid[("P2P", 1.7e6)] == P2P_TID_BASE
    assert tid[("P2P", 1.2e6)] == P2P_TID_BASE + 1
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(0, 0)] == "stage 0" and names[(0, P2P_TID_BASE)] == "stage 0 P2P"
    assert names[(0, P2P_TID_BASE + 1)] == "stage 0 P2P (2)"
    order = {(e["pid"], e["tid"]): e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    assert order[(0, 0)] < order[(0, P2P_TID_BASE)] < order[(0, P2P_TID_BASE + 1)] < order[(0, 1)]


def test_simulated_runs_give_disjoint_tracks():
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.runner import run_simulation

    root = Path(__file__).resolve().parents[3]
    cfg = load_run_config(root / "examples" / "qwen25-3b_h200_dp4pp4.toml",
                          {"iterations": 2, "data.num_sequences": 64, "policy.tuning": "dst"})
    trace = run_simulation(cfg, progress=False).trace
    xs = [e for e in to_chrome_trace(trace)["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(trace) and _disjoint(xs)
    p2p = {e["tid"] for e in xs if e["name"] == "P2P"}
    assert p2p and min(p2p) >= P2P_TID_BASE
