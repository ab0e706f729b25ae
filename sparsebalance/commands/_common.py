"""Writing a simulated run's results (shared by simulate, sweep, ablation, validate).

Building and running a config lives in ``sparsebalance/runner.py`` (realrun uses it too).
"""

from __future__ import annotations

import json
from pathlib import Path

from sparsebalance.loop import LoopResult
from sparsebalance.runconfig import RunConfig, dump_toml
from sparsebalance.runner import Prepared, prepare, run_simulation  # noqa: F401  (the verbs' entry points)


def write_results(cfg: RunConfig, result: LoopResult, outdir: Path | None = None, *,
                  timeline_iteration: int = 0, prefix: str = "") -> Path:
    """Write ``config.toml``, ``metrics.csv``, ``trace.csv``, ``trace.json`` (Chrome/Perfetto) and
    ``timeline.png``/``.svg`` under ``<output_dir>/<name>/`` (or ``outdir``). Returns the directory."""
    from sparsebalance.analysis.timeline import plot_timeline
    from sparsebalance.simulator.trace import to_chrome_trace

    out = Path(outdir) if outdir else Path(cfg.output_dir) / cfg.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dump_toml(cfg))
    result.metrics.to_csv(out / f"{prefix}metrics.csv", index=False)
    result.trace.to_csv(out / f"{prefix}trace.csv", index=False)
    (out / f"{prefix}trace.json").write_text(json.dumps(to_chrome_trace(result.trace)))
    plot_timeline(result.trace, out / f"{prefix}timeline.png", iteration=timeline_iteration,
                  title=f"{cfg.name}: {cfg.policy.batching}+{cfg.policy.tuning}")
    return out
