"""The trace schema shared by the simulator and realrun (one row per action)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: Column order of every trace table (CSV/Parquet). Times in seconds from the iteration's start
#: (simulator) or from the run's first action (realrun). microbatch is -1 for ALLREDUCE/OPTIM.
TRACE_COLUMNS = (
    "iteration", "dp_rank", "stage", "microbatch", "op", "start_s", "end_s", "tokens", "budget",
)
#: Allowed values of the ``op`` column.
TRACE_OPS = ("F", "B", "P2P", "ALLREDUCE", "OPTIM")

#: Chrome trace colour names (catapult's reserved palette) per op, so F and B differ at a glance.
_CHROME_COLOURS = {"F": "thread_state_running", "B": "rail_animation", "P2P": "grey",
                   "ALLREDUCE": "rail_load", "OPTIM": "yellow"}


def check_trace(df) -> None:
    """Raise ValueError unless ``df`` has the TRACE_COLUMNS and only TRACE_OPS ops."""
    missing = [c for c in TRACE_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"trace: missing columns {', '.join(missing)}")
    bad = set(df["op"].unique()) - set(TRACE_OPS)
    if bad:
        raise ValueError(f"trace.op: {sorted(bad)} not allowed; choose from {', '.join(TRACE_OPS)}")


def to_chrome_trace(df) -> dict[str, Any]:
    """A trace table -> Chrome trace JSON (``chrome://tracing``, Perfetto): one complete ("X") event
    per row with pid = dp_rank, tid = stage, ts/dur in microseconds (iterations placed one after
    another, each offset by the end of the previous one), name "F3"/"B3" for micro-batch 3 or the op;
    args hold tokens, budget, iteration and micro-batch. Process/thread names are metadata events."""
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
    for row in df.itertuples(index=False):
        op = row.op
        mb = int(row.microbatch)
        start = row.start_s + offset[row.iteration]
        events.append({
            "name": f"{op}{mb}" if op in ("F", "B") else op,
            "cat": op, "ph": "X", "pid": int(row.dp_rank), "tid": int(row.stage),
            "ts": start * 1e6, "dur": (row.end_s - row.start_s) * 1e6,
            "cname": _CHROME_COLOURS[op],
            "args": {"iteration": int(row.iteration), "microbatch": mb, "tokens": _int(row.tokens),
                     "budget": _num(row.budget)},
        })
    for r in sorted(df["dp_rank"].unique()):
        events.append({"name": "process_name", "ph": "M", "pid": int(r), "tid": 0,
                       "args": {"name": f"dp_rank {int(r)}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": int(r), "tid": 0,
                       "args": {"sort_index": int(r)}})
        for s in sorted(df.loc[df["dp_rank"] == r, "stage"].unique()):
            events.append({"name": "thread_name", "ph": "M", "pid": int(r), "tid": int(s),
                           "args": {"name": f"stage {int(s)}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _int(x) -> int:
    return -1 if _isnan(x) else int(x)  # NaN (unknown) -> -1, as in the simulator's trace


def _num(x) -> float | None:
    return None if _isnan(x) else float(x)


def _isnan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def write_trace(df, directory: str | Path, prefix: str = "") -> tuple[Path, Path]:
    """Write ``<prefix>trace.csv`` and ``<prefix>trace.json`` (Chrome) under ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / f"{prefix}trace.csv", out / f"{prefix}trace.json"
    df.to_csv(csv_path, index=False, columns=list(TRACE_COLUMNS))
    json_path.write_text(json.dumps(to_chrome_trace(df)))
    return csv_path, json_path
