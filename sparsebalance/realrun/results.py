"""What a real run writes under ``<output_dir>/<name>/`` and how plans are read back for replay.

Files: ``config.toml`` (resolved run config), ``metrics.csv`` (one row per iteration),
``measured_trace.csv`` (TRACE_COLUMNS, seconds from the run's shared origin), ``measured_trace.json``
(Chrome/Perfetto), ``plans.json`` (per iteration: sequence ids and lengths per DP rank and
micro-batch, and budgets: exactly the work the simulator needs to replay).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PLANS_FORMAT = 1


def plans_to_json(plans: list, budgets: list) -> dict[str, Any]:
    its = []
    for i, (plan, bud) in enumerate(zip(plans, budgets)):
        its.append({
            "iteration": i,
            "ranks": [[{"ids": [int(s.id) for s in mb.sequences], "lengths": list(mb.lengths)}
                       for mb in r] for r in plan.ranks],
            "budgets": [[b.to_json() for b in r] for r in bud],
        })
    return {"format_version": PLANS_FORMAT, "iterations": its}


def load_plans(path: str | Path) -> tuple[list, list]:
    """Read ``plans.json`` back into (list of Plan, list of Budgets), sequences without tokens."""
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.errors import ConfigError
    from sparsebalance.simulator.plan import Budget, Plan

    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"plans: cannot read {p}: {e}") from None
    if data.get("format_version") != PLANS_FORMAT:
        raise ConfigError(f"plans.format_version: expected {PLANS_FORMAT}, got {data.get('format_version')!r}")
    plans, budgets = [], []
    for it in data["iterations"]:
        plans.append(Plan.from_lists([[[Sequence(id=i, length=n) for i, n in zip(mb["ids"], mb["lengths"])]
                                       for mb in r] for r in it["ranks"]]))
        budgets.append(tuple(tuple(Budget.from_json(b, f"{p}: iteration {it['iteration']} budget") for b in r)
                             for r in it["budgets"]))
    return plans, budgets


def write_realrun_results(cfg: Any, result: Any, outdir: str | Path | None = None) -> Path:
    """Write a LoopResult of a real run; returns the directory."""
    from sparsebalance.runconfig import dump_toml
    from sparsebalance.simulator.engine.trace import to_chrome_trace

    out = Path(outdir) if outdir else Path(cfg.output_dir) / cfg.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dump_toml(cfg))
    result.metrics.to_csv(out / "metrics.csv", index=False)
    result.trace.to_csv(out / "measured_trace.csv", index=False)
    (out / "measured_trace.json").write_text(json.dumps(to_chrome_trace(result.trace)))
    (out / "plans.json").write_text(json.dumps(plans_to_json(result.plans, result.budgets)))
    return out
