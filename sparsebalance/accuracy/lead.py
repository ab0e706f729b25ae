"""Rank 0 of the measured accuracy experiment (``pipeline.py``): the run, the arms, the records.

:func:`run_setup` builds what every rank needs from the spec: the run config realrun's
``init_runtime`` takes (tiny Qwen2, PP 2 x DP 1, 1F1B, gloo on the CPU, one thread and core per
worker, weights from the checkpoint's Hugging Face export) and the checkpoint. :func:`lead` runs the
arms' iterations interleaved and the held-out evaluation, writing one JSON line per record.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

CLUSTER = {"name": "cpu-pp2", "device": "cpu", "pp": 2, "dp": 1, "schedule": "1f1b",
           "p2p_bandwidth": 2e9, "p2p_latency": 50e-6, "allreduce_bandwidth": 2e9, "allreduce_latency": 50e-6}
"""The real run's PP 2 plan on this CPU (examples/cpu_pp2.toml's cluster): one worker per core."""


def run_config(spec: dict, cfg: Any) -> Any:
    """The RunConfig of one seed's launch (model, cluster, realrun options; data come from the task)."""
    from sparsebalance.runconfig import RunConfig
    from sparsebalance.simulator.config import ClusterConfig, tiny

    cluster = ClusterConfig(**CLUSTER, global_batch=cfg.global_batch)
    rr = {"backend": "gloo", "device": "cpu", "threads": 1, "timeout_s": cfg.timeout_s, "lr": cfg.lr,
          "grad_clip": 1.0, "coverage_layer": spec["coverage_layer"], "checkpoint": spec["hf_dir"],
          "score_labels": True}
    return RunConfig(name=f"accuracy-seed{spec['seed']}", seed=spec["seed"], profile=cfg.profile, model=tiny(),
                     cluster=cluster, realrun=rr, allow_nonmonotone=True)


def experiment(spec: dict) -> Any:
    from sparsebalance.accuracy.measured import MeasuredConfig
    from sparsebalance.configmap import from_mapping

    return from_mapping(MeasuredConfig, spec["experiment"], "experiment")


def setup(spec: dict) -> tuple[Any, Any, Any]:
    """(the runtime of this rank, the checkpoint, the MeasuredConfig)."""
    from sparsebalance.accuracy.model import load
    from sparsebalance.realrun.config import RealrunConfig
    from sparsebalance.realrun.runtime import init_runtime

    cfg = experiment(spec)
    ckpt = load(spec["checkpoint"])
    run = run_config(spec, cfg)
    rt = init_runtime(run, RealrunConfig(**run.realrun))
    return rt, ckpt, cfg


def training_pool(task: Any, cfg: Any, seed: int) -> list:
    """The seed's training sequences: ids from its own range, tokens and answer-only labels."""
    from sparsebalance.accuracy.measured import POOL_OFFSET, POOL_STRIDE
    from sparsebalance.data.recall import TRAIN
    from sparsebalance.data.sequence import Sequence

    out = []
    for i in range(POOL_OFFSET + seed * POOL_STRIDE, POOL_OFFSET + seed * POOL_STRIDE + cfg.pool):
        ex = task.example(TRAIN, i, task.train_length(i))
        out.append(Sequence(id=i, length=len(ex.tokens), tokens=ex.tokens, labels=ex.labels, sensitivity=1.0))
    return out


def lr_schedule(cfg: Any):
    """Learning rate of an arm's iteration ``i``: linear warm-up over ``cfg.warmup`` iterations."""
    return lambda i: cfg.lr * min(1.0, (i + 1) / cfg.warmup) if cfg.warmup else cfg.lr


def lead(rt: Any, spec: dict, cfg: Any, ckpt: Any, handler: Any, out: Path, *, progress: bool) -> None:
    """Rank 0: every arm's iterations, interleaved, then every arm's held-out accuracy; then release
    the other ranks."""
    from sparsebalance.accuracy.arms import ArmExecutor
    from sparsebalance.accuracy.measured import Arm
    from sparsebalance.data.recall import RecallTask
    from sparsebalance.loop import global_batches, run_loop
    from sparsebalance.policies.base import PolicyContext
    from sparsebalance.policies.config import PolicyConfig
    from sparsebalance.policies.coverage import make_coverage_model
    from sparsebalance.policies.registry import make_batching, make_tuning
    from sparsebalance.realrun.runtime import RealrunExecutor, broadcast_control
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.engine.executor import SimulatorExecutor

    def control(msg: tuple) -> None:
        broadcast_control(rt, msg)
        handler(msg)

    seed, run = spec["seed"], rt.cfg
    model, cluster = run.model, run.cluster
    seqs = training_pool(RecallTask(ckpt.task), cfg, seed)
    latency = load_latency_model(cfg.profile, model, cluster, allow_nonmonotone=True)
    arms, lr_at = [Arm(**a) for a in spec["arms"]], lr_schedule(cfg)
    runs = []
    for i, arm in enumerate(arms):
        policy = PolicyConfig(**arm.policy_fields(cfg, spec["coverage_rate"]))
        ctx = PolicyContext(model=model, cluster=cluster, policy=policy, latency=latency,
                            coverage=make_coverage_model(model, policy, seed=seed), rng=np.random.default_rng(seed))
        ex = ArmExecutor(i, control, RealrunExecutor(rt, ctx.coverage), SimulatorExecutor(latency, model, cluster), lr_at)
        runs.append({"arm": arm, "ctx": ctx, "batching": make_batching(policy), "tuning": make_tuning(policy),
                     "executor": ex, "batches": global_batches(seqs, cfg.global_batch, shuffle=True,
                                                               rng=np.random.default_rng(seed)),
                     "plans": [], "budgets": []})
    order_rng = np.random.default_rng([seed, 38])
    t0 = time.time()
    with (out / "iterations.jsonl").open("w") as f:
        for it in range(cfg.iterations):
            for pos, i in enumerate(order_rng.permutation(len(runs)).tolist()):
                r = runs[i]
                res = run_loop(batches=r["batches"], batching=r["batching"], tuning=r["tuning"],
                               executor=r["executor"], ctx=r["ctx"], iterations=1, progress=False)
                r["plans"] += res.plans
                r["budgets"] += res.budgets
                row = {k: _plain(v) for k, v in res.metrics.iloc[0].to_dict().items()}
                row |= {"arm": r["arm"].name, "seed": seed, "iteration": it, "order": pos}
                f.write(json.dumps(row) + "\n")
                f.flush()
            if progress:
                # stdout: the launcher copies it to the console (the workers' stderr goes to launch.log)
                print(f"accuracy seed {seed}: iteration {it + 1}/{cfg.iterations} of {len(runs)} arms "
                      f"({time.time() - t0:.0f} s)", flush=True)
    from sparsebalance.realrun.results import plans_to_json

    (out / "plans").mkdir(exist_ok=True)
    for r in runs:  # every arm's plans and budgets, for replays (realrun's plans.json format)
        (out / "plans" / f"{r['arm'].name}.json").write_text(json.dumps(plans_to_json(r["plans"], r["budgets"])))
    with (out / "heldout.jsonl").open("w") as f:
        for i, r in enumerate(runs):
            control(("eval", i))
            for b in cfg.buckets:
                right = sum(part[b][0] for part in handler.last)
                total = sum(part[b][1] for part in handler.last)
                f.write(json.dumps({"arm": r["arm"].name, "seed": seed, "bucket": b, "right": right,
                                    "total": total}) + "\n")
            f.flush()
        if progress:
            print(f"accuracy seed {seed}: held-out accuracy of {len(runs)} arms ({time.time() - t0:.0f} s)",
                  flush=True)
    runs[0]["executor"].real.close()


def _plain(v: Any) -> Any:
    """A JSON-safe scalar (numpy numbers to Python, NaN to None)."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
