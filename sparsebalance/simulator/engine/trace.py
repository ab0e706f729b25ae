"""The trace schema shared by the simulator and realrun (one row per action)."""

from __future__ import annotations

import math
from typing import Any

#: Column order of every trace table (CSV/Parquet). Times in seconds from the iteration's start
#: (simulator) or from the run's first action (realrun). microbatch is -1 for ALLREDUCE/OPTIM.
TRACE_COLUMNS = (
    "iteration", "dp_rank", "stage", "microbatch", "op", "start_s", "end_s", "tokens", "budget",
)
#: Allowed values of the ``op`` column: forward, backward (whole, or split into its input-gradient
#: part I and weight-gradient part W by the zero-bubble schedules), transfers, all-reduce, optimizer.
TRACE_OPS = ("F", "B", "I", "W", "P2P", "ALLREDUCE", "OPTIM", "CP", "CP_COMM", "AG", "RS")
"""``CP``: one row per ring step of a context-parallel action's attention (simulator, ``cluster.cp > 1``);
``CP_COMM``: one row per transfer of a CP group's K/V (a ring hop, an all-gather, the gradients'
way back; simulator: the transfer's seconds, realrun: the collective call's, waits included);
``AG`` / ``RS``: one row per unit all-gather / gradient reduce-scatter inside an F or B action under
``cluster.dp_mode`` zero2 / zero3 (simulator, ``simulator/cost/fsdp.py``)."""
NESTED_OPS = ("CP", "CP_COMM", "AG", "RS")
"""Ops whose rows lie inside an F/B/I action's span: on tracks of their own, never added to a
stage's busy or traced time."""

#: Chrome trace colour names (catapult's reserved palette) per op, so F and B differ at a glance.
_CHROME_COLOURS = {"F": "thread_state_running", "B": "rail_animation", "I": "rail_animation",
                   "W": "rail_idle", "P2P": "grey", "ALLREDUCE": "rail_load", "OPTIM": "yellow",
                   "CP": "thread_state_iowait", "CP_COMM": "grey", "AG": "rail_response", "RS": "rail_load"}


def check_trace(df) -> None:
    """Raise ValueError unless ``df`` has the TRACE_COLUMNS and only TRACE_OPS ops."""
    missing = [c for c in TRACE_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"trace: missing columns {', '.join(missing)}")
    bad = set(df["op"].unique()) - set(TRACE_OPS)
    if bad:
        raise ValueError(f"trace.op: {sorted(bad)} not allowed; choose from {', '.join(TRACE_OPS)}")


WORK_OPS = ("F", "B", "I", "W")
"""Ops that are a stage's compute on one micro-batch (busy time, micro-batch latency)."""
COMPUTE_OPS = ("F", "B", "I", "W", "ALLREDUCE", "OPTIM")
"""Ops drawn on a stage's own track (tid = stage); P2P gets tracks of its own (see to_chrome_trace)."""
P2P_TID_BASE = 1000
"""tid of stage s's first P2P track: 1000 + 10 s (+ lane); further compute lanes (never needed for
traces from the simulator or realrun, whose compute ops never overlap) would be 2000 + 10 s + lane."""


def to_chrome_trace(df) -> dict[str, Any]:
    """A trace table -> Chrome trace JSON (``chrome://tracing``, Perfetto): one complete ("X") event
    per row with pid = dp_rank, ts/dur in microseconds (iterations placed one after another, each
    offset by the end of the previous one), name "F3"/"B3" for micro-batch 3 or the op; args hold
    tokens, budget, iteration and micro-batch.

    Tracks: F, B, ALLREDUCE and OPTIM of stage s are on tid = s ("stage s"). P2P transfers overlap
    the sender's compute, and one another, so they go to tracks of their own right under the stage
    ("stage s P2P", tid = 1000 + 10 s + lane): slices are assigned greedily to the first lane where
    they do not overlap, so every track holds disjoint slices and Perfetto nests nothing wrongly.
    CP ring steps and CP transfers (NESTED_OPS) get tracks the same way ("stage s CP", tid 3000 +
    10 s + lane; "stage s CP comm", tid 4000 + 10 s + lane), FSDP's unit gathers and
    reduce-scatters likewise ("stage s FSDP gather", tid 5000 + ...; "... reduce-scatter", 6000 + ...).
    Process/thread names and sort order are metadata events."""
    check_trace(df)
    events: list[dict[str, Any]] = []
    if len(df) == 0:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    # Simulated iterations each start at 0 s; measured ones share the run's clock. Lay the former end
    # to end on one axis (detected by overlapping iteration spans).
    span = df.groupby("iteration").agg(lo=("start_s", "min"), hi=("end_s", "max")).sort_index()
    overlap = bool((span["lo"].to_numpy()[1:] < span["hi"].to_numpy()[:-1]).any())
    shift = (span["hi"].cumsum() - span["hi"]) if overlap else span["hi"] * 0.0
    offset = dict(zip(span.index, shift.to_numpy()))
    tracks: dict[tuple[int, int], str] = {}  # (pid, tid) -> track name
    lanes: dict[tuple[int, int, bool], list[float]] = {}  # (pid, stage, is_p2p) -> lane end times
    rows = sorted(df.itertuples(index=False),
                  key=lambda r: (r.start_s + offset[r.iteration], r.end_s + offset[r.iteration]))
    for row in rows:
        op = row.op
        mb = int(row.microbatch)
        pid, stage = int(row.dp_rank), int(row.stage)
        start = row.start_s + offset[row.iteration]
        end = row.end_s + offset[row.iteration]
        tid = _lane(lanes, tracks, pid, stage, op if op in ("P2P", *NESTED_OPS) else "", start, end)
        events.append({
            "name": f"{op}{mb}" if op in ("F", "B", "I", "W") else op,
            "cat": op, "ph": "X", "pid": pid, "tid": tid,
            "ts": start * 1e6, "dur": (end - start) * 1e6,
            "cname": _CHROME_COLOURS[op],
            "args": {"iteration": int(row.iteration), "microbatch": mb, "tokens": _int(row.tokens),
                     "budget": _num(row.budget)},
        })
    for r in sorted(df["dp_rank"].unique()):
        events.append({"name": "process_name", "ph": "M", "pid": int(r), "tid": 0,
                       "args": {"name": f"dp_rank {int(r)}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": int(r), "tid": 0,
                       "args": {"sort_index": int(r)}})
    for (pid, tid), name in sorted(tracks.items()):
        stage, sub = (tid, 0) if tid < P2P_TID_BASE else divmod(tid % P2P_TID_BASE, 10)
        # stage, P2P, more lanes, CP steps, CP comm, FSDP gathers, FSDP reduce-scatters
        band = {0: 0, 1: 1, 2: 50, 3: 25, 4: 30, 5: 35, 6: 40}[tid // P2P_TID_BASE]
        order = stage * 100 + (0 if tid < P2P_TID_BASE else band + sub)
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": order}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _lane(lanes, tracks, pid: int, stage: int, side: str, start: float, end: float) -> int:
    """The first lane of (pid, stage, side) free at ``start`` (rows come sorted by start); ``side``
    "P2P", "CP" or "CP_COMM" for the tracks of their own under a stage, "" for the stage's compute."""
    ends = lanes.setdefault((pid, stage, side), [])
    eps = 1e-12 * max(1.0, abs(end))
    lane = next((i for i, e in enumerate(ends) if e <= start + eps), len(ends))
    if lane == len(ends):
        ends.append(end)
    else:
        ends[lane] = end
    if side:
        base = {"P2P": 1, "CP": 3, "CP_COMM": 4, "AG": 5, "RS": 6}[side] * P2P_TID_BASE
        tid = base + 10 * stage + lane
        label = {"CP_COMM": "CP comm", "AG": "FSDP gather", "RS": "FSDP reduce-scatter"}.get(side, side)
        name = f"stage {stage} {label}" + (f" ({lane + 1})" if lane else "")
    elif lane == 0:
        tid, name = stage, f"stage {stage}"
    else:
        tid, name = 2 * P2P_TID_BASE + 10 * stage + lane, f"stage {stage} ({lane + 1})"
    tracks.setdefault((pid, tid), name)
    return tid


def _int(x) -> int:
    return -1 if _isnan(x) else int(x)  # NaN (unknown) -> -1, as in the simulator's trace


def _num(x) -> float | None:
    return None if _isnan(x) else float(x)


def _isnan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)
