"""The iteration loop shared by simulated and real runs.

global batch -> batching policy -> plan -> tuning policy -> budgets -> executor -> trace.
Written once: the executor (simulator or realrun) is passed in, policy state is carried across
iterations, and decision time (batching + tuning, wall clock on this CPU) is measured. The executor
interface (``Executor``, ``IterationResult``) lives in ``simulator/engine/iteration.py`` so the simulator can
implement it without importing policies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sparsebalance.data.sequence import Sequence
from sparsebalance.errors import ConfigError
from sparsebalance.policies.base import BatchingPolicy, PolicyContext, TuningPolicy
from sparsebalance.simulator.engine.iteration import Executor
from sparsebalance.simulator.engine.trace import TRACE_COLUMNS
from sparsebalance.simulator.flops import model_flops
from sparsebalance.simulator.plan import Budget, Budgets, Plan


def global_batches(sequences: list[Sequence], global_batch: int, *, shuffle: bool,
                   rng: np.random.Generator) -> Iterator[list[Sequence]]:
    """Endless epochs of global batches; each epoch shuffled when ``shuffle`` (drops the ragged tail)."""
    if len(sequences) < global_batch:
        raise ValueError(f"data: {len(sequences)} sequences cannot fill one global batch of {global_batch}")
    while True:
        order = rng.permutation(len(sequences)) if shuffle else np.arange(len(sequences))
        for start in range(0, len(order) - global_batch + 1, global_batch):
            yield [sequences[i] for i in order[start:start + global_batch]]


PHASE_BATCH = 2048
"""Global batches at least this large show their current step (batching, tuning, executing) on the
progress bar."""
WALL_CLOCK_COLUMNS = ("decision_ms",)
"""Per-iteration columns measured by the wall clock of this machine: two identical runs differ in
them, so results write them apart (``timing.csv``) from the deterministic ``metrics.csv``."""


def imbalance(latencies: list[list[float]]) -> float:
    flat = np.asarray([x for r in latencies for x in r], dtype=float)
    return float(flat.max() / flat.mean()) if flat.size and flat.mean() > 0 else 1.0


@dataclass(slots=True)
class LoopResult:
    metrics: pd.DataFrame
    """One row per iteration: iteration_time_s, imbalance, bubble_fraction, decision_ms, budgets, ..."""
    trace: pd.DataFrame
    plans: list[Plan]
    budgets: list[Budgets]


class NonFiniteLoss(ConfigError):
    """A training loss that is not a finite number: the run diverged. A bad input (exit code 2: the
    same config diverges again wherever it runs), raised by an executor at the first such iteration;
    :func:`run_loop` stops there and attaches the iterations before it as ``partial``, for the caller
    to write (marked incomplete)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.partial: LoopResult | None = None


def check_loss(loss: float, iteration: int, *, where: str = "", hint: str = "") -> None:
    """Raise :class:`NonFiniteLoss` naming the iteration (and ``where``: rank, micro-batch) unless
    ``loss`` is finite. ``hint``: the fields that tame it (learning rate, clipping)."""
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"training loss is {loss!r} at iteration {iteration}{where}: the training "
                            f"diverged{'; ' + hint if hint else ''}")


def run_loop(*, batches: Iterator[list[Sequence]], batching: BatchingPolicy, tuning: TuningPolicy,
             executor: Executor, ctx: PolicyContext, iterations: int,
             progress: bool = True) -> LoopResult:
    """Run ``iterations`` iterations; returns per-iteration metrics and the concatenated trace. An
    executor's :class:`NonFiniteLoss` stops the loop with the iterations before it attached."""
    from tqdm import tqdm

    rows: list[dict] = []
    traces: list[pd.DataFrame] = []
    plans: list[Plan] = []
    all_budgets: list[Budgets] = []
    bar = tqdm(range(iterations), desc=f"{executor.name} {batching.name}+{tuning.name}",
               disable=not progress, leave=False)
    for it in bar:
        batch = next(batches)
        # a big global batch takes seconds per step: the bar names the step it is in
        big = progress and len(batch) >= PHASE_BATCH
        t0 = time.perf_counter()
        if big:
            bar.set_postfix_str("batching", refresh=True)
        plan = batching.plan(batch, ctx)
        if big:
            bar.set_postfix_str("tuning", refresh=True)
        budgets = tuning.budgets(plan, ctx)
        decision_ms = (time.perf_counter() - t0) * 1e3
        # the shipped policies return Budget; a user's policy may return ints (checked here, once)
        budgets = tuple(tuple(Budget.of(b, f"{tuning.name} budgets[{r}][{j}]") for j, b in enumerate(row))
                        for r, row in enumerate(budgets))
        if big:
            bar.set_postfix_str(f"executing {len(batch):,} sequences", refresh=True)
        try:
            result = executor.execute(it, plan, budgets)
        except NonFiniteLoss as e:
            e.partial = _result(rows, traces, plans, all_budgets)
            raise
        for seq_id, curve in result.coverage.items():  # real gate scores feed the next floors
            ctx.coverage.observe(seq_id, curve)
        batching.observe(plan, budgets, result)
        tuning.observe(plan, budgets, result)
        flat_b = [b.mean() for r in budgets for b in r]
        covs = [ctx.coverage.microbatch_coverage(mb, budgets[r][j]) for r, j, mb in plan.microbatches()]
        rows.append({
            "iteration": it,
            "iteration_time_s": result.iteration_time_s,
            "imbalance": imbalance(result.microbatch_latency_s),
            "bubble_fraction": result.bubble_fraction,
            "decision_ms": decision_ms,
            "mean_budget": float(np.mean(flat_b)),
            "mean_coverage": float(np.mean(covs)),
            "tokens": sum(s.length for s in batch),
            "model_flops": model_flops(ctx.model, (s.length for s in batch)),
            **{f"tuning_{k}": v for k, v in tuning.stats.items()},
            **result.extra,
        })
        tr = result.trace
        if len(tr):
            traces.append(tr)
        plans.append(plan)
        all_budgets.append(budgets)
    return _result(rows, traces, plans, all_budgets)


def _result(rows: list[dict], traces: list[pd.DataFrame], plans: list[Plan],
            budgets: list[Budgets]) -> LoopResult:
    trace = pd.concat(traces, ignore_index=True) if traces else pd.DataFrame(columns=TRACE_COLUMNS)
    return LoopResult(metrics=pd.DataFrame(rows), trace=trace, plans=list(plans), budgets=list(budgets))
