"""``SimulatorExecutor``: the ``simulator.iteration.Executor`` that predicts an iteration with the SimPy engine.

Durations come from the latency model (docs/architecture.md): ``stage_times`` (its StageCost) per (virtual stage,
micro-batch) forward and backward (and, for a schedule that splits the backward, its input- and
weight-gradient parts), ``p2p_time`` of the micro-batch's tokens for every stage boundary,
``allreduce_time`` and ``optimizer_time`` per physical stage (with ``cluster.dp_overlap`` the
gradient synchronisation's exposed part, ``grad_sync_exposed``, overlapped with each device's last
backward action: the shortest over DP replicas, an upper bound on what is exposed). Every iteration also reports the peak
memory per device (``sparsebalance.simulator.engine.memory``): ``extra`` holds ``peak_memory_gb`` (the
largest device), ``peak_memory_gb_s<stage>`` (largest over DP ranks) and ``memory_exceeded`` (devices
over ``cluster.device_memory``). Imports no torch.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.errors import ConfigError, check_choice
from sparsebalance.simulator.config import DEFAULT_ENGINE, ENGINE_NAMES, ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.query import LatencyQuery
from sparsebalance.simulator.engine import PipelineInput, PipelineResult, simulate
from sparsebalance.simulator.engine.iteration import IterationResult
from sparsebalance.simulator.engine.memory import GB, MemoryReport, check_fits, memory_report
from sparsebalance.simulator.plan import Budget, Budgets, Plan
from sparsebalance.simulator.schedule.graph import schedule_graph
from sparsebalance.simulator.schedule.schedules import splits_backward
from sparsebalance.simulator.schedule.timing import kind_durations


class SimulatorExecutor:
    """Runs a plan + budgets through the cluster's schedule; seconds throughout."""

    name = "simulator"

    def __init__(self, latency: LatencyQuery, model: ModelConfig, cluster: ClusterConfig, *,
                 engine: str = DEFAULT_ENGINE) -> None:
        check_choice(engine, "engine", ENGINE_NAMES)
        self.engine = engine
        """The engine that times each iteration (``engine.ENGINES``)."""
        self.latency = latency
        self.model = model
        self.cluster = cluster
        self.last: PipelineResult | None = None
        """The engine's full result of the last ``execute`` (start/end arrays, per-device busy)."""
        self.last_memory: MemoryReport | None = None
        """Peak memory per device of the last ``execute`` (sparsebalance.simulator.engine.memory)."""
        check_fits(model, cluster)
        self._fixed = (
            np.array([latency.allreduce_time(s) for s in range(cluster.pp)], dtype=float),
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
        times = {mode: t.reshape(nv, dp, m).transpose(1, 0, 2) for mode, t in got.items()}
        return PipelineInput(schedule=c.schedule, pp=c.pp, virtual_stages=c.virtual_stages,
                             forward=times["F"], backward=times["B"], backward_input=times.get("I"),
                             backward_weight=times.get("W"), p2p=p2p, allreduce=self._grad_sync(times, m),
                             optimizer=self._fixed[1], tokens=tokens, budget=mean_budget,
                             iteration=iteration)

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
        return np.array([self.latency.grad_sync_exposed(s, w) for s, w in enumerate(window)], dtype=float)

    def _memory_tokens(self, plan: Plan, inp) -> np.ndarray:
        """[dp, m] tokens the memory model sees per micro-batch: the busiest CP rank's x cp (it
        divides by cp; the micro-batch's own tokens unless ``cp_split = "per-sequence"``)."""
        return np.array([self.latency.cp_tokens(mb.lengths, max(1, round(float(inp.budget[r, j]))))
                         for r, j, mb in plan.microbatches()], dtype=float).reshape(inp.tokens.shape)

    def _cp_figures(self, plan: Plan, mean_budget: np.ndarray) -> dict[str, float]:
        """Per iteration, over its micro-batches (mean): one layer's forward on the CP group --
        worker and step imbalance, exposed communication (s), ring efficiency
        (``cp.ring.combine``), each micro-batch at its mean budget."""
        from sparsebalance.simulator.cost.cp.ring import combine

        rows = []
        for r, j, mb in plan.microbatches():
            row = combine(self._cp_reports(mb, mean_budget[r, j], backward=False))
            placed = self.latency.cp_placement(mb.lengths, max(1, round(float(mean_budget[r, j]))))
            if placed is not None and placed.load.mean() > 0:  # per-sequence degrees: the group's ranks
                row["cp_worker_imbalance"] = float(placed.load.max() / placed.load.mean())
            rows.append(row)
        keys = ("cp_worker_imbalance", "cp_step_imbalance", "cp_exposed_s", "cp_efficiency")
        return {key: float(np.mean([row[key] for row in rows])) for key in keys}

    def _cp_reports(self, mb, mean_budget: float, *, backward: bool) -> list:
        """One layer of each of ``mb``'s sequences split over the CP group (``cp.ring.RingReport``),
        at the micro-batch's mean budget; sequences that stay whole on one rank have none."""
        k = max(1, round(float(mean_budget)))
        placed = self.latency.cp_placement(mb.lengths, k)
        degrees = [None] * len(mb.lengths) if placed is None else placed.degree.tolist()
        return [rep for L, d in zip(mb.lengths, degrees)
                if d != 1 and (rep := self.latency.cp_report(L, k, backward=backward, degree=d)) is not None]

    def _cp_rows(self, res, plan: Plan, mean_budget: np.ndarray):
        """Trace rows of each F and backward (B or I) action's CP attention: ``CP``, one per ring
        step, the step's slowest rank's compute, and ``CP_COMM``, one per transfer (a ring hop, the
        all-gather, dK/dV's hop home or reduce-scatter), its slowest rank's seconds; each summed
        over the micro-batch's sequences and the stage's layers. Drawn from the action's start (the
        dense parts are not drawn): the steps back to back after the first transfer (the
        all-gather; none in a ring), the hop bringing step s beside step s - 1, the last transfer
        after the last step; clipped to the action's end."""
        import pandas as pd

        from sparsebalance.simulator.engine.trace import TRACE_COLUMNS
        from sparsebalance.simulator.layout import layout_of

        lay = layout_of(self.model, self.cluster)
        n_layers, devices = lay.layer_counts, np.asarray(lay.devices)
        frames = []
        for kind in [k for k in res.kinds if k in ("F", "B", "I")]:
            ki = res.kinds.index(kind)
            per_mb = {}  # (r, j) -> ([S] step seconds, [S + 1] transfer seconds), summed over sequences, one layer
            for r, j, mb in plan.microbatches():
                reps = self._cp_reports(mb, mean_budget[r, j], backward=kind != "F")
                if reps:
                    width = max(rep.steps.shape[1] for rep in reps)
                    step, comm = np.zeros(width), np.zeros(width + 1)
                    for rep in reps:
                        n = rep.steps.shape[1]
                        step[:n] += rep.steps.max(axis=0)
                        comm[:n] += rep.transfers[:, :n].max(axis=0)
                        comm[-1] += rep.transfers[:, -1].max()
                    per_mb[(r, j)] = (step, comm)
            if not per_mb:
                continue
            width = max(len(v[0]) for v in per_mb.values())
            keys = list(per_mb)
            steps, comms = np.zeros((len(keys), width)), np.zeros((len(keys), width + 1))
            for i, key in enumerate(keys):
                step, comm = per_mb[key]
                steps[i, : len(step)] = step
                comms[i, : len(step)] = comm[:-1]
                comms[i, -1] = comm[-1]
            r_of = np.array([key[0] for key in keys])
            j_of = np.array([key[1] for key in keys])
            dur = steps[:, None, :] * n_layers[None, :, None]  # [mbs, V, S]
            xfer = comms[:, None, :] * n_layers[None, :, None]  # [mbs, V, S + 1]
            t_start = res.start[r_of, ki, :, j_of][..., None]  # [mbs, V, 1]
            t_end = res.end[r_of, ki, :, j_of][..., None]
            first = t_start + xfer[..., :1]  # step 0 starts once the first transfer is in
            c1 = first + np.cumsum(dur, axis=2)
            c0 = c1 - dur
            # transfer s (s >= 1) beside step s - 1; transfer 0 at the action's start; the last after the last step
            x0 = np.concatenate([t_start, c0[..., :-1], c1[..., -1:]], axis=2)
            x1 = x0 + xfer
            tokens = np.array([plan.ranks[r][j].tokens for r, j in keys])
            budget = np.array([float(max(1, round(float(mean_budget[r, j])))) for r, j in keys])  # as _cp_reports
            for op, a, b in (("CP", c0, c1), ("CP_COMM", x0, x1)):
                shape = a.shape
                real = (b - a > 0).ravel()  # padding (fewer steps; all-gather: one) and no-transfer slots dropped
                a, b = np.minimum(a, t_end), np.minimum(b, t_end)
                frames.append(pd.DataFrame({
                    "iteration": np.full(int(real.sum()), res.inp.iteration, dtype=np.int64),
                    "dp_rank": np.broadcast_to(r_of[:, None, None], shape).ravel()[real],
                    "stage": np.broadcast_to(devices[None, :, None], shape).ravel()[real],
                    "microbatch": np.broadcast_to(j_of[:, None, None], shape).ravel()[real],
                    "op": op, "start_s": a.ravel()[real], "end_s": b.ravel()[real],
                    "tokens": np.broadcast_to(tokens[:, None, None], shape).ravel()[real],
                    "budget": np.broadcast_to(budget[:, None, None], shape).ravel()[real]},
                    columns=list(TRACE_COLUMNS)))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(TRACE_COLUMNS))

    def execute(self, iteration: int, plan: Plan, budgets: Budgets) -> IterationResult:
        inp = self.build_input(iteration, plan, budgets)
        res = simulate(inp, method=self.engine)
        self.last = res
        mem = self.last_memory = memory_report(self.model, self.cluster, res.graph, self._memory_tokens(plan, inp))
        peak = mem.peak
        memory = {"peak_memory_gb": float(peak.max()) / GB, "memory_exceeded": float(mem.exceeded)}
        memory |= {f"peak_memory_gb_s{s}": float(v) / GB for s, v in enumerate(peak.max(axis=0))}
        if self.cluster.cp > 1:
            memory |= self._cp_figures(plan, inp.budget)
        trace = res.trace
        if self.cluster.cp > 1:
            import pandas as pd

            trace = pd.concat([trace, self._cp_rows(res, plan, inp.budget)], ignore_index=True)
        return IterationResult(
            iteration_time_s=res.iteration_time,
            trace=trace,
            microbatch_latency_s=res.microbatch_latency.tolist(),
            stage_busy_s=res.stage_busy.tolist(),
            bubble_fraction=res.bubble_fraction,
            extra={"stage_imbalance": res.stage_imbalance, "replica_imbalance": res.replica_imbalance,
                   **memory},
        )

