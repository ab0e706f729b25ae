"""Build a run from a RunConfig: data, latency model, coverage model, policies; run it in simulation.

Shared by the CLI verbs (commands/) and the real run (realrun/__main__.py), so realrun does not
import commands/. It knows data/, policies/ and simulator/, as loop.py does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sparsebalance.errors import ConfigError
from sparsebalance.loop import LoopResult, global_batches, run_loop
from sparsebalance.runconfig import RunConfig
from sparsebalance.simulator.cost.profile import Profile

if TYPE_CHECKING:
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.policies.base import BatchingPolicy, PolicyContext, TuningPolicy
    from sparsebalance.simulator.cost.latency import LatencyModel


@dataclass(slots=True)
class Prepared:
    """Everything one run of the loop needs, built from a RunConfig."""

    cfg: RunConfig
    sequences: list[Sequence]
    ctx: PolicyContext
    batching: BatchingPolicy
    tuning: TuningPolicy
    latency: LatencyModel


def prepare(cfg: RunConfig, *, profile: Profile | None = None, sequences: list | None = None) -> Prepared:
    """Load data, latency model, coverage model and policies for ``cfg`` (validates names first).
    ``profile``, where given, is the profile to run on instead of loading ``cfg.profile`` (a
    calibrated one, still in memory); ``sequences``, where given, the data already loaded
    (``load_sequences(cfg.data)``: a verb reads it before slow work, so bad data fails first)."""
    from sparsebalance.data import load_sequences
    from sparsebalance.policies.base import PolicyContext
    from sparsebalance.policies.coverage import make_coverage_model
    from sparsebalance.policies.registry import make_batching, make_tuning
    from sparsebalance.simulator.cost.memory import check_fits

    batching = make_batching(cfg.policy)
    tuning = make_tuning(cfg.policy)
    check_fits(cfg.model, cfg.cluster)  # needs no run: refused before any results directory exists
    if cfg.policy.token_cap is None and cfg.policy.slot_tokens is None:  # micro-batches per rank fixed
        from sparsebalance.simulator.schedule.schedules import validate_schedule

        c = cfg.cluster
        validate_schedule(c.schedule, c.pp, c.microbatches_per_rank, c.virtual_stages)
    latency = _latency(cfg, profile)
    if sequences is None:
        sequences = load_sequences(cfg.data, base_dir=cfg.base_dir)
    if len(sequences) < cfg.cluster.global_batch:
        raise ConfigError(f"data: {len(sequences)} sequence(s) cannot fill one global batch of "
                          f"cluster.global_batch = {cfg.cluster.global_batch}; give more data "
                          "(data.num_sequences, data.path) or lower cluster.global_batch")
    coverage = make_coverage_model(cfg.model, cfg.policy, seed=cfg.seed)
    ctx = PolicyContext(model=cfg.model, cluster=cfg.cluster, policy=cfg.policy, latency=latency,
                        coverage=coverage, rng=np.random.default_rng(cfg.seed))
    return Prepared(cfg=cfg, sequences=sequences, ctx=ctx, batching=batching, tuning=tuning,
                    latency=latency)


def check_inputs(cfgs, seen: set[str] | None = None) -> None:
    """:func:`prepare` once per distinct input of ``cfgs`` (profile, model, cluster, data but its
    seed), so that a verb running many configs refuses a bad profile or data file in one line before
    it creates its results directory. ``seen`` carries the inputs checked across calls."""
    import json
    from dataclasses import replace

    seen = set() if seen is None else seen
    for cfg in cfgs:
        key = json.dumps([cfg.profile, cfg.model, cfg.cluster, replace(cfg.data, seed=None)], default=str)
        if key not in seen:
            seen.add(key)
            prepare(cfg)


def _latency(cfg: RunConfig, profile: Profile | None = None):
    from sparsebalance.simulator.cost.latency import load_latency_model

    return load_latency_model(cfg.profile if profile is None else profile, cfg.model, cfg.cluster,
                              base_dir=cfg.base_dir, extrapolate=cfg.latency_extrapolate,
                              allow_nonmonotone=cfg.allow_nonmonotone)


def run_simulation(cfg: RunConfig, *, progress: bool = True, prepared: Prepared | None = None) -> LoopResult:
    """Run ``cfg.iterations`` simulated iterations of ``cfg``."""
    from sparsebalance.simulator.engine.executor import SimulatorExecutor

    p = prepared or prepare(cfg)
    executor = SimulatorExecutor(p.latency, cfg.model, cfg.cluster, engine=cfg.engine)
    batches = global_batches(p.sequences, cfg.cluster.global_batch, shuffle=cfg.data.shuffle,
                             rng=np.random.default_rng(cfg.data.seed))
    result = run_loop(batches=batches, batching=p.batching, tuning=p.tuning, executor=executor,
                      ctx=p.ctx, iterations=cfg.iterations, progress=progress)
    check_finite_metrics(result.metrics)
    warn_memory(result.metrics, cfg)
    return result


def warn_memory(metrics, cfg: RunConfig) -> None:
    """A MeaningWarning when some iteration's peak memory passes ``cluster.device_memory``: the plan
    would not run as simulated (the times assume it fits)."""
    if "memory_exceeded" not in metrics or cfg.cluster.device_memory is None:
        return
    over = metrics["memory_exceeded"] > 0
    if not over.any():
        return
    import warnings

    from sparsebalance.errors import MeaningWarning

    warnings.warn(f"memory: {int(over.sum())} of {len(metrics)} iteration(s) need up to "
                  f"{float(metrics.loc[over, 'peak_memory_gb'].max()):,.1f} GB on one device, above "
                  f"cluster.device_memory = {cfg.cluster.device_memory / 1e9:,.1f} GB: the plan cannot run "
                  "as simulated (see policy.memory_aware, policy.token_cap, cluster.recompute, cluster.dp_mode)",
                  MeaningWarning, stacklevel=3)


FINITE_METRICS = ("iteration_time_s", "imbalance", "bubble_fraction", "mean_budget", "mean_coverage",
                  "stage_imbalance", "replica_imbalance")
"""Per-iteration metrics that must be finite numbers (see :func:`check_finite_metrics`)."""


def check_finite_metrics(metrics) -> None:
    """ConfigError naming the first non-finite metric and its iteration."""
    from sparsebalance.errors import check_finite

    cols = [c for c in FINITE_METRICS if c in metrics]
    for row in metrics[["iteration", *cols]].itertuples(index=False):
        check_finite(dict(zip(cols, row[1:])), f"result of iteration {row[0]}")
