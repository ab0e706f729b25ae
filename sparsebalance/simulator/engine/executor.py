"""``SimulatorExecutor``: the ``engine.iteration.Executor`` that predicts an iteration with an engine (``engine.ENGINES``).

Durations come from the latency model (docs/architecture.md): ``stage_times`` (its StageCost) per (virtual stage,
micro-batch) forward and backward (and, for a schedule that splits the backward, its input- and
weight-gradient parts), ``p2p_time`` of the micro-batch's tokens for every stage boundary,
``allreduce_time`` and ``optimizer_time`` per physical stage (with ``cluster.dp_overlap`` the
gradient synchronisation's exposed part, ``grad_sync_exposed``, overlapped with each device's last
backward action: the shortest over DP replicas, an upper bound on what is exposed), + the tied
embedding's gradient all-reduce on the end stages under Megatron, and the pipeline implementation's
blocking sends and gradient-norm barrier (``cost.comm``: ``cluster.pp_impl``, ``grad_clip``). Every iteration also reports the peak
memory per device (``sparsebalance.simulator.cost.memory``): ``extra`` holds ``peak_memory_gb`` (the
largest device), ``peak_memory_gb_s<stage>`` (largest over DP ranks) and ``memory_exceeded`` (devices
over ``cluster.device_memory``). With context parallelism it adds the CP group's figures and its
CP / CP_COMM trace rows, which the CP home builds (``simulator/cost/cp/trace.py``). Imports no torch.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.errors import ConfigError, check_choice
from sparsebalance.simulator.config import (
    DEFAULT_ENGINE,
    ENGINE_NAMES,
    FSDP_MODES,
    ClusterConfig,
    ModelConfig,
)
from sparsebalance.simulator.cost.actioncalibration import ActionCalibration
from sparsebalance.simulator.cost.comm import embedding_allreduce_time, grad_norm_time, p2p_blocking
from sparsebalance.simulator.cost.cp import trace as cp_trace
from sparsebalance.simulator.cost.fsdp import FsdpPricing, fsdp_rows
from sparsebalance.simulator.cost.memory import GB, MemoryReport, check_fits, memory_report
from sparsebalance.simulator.cost.query import LatencyQuery
from sparsebalance.simulator.engine import PipelineInput, PipelineResult, simulate
from sparsebalance.simulator.engine.iteration import IterationResult
from sparsebalance.simulator.layout import layout_of
from sparsebalance.simulator.plan import Budget, Budgets, Plan
from sparsebalance.simulator.schedule.graph import schedule_graph
from sparsebalance.simulator.schedule.schedules import splits_backward
from sparsebalance.simulator.schedule.timing import kind_durations

LEAD_PASSES = 8
"""Engine passes that find how far ahead FSDP's early gathers ran (``FsdpPricing.leads``): the
first with them free, each next one with the leads of the one before, until they stop moving."""


class SimulatorExecutor:
    """Runs a plan + budgets through the cluster's schedule; seconds throughout."""

    name = "simulator"

    def __init__(self, latency: LatencyQuery, model: ModelConfig, cluster: ClusterConfig, *,
                 engine: str = DEFAULT_ENGINE, calibration: ActionCalibration | None = None) -> None:
        check_choice(engine, "engine", ENGINE_NAMES)
        self.engine = engine
        """The engine that times each iteration (``engine.ENGINES``)."""
        self.latency = latency
        self.calibration = calibration
        """A trainer probe's per-action lines and per-step constant (``cost/actioncalibration.py``), applied
        to every F and B action (after FSDP's collectives) and to every device's optimizer step; None: none."""
        self.model = model
        self.cluster = cluster
        self.last: PipelineResult | None = None
        """The engine's full result of the last ``execute`` (start/end arrays, per-device busy)."""
        self.last_memory: MemoryReport | None = None
        """Peak memory per device of the last ``execute`` (sparsebalance.simulator.cost.memory)."""
        check_fits(model, cluster)
        self.fsdp = (FsdpPricing(model, cluster, layout_of(model, cluster))
                     if cluster.dp_mode in FSDP_MODES else None)
        """Unit gathers and reduce-scatters added to every F and B action under zero2 / zero3."""
        self.compute: dict[str, np.ndarray] = {}
        """[dp, V, m] per mode: the actions' compute before the FSDP collectives (zero2 / zero3)."""
        self.leads: np.ndarray | None = None
        """[V, dp] how far ahead of its first forward each virtual stage was gathered (FSDP under a
        multi-stage torch or Llama 3 pipeline: ``FsdpPricing.leads``; NaN: not ahead), else None."""
        self._embedding = np.array([embedding_allreduce_time(model, cluster, s) for s in range(cluster.pp)])
        """[pp] seconds of the tied embedding's gradient all-reduce after each stage's DP reduction."""
        self._fixed = (
            np.array([latency.allreduce_time(s) for s in range(cluster.pp)], dtype=float) + self._embedding,
            np.array([latency.optimizer_time(s) for s in range(cluster.pp)], dtype=float),
        )

    def build_input(self, iteration: int, plan: Plan, budgets: Budgets) -> PipelineInput:
        """The engine input of one iteration (exposed for tests and the validate verb)."""
        c = self.cluster
        dp, m = plan.dp, plan.num_microbatches
        if dp != c.dp:
            raise ConfigError(f"plan: has {dp} DP ranks but cluster.dp = {c.dp}")
        if m < 1 or any(len(r) != m for r in plan.ranks):
            raise ConfigError(f"plan: every DP rank needs the same number (>= 1) of micro-batches, got "
                              f"{[len(r) for r in plan.ranks]}")
        if len(budgets) != dp or any(len(b) != m for b in budgets):
            raise ConfigError("budgets: shape must match the plan (one budget per micro-batch)")
        blocking = p2p_blocking(c)
        if blocking and c.schedule == "interleaved" and (m % c.pp or m <= c.pp):
            raise ConfigError(f"cluster.pp_impl: 'megatron-2022' blocks the interleaved schedule as Megatron 2022 "
                              f"runs it, with micro-batches per rank a multiple of pp ({c.pp}) and more than pp; "
                              f"got {m} (use pp_impl = \"megatron\" or \"ideal\")")
        nv = c.pp * c.virtual_stages
        tok = [mb.tokens for _, _, mb in plan.microbatches()]
        tokens = np.array(tok, dtype=float).reshape(dp, m)
        # a policy's budgets are Budget already; ints and per-layer lists built by hand become one here
        flat = [Budget.of(b, f"budgets[{r}][{j}]") for r, row in enumerate(budgets) for j, b in enumerate(row)]
        # each CP rank sends its own share: the busiest rank's tokens (all of them / cp unless cp_split
        # is per-sequence)
        p2p = np.array([self.latency.p2p_time(self.latency.cp_tokens(mb.lengths, b))
                        for (_, _, mb), b in zip(plan.microbatches(), flat)], dtype=float).reshape(dp, 1, m)
        mean_budget = np.array([b.mean() for b in flat])
        mean_budget = mean_budget.reshape(dp, m)
        modes = ("F", "B", "I", "W") if splits_backward(c.schedule) else ("F", "B")
        # [V, dp * m] per mode from the latency model's one stage cost (simulator/cost/stagecost.py)
        got = self.latency.stage_times([mb.lengths for _, _, mb in plan.microbatches()], flat, modes)
        self.leads = None
        if self.fsdp is not None:  # each action's unit gathers and reduce-scatters (cost/fsdp.py)
            self.compute = {mode: t.reshape(nv, dp, m).transpose(1, 0, 2) for mode, t in got.items()}
            if self.fsdp.ahead:  # gathered from the step's start: how far ahead of each first forward
                leads = np.full((nv, dp), np.nan)
                leads[sorted(self.fsdp.ahead_vstages())] = np.inf  # the first pass: those gathers free
                for _ in range(LEAD_PASSES):  # the forwards' starts, and from them the leads, to a fixed point
                    trial = self._input(self._priced(got, m, leads), p2p, m, tokens, mean_budget, iteration, blocking)
                    new = self.fsdp.leads(simulate(trial).forward_start)
                    done = np.allclose(new, leads, rtol=0.0, atol=1e-12, equal_nan=True)
                    leads = new
                    if done:
                        break
                self.leads = leads
            got = self._priced(got, m, self.leads)
        inp = self._input(got, p2p, m, tokens, mean_budget, iteration, blocking)
        if self.fsdp is not None and self.fsdp.background:  # the step's end waits for the reduce-scatters
            res = simulate(inp)
            inp.allreduce = inp.allreduce + self.fsdp.tail_exposed(
                res.backward_start[:, :, m - 1], res.backward_end[:, :, m - 1], res.stage_finish)
        return inp

    def _priced(self, got: dict[str, np.ndarray], m: int, leads: np.ndarray | None) -> dict[str, np.ndarray]:
        """[V, dp x m] seconds per mode of every action with its FSDP collectives (``leads``: how
        far ahead each virtual stage's first forward was gathered, ``FsdpPricing.leads``)."""
        assert self.fsdp is not None
        return {mode: self.fsdp.actions(t, m, backward=mode != "F", leads=leads if mode == "F" else None)
                for mode, t in got.items()}

    def _input(self, times, p2p, m, tokens, mean_budget, iteration, blocking) -> PipelineInput:
        """The engine input from per-mode action seconds ``times`` [V, dp x m] (columns replica-major),
        with the calibration and the end-of-step terms."""
        c = self.cluster
        nv = c.pp * c.virtual_stages
        times = {mode: t.reshape(nv, -1, m).transpose(1, 0, 2) for mode, t in times.items()}
        if self.calibration is not None:
            times = self.calibration.apply(times, layout_of(self.model, c).devices)
        return PipelineInput(schedule=c.schedule, pp=c.pp, virtual_stages=c.virtual_stages,
                             forward=times["F"], backward=times["B"], backward_input=times.get("I"),
                             backward_weight=times.get("W"), p2p=p2p, allreduce=self._grad_sync(times, m),
                             optimizer=self._optimizer(times), tokens=tokens, budget=mean_budget,
                             iteration=iteration, p2p_blocking=blocking, grad_norm=grad_norm_time(c))

    def _grad_sync(self, times: dict[str, np.ndarray], m: int) -> np.ndarray:
        """[pp] seconds of gradient synchronisation after each device's last action: all of it, or
        with ``dp_overlap`` what its last backward action (the shortest over replicas) leaves."""
        c = self.cluster
        if not (c.dp_overlap and c.dp > 1):
            return self._fixed[0]
        g = schedule_graph(c.schedule, c.pp, m, c.virtual_stages)
        nv = c.pp * c.virtual_stages
        kind, rest = np.divmod(np.asarray(g.last), nv * m)
        vs, j = np.divmod(rest, m)
        per_kind = kind_durations(g, times["F"], times["B"], times.get("I"), times.get("W"))  # as the engine runs them
        window = [float(per_kind[g.kinds[k]][:, v, i].min()) for k, v, i in zip(kind, vs, j)]
        return np.array([self.latency.grad_sync_exposed(s, w) for s, w in enumerate(window)], dtype=float) + self._embedding

    def _optimizer(self, times: dict[str, np.ndarray]) -> np.ndarray:
        """[pp] seconds of each device's optimizer step, + with ``param_gather_overlap`` what ZeRO-1's
        parameter gather leaves exposed under the device's first forward action (the shortest over
        replicas; steady state: this iteration's stands for the next one's)."""
        c = self.cluster
        step = 0.0 if self.calibration is None else self.calibration.step_s
        if not (c.zero1 and c.param_gather_overlap):
            return np.maximum(self._fixed[1] + step, 0.0)
        lay = layout_of(self.model, c)
        window = [float(times["F"][:, lay.vstages_of(s)[0], 0].min()) for s in range(c.pp)]
        return np.maximum(self._fixed[1] + step + np.array([self.latency.param_gather_exposed(s, w)
                                                            for s, w in enumerate(window)]), 0.0)

    def _memory_tokens(self, plan: Plan, inp) -> np.ndarray:
        """[dp, m] tokens the memory model sees per micro-batch: the busiest CP rank's x cp (it
        divides by cp; the micro-batch's own tokens unless ``cp_split = "per-sequence"``)."""
        return np.array([self.latency.cp_tokens(mb.lengths, max(1, round(float(inp.budget[r, j]))))
                         for r, j, mb in plan.microbatches()], dtype=float).reshape(inp.tokens.shape)

    def execute(self, iteration: int, plan: Plan, budgets: Budgets) -> IterationResult:
        inp = self.build_input(iteration, plan, budgets)
        res = simulate(inp, method=self.engine)
        self.last = res
        mem = self.last_memory = memory_report(self.model, self.cluster, res.graph, self._memory_tokens(plan, inp))
        peak = mem.peak
        memory = {"peak_memory_gb": float(peak.max()) / GB, "memory_exceeded": float(mem.exceeded)}
        memory |= {f"peak_memory_gb_s{s}": float(v) / GB for s, v in enumerate(peak.max(axis=0))}
        trace = res.trace
        if self.cluster.cp > 1:
            assert inp.budget is not None  # build_input sets it  # the CP group inside each action: its figures and trace rows (cost/cp/trace.py)
            import pandas as pd

            from sparsebalance.simulator.engine.trace import TRACE_COLUMNS

            memory |= cp_trace.figures(self.latency, plan, inp.budget)
            rows = cp_trace.rows(self.latency, layout_of(self.model, self.cluster), plan, inp.budget,
                                 kinds=list(res.kinds), start=res.start, end=res.end, iteration=res.inp.iteration,
                                 columns=TRACE_COLUMNS)
            trace = pd.concat([trace, rows], ignore_index=True)
        if self.fsdp is not None:
            assert inp.budget is not None  # build_input sets it
            import pandas as pd

            from sparsebalance.simulator.engine.trace import TRACE_COLUMNS

            rows = fsdp_rows(self.fsdp, self.compute, layout_of(self.model, self.cluster), plan, inp.budget,
                             kinds=list(res.kinds), start=res.start, end=res.end, iteration=res.inp.iteration,
                             columns=TRACE_COLUMNS, leads=self.leads)
            trace = pd.concat([trace, rows], ignore_index=True)
        return IterationResult(
            iteration_time_s=res.iteration_time,
            trace=trace,
            microbatch_latency_s=res.microbatch_latency.tolist(),
            stage_busy_s=res.stage_busy.tolist(),
            bubble_fraction=res.bubble_fraction,
            extra={"stage_imbalance": res.stage_imbalance, "replica_imbalance": res.replica_imbalance,
                   **memory},
        )

