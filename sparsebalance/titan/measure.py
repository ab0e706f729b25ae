"""Predicted vs measured inside torchtitan: the two sides of one torchtitan job in the shapes
``analysis.validate`` compares (per-iteration metrics and a trace in the simulator's schema).

* **Predicted**: the job's own plans and budgets (every rank computes them from the seed, so this
  process computes the same ones: :class:`~sparsebalance.titan.loader.StepPlanner`) executed by the
  simulator (``SimulatorExecutor``) with the run's latency profile; a slot's pad is priced as it runs
  (dense layers at the slot's tokens, attention on the documents only).
* **Measured**: the trainer's trace (``trace_rank<R>.csv``, written with ``--sparsebalance.measure``:
  every F and B of a (stage, micro-batch) and the optimizer step, seconds from the step's barrier).
  An iteration's time is its last OPTIM row's end (every rank leaves the barrier together).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from sparsebalance.simulator.engine.trace import TRACE_COLUMNS


def replay(setup: Any, steps: int, *, profile: Any = None,
           calibration: Any = None) -> tuple[pd.DataFrame, pd.DataFrame, list]:
    """(metrics: iteration, iteration_time_s, tokens; the simulator's trace; the plans) of the job's
    first ``steps`` steps, priced with ``profile`` (default: the run's) and, where given, a trainer
    probe's :class:`~sparsebalance.simulator.cost.actioncalibration.ActionCalibration`."""
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.engine.executor import SimulatorExecutor
    from sparsebalance.titan.loader import StepPlanner

    run = setup.run
    planner = StepPlanner(setup)
    latency = load_latency_model(run.profile if profile is None else profile, run.model, run.cluster,
                                 base_dir=run.base_dir, extrapolate=run.latency_extrapolate,
                                 allow_nonmonotone=run.allow_nonmonotone)
    executor = SimulatorExecutor(latency, run.model, run.cluster, engine=run.engine, calibration=calibration)
    rows, traces, plans = [], [], []
    for it in range(steps):
        plan, budgets = planner.next()
        res = executor.execute(it, plan, budgets)
        rows.append({"iteration": it, "iteration_time_s": res.iteration_time_s,
                     "tokens": sum(s.length for s in plan.sequences())})
        traces.append(res.trace)
        plans.append((plan, budgets))
    return pd.DataFrame(rows), pd.concat(traces, ignore_index=True), plans


def measured(trace: pd.DataFrame, plans: list) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(metrics, trace) of a measured torchtitan job: its iteration times from the OPTIM rows, the
    documents' tokens of each step from the plans it ran."""
    tr = trace[list(TRACE_COLUMNS)].copy()
    optim = tr[tr["op"] == "OPTIM"].groupby("iteration")["end_s"].max()
    rows = [{"iteration": int(it), "iteration_time_s": float(t),
             "tokens": sum(s.length for s in plans[int(it)][0].sequences())}
            for it, t in optim.items() if int(it) < len(plans)]
    return pd.DataFrame(rows), tr
