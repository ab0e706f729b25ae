"""Writing a simulated run's results (shared by the loop verbs).

Building and running a config lives in ``sparsebalance/runner.py`` (realrun uses it too).
"""

from __future__ import annotations

import sys
from pathlib import Path

from sparsebalance.loop import WALL_CLOCK_COLUMNS, LoopResult
from sparsebalance.runconfig import RunConfig, dump_toml
from sparsebalance.runner import Prepared, prepare, run_simulation  # noqa: F401  (the verbs' entry points)

TRACE_LIMIT = 100_000
"""Default cap on the actions written to trace.csv / trace.json (about 25 MB of Chrome JSON)."""


def limit_trace(trace, limit: int):
    """(kept rows, note): whole iterations from the first while they fit in ``limit`` actions; when
    not even the first fits, its first ``limit`` actions by start time. ``note`` says what was left
    out ('' when nothing)."""
    n = len(trace)
    if n <= limit:
        return trace, ""
    sizes = trace.groupby("iteration").size().sort_index()
    cum = sizes.cumsum()
    keep = cum[cum <= limit].index
    total = len(sizes)
    if len(keep) == 0:
        first = sizes.index[0]
        part = trace[trace["iteration"] == first].sort_values(["start_s", "end_s"], kind="stable")
        return part.iloc[:limit], (f"trace holds the first {limit:,} of the {sizes.iloc[0]:,} actions "
                                   f"of iteration {first} (--trace-limit; --no-trace skips it)")
    kept = trace[trace["iteration"].isin(keep)]
    return kept, (f"trace holds iterations {keep[0]}..{keep[-1]} of {total} ({len(kept):,} of {n:,} "
                  f"actions; --trace-limit {limit:,})")


def write_results(cfg: RunConfig, result: LoopResult, outdir: Path | None = None, *,
                  timeline_iteration: int = 0, prefix: str = "", trace: bool = True,
                  trace_limit: int = TRACE_LIMIT) -> Path:
    """Write ``config.toml``, ``metrics.csv`` (deterministic), ``timing.csv`` (wall clock:
    decision_ms), ``trace.csv``, ``trace.json`` (Chrome/Perfetto) and ``timeline.png``/``.svg`` under
    ``<output_dir>/<name>/`` (or ``outdir``). Returns the directory.

    ``trace=False`` skips the trace files and the timeline (``--no-trace``); otherwise at most
    ``trace_limit`` actions are written (whole iterations, see :func:`limit_trace`)."""
    import json

    from sparsebalance.analysis.timeline import plot_timeline
    from sparsebalance.fsutil import atomic_to_csv, atomic_write_text
    from sparsebalance.simulator.engine.trace import to_chrome_trace

    out = Path(outdir) if outdir else Path(cfg.output_dir) / cfg.name
    out.mkdir(parents=True, exist_ok=True)
    # every file by temporary sibling and rename: a full disk leaves no truncated file, and the
    # OSError names the file it hit (the directory stays marked incomplete, commands/_args.py)
    atomic_write_text(out / "config.toml", dump_toml(cfg))
    wall = [c for c in WALL_CLOCK_COLUMNS if c in result.metrics]
    # deterministic numbers apart from wall-clock ones: identical runs give identical metrics.csv
    atomic_to_csv(result.metrics.drop(columns=wall), out / f"{prefix}metrics.csv")
    atomic_to_csv(result.metrics[["iteration", *wall]], out / f"{prefix}timing.csv")
    if not trace:
        return out
    tr, note = limit_trace(result.trace, trace_limit)
    if note:
        print(f"sparsebalance: {note}", file=sys.stderr)
    atomic_to_csv(tr, out / f"{prefix}trace.csv")
    atomic_write_text(out / f"{prefix}trace.json", json.dumps(to_chrome_trace(tr)))
    plot_timeline(tr, out / f"{prefix}timeline.png", iteration=timeline_iteration,
                  title=f"{cfg.name}: {cfg.policy.batching}+{cfg.policy.tuning}")
    return out
