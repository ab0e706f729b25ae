"""Turn the ranks' reports of one iteration into the loop's IterationResult (the simulator's metrics,
computed the same way from measured rows)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from sparsebalance.simulator.engine.iteration import IterationResult
from sparsebalance.simulator.engine.trace import TRACE_COLUMNS, WORK_OPS


def iteration_result(reports: list, *, pp: int, dp: int, microbatches: int) -> IterationResult:
    """Merge rank reports. Iteration time = last OPTIM end - first rank's start (all ranks leave one
    barrier together); a micro-batch's latency = its F + B (or F + I + W) seconds summed over stages;
    bubble fraction = 1 - busy / (dp x pp x iteration time), busy = those seconds, as in the simulator."""
    from sparsebalance.kernels.cpuclock import CPU_COLUMNS

    rows, cpu = [], []
    for rep in reports:
        usage = dict(getattr(rep, "cpu", ()))
        cpu += [usage.get(i, (np.nan,) * len(CPU_COLUMNS)) for i in range(len(rep.rows))]
        rows += rep.rows
    # TRACE_COLUMNS, then CPU time beside wall time for F/B rows (NaN elsewhere; realrun only)
    trace = pd.DataFrame(rows, columns=list(TRACE_COLUMNS))
    trace[list(CPU_COLUMNS)] = pd.DataFrame(cpu, columns=list(CPU_COLUMNS), index=trace.index)
    start = min(rep.start_s for rep in reports)
    end = max(rep.end_s for rep in reports)
    it_time = end - start
    mb_lat = np.zeros((dp, microbatches))
    busy = np.zeros((dp, pp))
    compute = trace[trace["op"].isin(WORK_OPS)]
    for row in compute.itertuples(index=False):
        dur = row.end_s - row.start_s
        mb_lat[row.dp_rank, row.microbatch] += dur
        busy[row.dp_rank, row.stage] += dur
    bubble = float(1.0 - busy.sum() / (dp * pp * it_time)) if it_time > 0 else 0.0
    coverage: dict[int, tuple[float, ...]] = {}
    for rep in reports:
        coverage.update(rep.coverage)
    by_op = trace.assign(d=trace["end_s"] - trace["start_s"]).groupby("op")["d"].sum()
    extra: dict[str, Any] = {
        "loss": float(sum(rep.loss for rep in reports)),
        **_label_accuracy(reports),
        "p2p_wait_s": float(by_op.get("P2P", 0.0)) / (dp * pp),
        "allreduce_s": float(by_op.get("ALLREDUCE", 0.0)) / (dp * pp),
        "optim_s": float(by_op.get("OPTIM", 0.0)) / (dp * pp),
    }
    return IterationResult(iteration_time_s=float(it_time), trace=trace,
                           microbatch_latency_s=mb_lat.tolist(), stage_busy_s=busy.max(axis=0).tolist(),
                           bubble_fraction=bubble, coverage=coverage, extra=extra)


def _label_accuracy(reports: list) -> dict[str, float]:
    """``answer_accuracy`` over the iteration's labels when the last stages counted hits, else {}."""
    right = sum(getattr(rep, "hits", (0, 0))[0] for rep in reports)
    total = sum(getattr(rep, "hits", (0, 0))[1] for rep in reports)
    return {"answer_accuracy": right / total} if total else {}
