"""``SimulatorExecutor``: the ``simulator.iteration.Executor`` that predicts an iteration with the SimPy engine.

Durations come from the latency model (docs/architecture.md): ``stage_time`` per (virtual stage,
micro-batch) forward and backward (and, for a schedule that splits the backward, its input- and
weight-gradient parts), ``p2p_time`` of the micro-batch's tokens for every stage boundary,
``allreduce_time`` and ``optimizer_time`` per physical stage. Every iteration also reports the peak
memory per device (``sparsebalance.simulator.memory``): ``extra`` holds ``peak_memory_gb`` (the
largest device), ``peak_memory_gb_s<stage>`` (largest over DP ranks) and ``memory_exceeded`` (devices
over ``cluster.device_memory``). Imports no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparsebalance.errors import ConfigError, check_choice
from sparsebalance.simulator.config import DEFAULT_ENGINE, ENGINE_NAMES, ClusterConfig, ModelConfig
from sparsebalance.simulator.engine import PipelineInput, PipelineResult, simulate
from sparsebalance.simulator.iteration import IterationResult
from sparsebalance.simulator.memory import GB, MemoryReport, check_fits, memory_report
from sparsebalance.simulator.plan import Budgets, Plan
from sparsebalance.simulator.schedules import splits_backward

_CACHE_LIMIT = 200_000
#: mode -> (backward, part of a split backward)
_MODES = {"F": (False, None), "B": (True, None), "I": (True, "input"), "W": (True, "weight")}


class SimulatorExecutor:
    """Runs a plan + budgets through the cluster's schedule; seconds throughout."""

    name = "simulator"

    def __init__(self, latency: Any, model: ModelConfig, cluster: ClusterConfig, *,
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
        """Peak memory per device of the last ``execute`` (sparsebalance.simulator.memory)."""
        check_fits(model, cluster)
        # (vstage, backward, lengths, budget) -> seconds; sequences recur across epochs and policies
        self._stage_cache: dict[tuple, float] = {}
        self._fixed = (
            np.array([latency.allreduce_time(s) for s in range(cluster.pp)], dtype=float),
            np.array([latency.optimizer_time(s) for s in range(cluster.pp)], dtype=float),
        )

    def _stage_time(self, vs: int, mode: str, lengths: tuple[int, ...], budget) -> float:
        key = (vs, mode, lengths, budget)
        hit = self._stage_cache.get(key)
        if hit is None:
            if len(self._stage_cache) > _CACHE_LIMIT:
                self._stage_cache.clear()
            pp = self.cluster.pp
            backward, part = _MODES[mode]
            kw = {"part": part} if part else {}
            hit = self._stage_cache[key] = float(self.latency.stage_time(
                lengths, budget, vs % pp, backward=backward, chunk=vs // pp, **kw))
        return hit

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
        p2p = np.array([self.latency.p2p_time(t) for t in tok], dtype=float).reshape(dp, 1, m)
        flat = [b for row in budgets for b in row]
        mean_budget = np.array([float(np.mean(b)) if isinstance(b, tuple) else float(b) for b in flat])
        mean_budget = mean_budget.reshape(dp, m)
        modes = ("F", "B", "I", "W") if splits_backward(c.schedule) else ("F", "B")
        if hasattr(self.latency, "attention_many") and all(type(b) is int for b in flat):
            times = self._stage_times_many(plan, np.array(flat, dtype=np.int64),
                                           np.array(tok, dtype=np.int64), modes)
        else:
            times = {mode: np.empty((dp, nv, m)) for mode in modes}
            for r, j, mb in plan.microbatches():
                for vs in range(nv):
                    for mode in modes:
                        times[mode][r, vs, j] = self._stage_time(vs, mode, mb.lengths, budgets[r][j])
        return PipelineInput(schedule=c.schedule, pp=c.pp, virtual_stages=c.virtual_stages,
                             forward=times["F"], backward=times["B"], backward_input=times.get("I"),
                             backward_weight=times.get("W"), p2p=p2p, allreduce=self._fixed[0],
                             optimizer=self._fixed[1], tokens=tokens, budget=mean_budget,
                             iteration=iteration)

    def _stage_times_many(self, plan: Plan, k: np.ndarray, tokens: np.ndarray,
                          modes=("F", "B")) -> dict[str, np.ndarray]:
        """Seconds [dp, V, m] of every (micro-batch, virtual stage) per mode (F, B and the split
        backward's I, W) at one int budget per micro-batch (``k`` in rank-major order):
        ``LatencyModel.stage_time``'s terms in its order (a stage's layers x the sum of its
        sequences' attention, + layers x dense, + embedding on the first and LM head on the last
        virtual stage), the attention in one vectorised call."""
        lm, c = self.latency, self.cluster
        dp, m = plan.dp, plan.num_microbatches
        nv = c.pp * c.virtual_stages
        mbs = [mb for _, _, mb in plan.microbatches()]
        counts = np.array([len(mb.sequences) for mb in mbs])
        lengths = np.fromiter((L for mb in mbs for L in mb.lengths), dtype=np.int64, count=int(counts.sum()))
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        n_layers = [len(r) for r in lm.layout.vstage_ranges]
        out = {}
        attn_of = {}
        for mode in modes:
            bw, part = _MODES[mode]
            if part == "weight":  # attention has no weights: none of its backward is W
                attn = np.zeros(len(mbs))
            elif bw in attn_of:
                attn = attn_of[bw]
            else:
                a = lm.attention_many(lengths, np.repeat(k, counts), backward=bw)
                attn = np.zeros(len(mbs))
                for p in range(int(counts.max())):  # left to right over a micro-batch's sequences
                    has = counts > p
                    attn[has] = attn[has] + a[starts[has] + p]
                attn_of[bw] = attn
            dense = _per_token(lm, "layer", lm.dense, tokens, bw, part)
            times = np.empty((nv, len(mbs)))
            for vs in range(nv):
                st = 0.0 + n_layers[vs] * attn
                st = st + n_layers[vs] * dense
                if vs == 0:
                    st = st + _per_token(lm, "embed", lm.embed, tokens, bw, part)
                if vs == nv - 1:
                    st = st + _per_token(lm, "head", lm.head, tokens, bw, part)
                times[vs] = st
            out[mode] = times.reshape(nv, dp, m).transpose(1, 0, 2)
        return out

    def execute(self, iteration: int, plan: Plan, budgets: Budgets) -> IterationResult:
        inp = self.build_input(iteration, plan, budgets)
        res = simulate(inp, method=self.engine)
        self.last = res
        mem = self.last_memory = memory_report(self.model, self.cluster, res.graph, inp.tokens)
        peak = mem.peak
        memory = {"peak_memory_gb": float(peak.max()) / GB, "memory_exceeded": float(mem.exceeded)}
        memory |= {f"peak_memory_gb_s{s}": float(v) / GB for s, v in enumerate(peak.max(axis=0))}
        return IterationResult(
            iteration_time_s=res.iteration_time,
            trace=res.trace,
            microbatch_latency_s=res.microbatch_latency.tolist(),
            stage_busy_s=res.stage_busy.tolist(),
            bubble_fraction=res.bubble_fraction,
            extra={"stage_imbalance": res.stage_imbalance, "replica_imbalance": res.replica_imbalance,
                   **memory},
        )


def _per_token(lm, op: str, scalar, tokens: np.ndarray, backward: bool, part: str | None = None) -> np.ndarray:
    """``op`` (layer, embed, head) at each token count, or that part of its backward: vectorised
    when the model offers it (``LatencyModel.per_token_many``)."""
    many = getattr(lm, "per_token_many", None)
    if many is not None:
        return many(op, tokens, backward=backward, part=part)
    kw = {"part": part} if part else {}
    return np.array([scalar(int(t), backward=backward, **kw) for t in tokens])
