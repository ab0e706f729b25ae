"""Process groups, the model on each rank, and the two roles: rank 0's RealrunExecutor and followers.

Rank layout: global rank = dp_rank * pp + stage (see ``config.rank_layout``). Groups, created in the
same order on every rank: ``control`` (gloo, all ranks: plan broadcast and report gather, so objects
never touch NCCL), ``fwd`` / ``bwd`` (all ranks: activations and gradients, see p2p.py), ``dp`` (the
DP replicas of one stage: gradient all-reduce) and ``tied`` (first + last stage of a replica, for a
tied embedding).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from sparsebalance.realrun.config import RealrunConfig, global_rank, rank_layout


@dataclass(slots=True)
class Runtime:
    """One rank's view of the run."""

    rank: int
    world: int
    dp_rank: int
    stage: int
    cfg: Any
    rr: RealrunConfig
    groups: dict
    worker: Any


def init_runtime(cfg: Any, rr: RealrunConfig) -> Runtime:
    """Join the process group (torchrun env), build this rank's stage and worker."""
    import torch
    import torch.distributed as dist

    from sparsebalance.realrun.stage import build_stage_module
    from sparsebalance.realrun.worker import StageWorker

    pp, dp = cfg.cluster.pp, cfg.cluster.dp
    _cpu_setup(rr)
    torch.set_num_threads(rr.threads)
    timeout = timedelta(seconds=rr.timeout_s)
    if rr.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(rr.backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != pp * dp:
        raise RuntimeError(f"world size {world} != cluster.pp x cluster.dp = {pp * dp}; "
                           f"launch with --nproc-per-node {pp * dp} (or nodes x procs = {pp * dp})")
    dp_rank, stage = rank_layout(rank, pp)
    groups = {"world": None,
              "control": dist.new_group(backend="gloo", timeout=timeout),
              "fwd": dist.new_group(timeout=timeout),
              "bwd": dist.new_group(timeout=timeout)}
    for s in range(pp):
        g = dist.new_group([global_rank(r, s, pp) for r in range(dp)], timeout=timeout)
        if s == stage:
            groups["dp"] = g
    for r in range(dp):
        members = sorted({global_rank(r, 0, pp), global_rank(r, pp - 1, pp)})
        g = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
        if r == dp_rank:
            groups["tied"] = g
    # only this stage's weights are ever allocated here (a 7B model never lives whole on a rank)
    module = build_stage_module(cfg, rr, stage, pp, device)
    if rr.manual_gc:
        from sparsebalance.kernels.cpuclock import manual_gc

        manual_gc()
    dist.barrier()
    origin = time.perf_counter()  # one shared origin: every rank leaves the barrier together
    worker = StageWorker(rank=rank, dp_rank=dp_rank, stage=stage, pp=pp, dp=dp,
                         schedule=cfg.cluster.schedule, stage_module=module, rr=rr,
                         block_size=cfg.model.block_size, groups=groups, device=device, origin=origin)
    return Runtime(rank=rank, world=world, dp_rank=dp_rank, stage=stage, cfg=cfg, rr=rr,
                   groups=groups, worker=worker)


def _cpu_setup(rr: RealrunConfig) -> None:
    """CPU workers: one core each and a steady allocator (kernels/cpuclock.py), before torch starts
    any thread or allocates."""
    if rr.device != "cpu":
        return
    from sparsebalance.kernels.cpuclock import pin_to_core, steady_allocator

    if rr.pin_cores:
        pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    if rr.steady_allocator:
        steady_allocator()


def make_message(iteration: int, plan: Any, budgets: Any):
    from sparsebalance.realrun.worker import IterationMessage

    ranks = []
    for mbs in plan.ranks:
        row = []
        for mb in mbs:
            for s in mb.sequences:
                if s.tokens is None:
                    raise ValueError(f"sequence {s.id} has no tokens; realrun needs a token source")
            row.append([(int(s.id), np.asarray(s.tokens, dtype=np.int64)) for s in mb.sequences])
        ranks.append(row)
    label_tokens = sum(s.length - 1 for s in plan.sequences())
    return IterationMessage(iteration=iteration, ranks=ranks, budgets=[list(r) for r in budgets],
                            label_tokens=max(label_tokens, 1))


def _broadcast(rt: Runtime, obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=rt.groups["control"])
    return box[0]


def _gather(rt: Runtime, report: Any) -> list | None:
    import torch.distributed as dist

    out = [None] * rt.world if rt.rank == 0 else None
    dist.gather_object(report, out, dst=0, group=rt.groups["control"])
    return out


def follower_loop(rt: Runtime) -> None:
    """Ranks other than 0: run each broadcast iteration until rank 0 sends None."""
    while True:
        msg = _broadcast(rt, None)
        if msg is None:
            return
        _gather(rt, rt.worker.run(msg))


class RealrunExecutor:
    """``simulator.iteration.Executor`` on rank 0: broadcast (plan, budgets), run rank 0's share, gather every rank's
    trace rows, loss and measured coverage; feed the coverage to the policies' coverage model."""

    name = "realrun"

    def __init__(self, rt: Runtime, coverage_model: Any = None) -> None:
        self.rt, self.coverage_model = rt, coverage_model
        self.measured_coverage: dict[int, tuple[float, ...]] = {}
        """Every curve measured so far (seq id -> C(1..n_blocks)); written to measured_coverage.json."""

    def execute(self, iteration: int, plan: Any, budgets: Any):
        from sparsebalance.realrun.metrics import iteration_result

        msg = make_message(iteration, plan, budgets)
        _broadcast(self.rt, msg)
        reports = _gather(self.rt, self.rt.worker.run(msg))
        res = iteration_result(reports, pp=self.rt.cfg.cluster.pp, dp=self.rt.cfg.cluster.dp,
                               microbatches=plan.num_microbatches)
        self.measured_coverage.update(res.coverage)
        if self.coverage_model is not None:
            for sid, curve in res.coverage.items():
                self.coverage_model.observe(sid, curve)
        return res

    def close(self) -> None:
        _broadcast(self.rt, None)
