"""``sparsebalance accuracy``: does DST keep accuracy? The configuration grid and one run of it.

Every configuration continues training the shipped checkpoint for ``steps`` global batches of the
recall task, with the **same seeds, data order and step count** (the loop's seeded shuffle of the
same pool of examples), then is evaluated on the same held-out examples per length bucket with MoBA
at ``k0`` (MoBA's default: what a trained model is deployed with). Configurations:

* ``dense``: full attention (LBB batching), the accuracy ceiling;
* ``fixed``: MoBA at ``k0`` everywhere (LBB batching): the paper's baseline and the speedup reference;
* ``MEAN0.1`` ... ``MAX0.3``: SAB + DST with each anchor and each ``p``.

Budgets are chosen per micro-batch by the policy objects through ``loop.run_loop`` exactly as in a
real run: the virtual cluster is the paper's ablation node (Qwen2.5-3B, DP2 x PP4, global batch 16,
analytical H200 profile, 64K-token cap) on sequences scaled by ``scale`` (``executor.py``); DST's
coverage comes from the real gate scores of the tiny model (measured every step, fitted rate for
sequences not seen yet). ``sim_speedup`` = simulated iteration time of ``fixed`` / this config on
the same global batches (paired by seed).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from sparsebalance.errors import check, check_choice, check_positive
from sparsebalance.policies.config import ANCHORS, COVERAGE_AGGS

POOL_OFFSET = 10_000_000
"""Training ids of the continuation start here (pretraining used 0..): disjoint streams."""
POOL_STRIDE = 1_000_000
"""Each seed draws its pool of ids from its own range."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ExperimentConfig:
    """The accuracy experiment's knobs (``accuracy`` flags)."""

    steps: int = 96
    """Continuation steps (global batches of ``global_batch`` examples), the same for every config."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds: each draws its own pool of training examples and data order."""
    anchors: tuple[str, ...] = ANCHORS
    """DST anchors in the grid."""
    ps: tuple[float, ...] = (0.1, 0.2, 0.3)
    """DST coverage thresholds in the grid."""
    base: tuple[str, ...] = ("dense", "fixed")
    """Reference configurations run besides SAB + DST."""
    k0: int = 8
    """Default MoBA budget (blocks of 32 tokens; a quarter of the blocks at 1,024 tokens)."""
    lr: float = 1e-3
    """AdamW learning rate of the continuation (after a 10-step linear warm-up)."""
    pool: int = 1024
    """Training examples per seed; epochs reshuffle them (the policies see measured coverage of
    examples seen before, as in a multi-epoch run)."""
    buckets: tuple[int, ...] = (64, 256, 1024)
    """Held-out lengths (tokens); accuracy is reported per bucket."""
    heldout: int = 64
    """Held-out examples per bucket."""
    coverage_agg: str = "tokens"
    """Micro-batch coverage of packed sequences (tokens or min), see docs/coverage.md."""
    global_batch: int = 16
    """Examples per step (the paper's global batch)."""
    scale: int = 8
    """Tokens of the virtual model per token of the recall task (256 / 32: block counts match)."""
    token_cap: int = 65536
    """Packing cap of the virtual cluster (tokens after scaling)."""

    def __post_init__(self) -> None:
        for f in ("steps", "k0", "pool", "global_batch", "scale", "token_cap"):
            check_positive(getattr(self, f), f)
        check_positive(self.lr, "lr")
        check(math.isfinite(self.lr), "lr", f"must be a finite number > 0, got {self.lr!r}")
        check(len(self.seeds) > 0, "seeds", "give at least one seed")
        for a in self.anchors:
            check_choice(a, "anchors", ANCHORS)
        for p in self.ps:
            check(0.0 < p < 1.0, "p", f"must lie in (0, 1), got {p}")
        for b in self.base:
            check_choice(b, "base", ("dense", "fixed"))
        check(self.heldout >= 1, "heldout", f"a bucket needs held-out examples (>= 1), got {self.heldout}")
        check(len(self.buckets) > 0, "buckets", "give at least one bucket")
        check_choice(self.coverage_agg, "coverage_agg", COVERAGE_AGGS)
        check(self.pool >= self.global_batch, "pool",
              f"must be >= global_batch ({self.global_batch}), got {self.pool}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Job:
    """One configuration x seed."""

    config: str
    batching: str
    tuning: str
    anchor: str | None = None
    p: float | None = None
    k0: int = 8
    seed: int = 0
    extra: dict = field(default_factory=dict)


def grid(cfg: ExperimentConfig, dense_k: int) -> list[Job]:
    """Every job of the experiment, references first."""
    jobs = []
    for seed in cfg.seeds:
        if "dense" in cfg.base:
            jobs.append(Job(config="dense", batching="lbb", tuning="fixed", k0=dense_k, seed=seed))
        if "fixed" in cfg.base:
            jobs.append(Job(config="fixed", batching="lbb", tuning="fixed", k0=cfg.k0, seed=seed))
        jobs += [Job(config=f"{a.upper()}{p}", batching="sab", tuning="dst", anchor=a, p=p, k0=cfg.k0,
                     seed=seed) for a in cfg.anchors for p in cfg.ps]
    return jobs


def check_buckets(cfg: ExperimentConfig, task_cfg, max_positions: int) -> None:
    """Every bucket must have held-out examples that fit the task and the model's positions."""
    from sparsebalance.data.recall import min_length

    for b in cfg.buckets:
        check(b >= min_length(task_cfg.pairs), "buckets",
              f"bucket {b} has no held-out examples: a recall example with {task_cfg.pairs} pairs needs "
              f">= {min_length(task_cfg.pairs)} tokens")
        check(b <= max_positions, "buckets",
              f"bucket {b} is longer than the model's positions ({max_positions})")


def run_job(args: tuple[Job, ExperimentConfig, str | None]) -> dict[str, Any]:
    """Continue training the checkpoint under one configuration and evaluate it (worker process)."""
    import torch

    from sparsebalance.accuracy.executor import TrainExecutor, evaluate
    from sparsebalance.accuracy.model import load
    from sparsebalance.data.recall import RecallTask
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.loop import NonFiniteLoss, global_batches, run_loop
    from sparsebalance.policies.base import PolicyContext
    from sparsebalance.policies.config import PolicyConfig
    from sparsebalance.policies.coverage import make_coverage_model
    from sparsebalance.policies.registry import make_batching, make_tuning
    from sparsebalance.simulator.config import ClusterConfig, qwen25_3b
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.engine.executor import SimulatorExecutor

    job, cfg, ckpt_path = args
    torch.set_num_threads(1)
    ckpt = load(ckpt_path)
    model = ckpt.load_model()
    task = RecallTask(ckpt.task)
    big = qwen25_3b()
    check(big.block_size == cfg.scale * ckpt.net.dims.block_size, "scale",
          f"must be {big.block_size} / {ckpt.net.dims.block_size}, got {cfg.scale}")
    cluster = ClusterConfig(name="h200-1x8-dp2pp4", device="h200", dp=2, pp=4, tp=1,
                            global_batch=cfg.global_batch)
    policy = PolicyConfig(batching=job.batching, tuning=job.tuning, k0=job.k0,
                          k_max=max(job.k0, 64), anchor=job.anchor or "mean", p=job.p or 0.1,
                          token_cap=cfg.token_cap, coverage_rate=ckpt.meta["coverage_rate"],
                          coverage_agg=cfg.coverage_agg)
    latency = load_latency_model("analytical-h200", big, cluster)
    ctx = PolicyContext(model=big, cluster=cluster, policy=policy, latency=latency,
                        coverage=make_coverage_model(big, policy, seed=job.seed),
                        rng=np.random.default_rng(job.seed))
    ids = range(POOL_OFFSET + job.seed * POOL_STRIDE, POOL_OFFSET + job.seed * POOL_STRIDE + cfg.pool)
    seqs = [Sequence(id=i, length=task.train_length(i) * cfg.scale, sensitivity=1.0) for i in ids]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    ex = TrainExecutor(model, opt, task, SimulatorExecutor(latency, big, cluster), scale=cfg.scale,
                       block_size=ckpt.net.dims.block_size,
                       coverage_layer=int(ckpt.meta["coverage_layer"]), step_hook=sched.step)
    try:
        res = run_loop(batches=global_batches(seqs, cfg.global_batch, shuffle=True,
                                              rng=np.random.default_rng(job.seed)),
                       batching=make_batching(policy), tuning=make_tuning(policy), executor=ex,
                       ctx=ctx, iterations=cfg.steps, progress=False)
    except NonFiniteLoss as e:  # which run diverged: the jobs finished before it stay in jobs.jsonl
        raise NonFiniteLoss(f"accuracy run {job.config} seed {job.seed}: {e}") from None
    m = res.metrics
    acc = {b: evaluate(model, task.heldout(b, cfg.heldout), cfg.k0, ckpt.net.dims.block_size)
           for b in cfg.buckets}
    return {"job": asdict(job), "accuracy": acc, "mean_budget": float(m.mean_budget.mean()),
            "coverage": float(m.mean_coverage.mean()), "cpu_time_s": ex.cpu_time_s,
            "sim_time_s": float(m.iteration_time_s.sum()), "final_loss": float(m["loss"].tail(16).mean()),
            "floor_share": float(m["tuning_floor_share"].mean()) if "tuning_floor_share" in m else 0.0}


def rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tidy rows (one per config x seed x bucket) with ``sim_speedup`` paired by seed against
    ``fixed`` (NaN when fixed was not run)."""
    ref = {r["job"]["seed"]: r["sim_time_s"] for r in results if r["job"]["config"] == "fixed"}
    out = []
    for r in results:
        j = r["job"]
        base = ref.get(j["seed"])
        for b, a in r["accuracy"].items():
            out.append({"config": j["config"], "anchor": j["anchor"], "p": j["p"], "seed": j["seed"],
                        "bucket": int(b), "accuracy": a, "mean_budget": r["mean_budget"],
                        "coverage": r["coverage"], "cpu_time_s": r["cpu_time_s"],
                        "sim_speedup": base / r["sim_time_s"] if base else math.nan})
    return out


def quick(cfg: ExperimentConfig) -> ExperimentConfig:
    """``--quick``: fixed k0 and DST MEAN p = 0.1, one seed, a short continuation."""
    return replace(cfg, steps=min(cfg.steps, 24), seeds=cfg.seeds[:1], anchors=("mean",), ps=(0.1,),
                   base=("fixed",), heldout=min(cfg.heldout, 32), pool=min(cfg.pool, 256))


def to_json(rows_: list[dict[str, Any]]) -> str:
    return json.dumps([{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                       for r in rows_])
