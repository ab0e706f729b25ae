"""Process groups, the model on each rank, and the two roles: rank 0's RealrunExecutor and followers.

Rank layout: global rank = (dp_rank * pp + stage) * tp + tp_rank (see ``config.rank_layout``); with
context parallelism (tp = 1) the CP rank takes the TP rank's place: (dp_rank * pp + stage) * cp + cp_rank,
the simulator's mesh order dp x pp x cp x tp.
Groups, created in the same order on every rank: ``control`` (gloo, all ranks: plan broadcast and
report gather, so objects never touch NCCL), ``fwd`` / ``bwd`` (all ranks: activations and
gradients, see p2p.py), ``dp`` (the DP replicas of one stage and TP rank: gradient all-reduce),
``tied`` (the devices of the first and last virtual stage of a replica, same TP rank, for a tied
embedding) and, with tp > 1, the TP device mesh (``init_device_mesh`` over (dp x pp, tp); its "tp"
dimension is a stage's TP group, used by the DTensor plan of ``tp.py``; ``tp`` is its process group,
which also averages the coverage curves measured on each rank's heads) and, with replicated KV
heads, ``kv`` (the TP ranks of a stage sharing one KV head: their gradients summed).

Each rank builds one module per virtual stage the schedule places on its device (one, except for
interleaved 1F1B), then shards its decoder layers over the TP group.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
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
    tp_rank: int = 0


def init_runtime(cfg: Any, rr: RealrunConfig) -> Runtime:
    """Join the process group (torchrun env), build this rank's model chunks and worker."""
    import torch
    import torch.distributed as dist

    from sparsebalance.realrun.tp import kv_copies
    from sparsebalance.realrun.worker import StageWorker
    from sparsebalance.simulator.layout import placement

    c = cfg.cluster
    pp, dp, tp, cp = c.pp, c.dp, c.tp, c.cp
    # the innermost mesh coordinate: the TP rank, or with context parallelism (tp = 1) the CP rank
    lanes = cp if cp > 1 else tp
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
    need = pp * dp * lanes
    if world != need:
        raise RuntimeError(f"world size {world} != cluster.pp x cluster.dp x cluster.cp x cluster.tp = {need}; "
                           f"launch with --nproc-per-node {need} (or nodes x procs = {need})")
    dp_rank, stage, lane = rank_layout(rank, pp, lanes)
    tp_rank, cp_rank = (0, lane) if cp > 1 else (lane, 0)
    where = placement(c.schedule, pp, c.virtual_stages)
    groups = {"world": None,
              "control": dist.new_group(backend="gloo", timeout=timeout),
              "fwd": dist.new_group(timeout=timeout),
              "bwd": dist.new_group(timeout=timeout)}
    for s in range(pp):  # gradients are summed over the DP replicas (and the CP ranks) of a stage
        for t in range(tp):
            g = dist.new_group([global_rank(r, s, pp, lane_ if cp > 1 else t, lanes)
                                for r in range(dp) for lane_ in (range(cp) if cp > 1 else [t])], timeout=timeout)
            if (s, t) == (stage, tp_rank):
                groups["dp"] = g
    if cp > 1:  # the CP group of each (replica, stage): kernels/moba/cp.py, cp_ring.py
        for r in range(dp):
            for s in range(pp):
                g = dist.new_group([global_rank(r, s, pp, lane_, lanes) for lane_ in range(cp)], timeout=timeout)
                if (r, s) == (dp_rank, stage):
                    groups["cp"] = g
    for r in range(dp):
        for lane_ in range(lanes):
            members = sorted({global_rank(r, where[0], pp, lane_, lanes), global_rank(r, where[-1], pp, lane_, lanes)})
            g = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
            if (r, lane_) == (dp_rank, lane):
                groups["tied"] = g
    tp_mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        tp_mesh = init_device_mesh(device.type, (dp * pp, tp), mesh_dim_names=("replica_stage", "tp"))["tp"]
        groups["tp"] = tp_mesh.get_group()
        copies = kv_copies(cfg.model.kv_heads, tp)
        for d in range(dp):  # the TP ranks sharing one replicated KV head (tp.py)
            for s in range(pp):
                for h in range(tp // copies if copies > 1 else 0):
                    ranks = [global_rank(d, s, pp, t, tp) for t in range(h * copies, (h + 1) * copies)]
                    g = dist.new_group(ranks, timeout=timeout)
                    if (d, s, tp_rank // copies) == (dp_rank, stage, h):
                        groups["kv"] = g
    # only this device's chunks are ever allocated here (a 7B model never lives whole on a rank)
    chunks = {vs: build_chunk(cfg, rr, vs, device, tp_mesh)
              for vs in range(len(where)) if where[vs] == stage}
    if rr.manual_gc:
        from sparsebalance.kernels.cpuclock import manual_gc

        manual_gc()
    dist.barrier()
    origin = time.perf_counter()  # one shared origin: every rank leaves the barrier together
    worker = StageWorker(rank=rank, dp_rank=dp_rank, stage=stage, tp_rank=tp_rank, cp_rank=cp_rank, cluster=c,
                         chunks=chunks, rr=rr, model=cfg.model, groups=groups,
                         device=device, origin=origin)
    return Runtime(rank=rank, world=world, dp_rank=dp_rank, stage=stage, cfg=cfg, rr=rr,
                   groups=groups, worker=worker, tp_rank=tp_rank)


def build_chunk(cfg: Any, rr: RealrunConfig, vs: int, device: Any, tp_mesh: Any):
    """The module of virtual stage ``vs`` (its layers, + embedding on the first, + final norm, LM
    head and loss on the last), built alone (``stage.build_stage_module``: no other piece of the
    model is materialised), its decoder layers then sharded over ``tp_mesh`` when given."""
    from sparsebalance.realrun.stage import build_stage_module

    nv = cfg.cluster.pp * cfg.cluster.virtual_stages
    module = build_stage_module(cfg, rr, vs, nv, device)
    if tp_mesh is not None:
        from sparsebalance.realrun.tp import kv_copies, parallelize_layers, replicate_kv

        m, tp = cfg.model, cfg.cluster.tp
        if kv_copies(m.kv_heads, tp) > 1:
            replicate_kv(module.model.layers, m.kv_heads, m.head_dim, tp)
        parallelize_layers(module.model.layers, tp_mesh)
    module.warm_up()  # a compiled stage compiles here, before the shared origin and the timed iterations
    return module


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
    from sparsebalance.data.sequence import IGNORE_INDEX
    from sparsebalance.realrun.worker import IterationMessage

    ranks = []
    for mbs in plan.ranks:
        row = []
        for mb in mbs:
            for s in mb.sequences:
                if s.tokens is None:
                    raise ValueError(f"sequence {s.id} has no tokens; realrun needs a token source")
            row.append([(int(s.id), np.asarray(s.tokens, dtype=np.int64)) if s.labels is None else
                        (int(s.id), np.asarray(s.tokens, dtype=np.int64), np.asarray(s.labels, dtype=np.int64))
                        for s in mb.sequences])
        ranks.append(row)
    label_tokens = sum(s.length - 1 if s.labels is None else int((np.asarray(s.labels) != IGNORE_INDEX).sum())
                       for s in plan.sequences())
    return IterationMessage(iteration=iteration, ranks=ranks, budgets=[list(r) for r in budgets],
                            label_tokens=max(label_tokens, 1))


def broadcast_control(rt: Runtime, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a picklable message over the gloo control group)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=rt.groups["control"])
    return box[0]


def gather_control(rt: Runtime, report: Any) -> list | None:
    """Every rank's ``report`` on rank 0 (None elsewhere), over the gloo control group."""
    import torch.distributed as dist

    out = [None] * rt.world if rt.rank == 0 else None
    dist.gather_object(report, out, dst=0, group=rt.groups["control"])
    return out


def follower_loop(rt: Runtime, handle: Callable[[Any], None] | None = None) -> None:
    """Ranks other than 0: run each broadcast iteration until rank 0 sends None; then say this rank
    is done and meet rank 0 once more (:meth:`RealrunExecutor.close`). A message that is not an
    iteration is a caller's own (the accuracy experiment's arm switches and evaluations) and goes to
    ``handle``, which rank 0 runs on its side too."""
    from sparsebalance.realrun.worker import IterationMessage

    while True:
        msg = broadcast_control(rt, None)
        if msg is None:
            _farewell(rt)
            return
        if handle is not None and not isinstance(msg, IterationMessage):
            handle(msg)
            continue
        gather_control(rt, rt.worker.run(msg))


def _farewell(rt: Runtime) -> None:
    """Every rank's status says done before rank 0 goes on: when rank 0 then exits with an error (a
    diverged loss), torchrun's teardown of the other workers finds them finished, not mid-exit."""
    import torch.distributed as dist

    from sparsebalance.realrun.launch import worker_done

    if rt.rank != 0:
        worker_done()
    dist.barrier(group=rt.groups["control"])


class RealrunExecutor:
    """``simulator.engine.iteration.Executor`` on rank 0: broadcast (plan, budgets), run rank 0's share, gather every rank's
    trace rows, loss and measured coverage; feed the coverage to the policies' coverage model."""

    name = "realrun"

    def __init__(self, rt: Runtime, coverage_model: Any = None) -> None:
        self.rt, self.coverage_model = rt, coverage_model
        self.measured_coverage: dict[int, tuple[float, ...]] = {}
        """Every curve measured so far (seq id -> C(1..n_blocks)); written to measured_coverage.json."""

    def execute(self, iteration: int, plan: Any, budgets: Any):
        from sparsebalance.realrun.metrics import iteration_result

        msg = make_message(iteration, plan, budgets)
        broadcast_control(self.rt, msg)
        reports = gather_control(self.rt, self.rt.worker.run(msg))
        res = iteration_result(reports, pp=self.rt.cfg.cluster.pp, dp=self.rt.cfg.cluster.dp,
                               microbatches=plan.num_microbatches)
        check_reported_loss(iteration, reports, res.extra["loss"])
        self.measured_coverage.update(res.coverage)
        if self.coverage_model is not None:
            for sid, curve in res.coverage.items():
                self.coverage_model.observe(sid, curve)
        return res

    def close(self) -> None:
        """Release the followers and wait until each has recorded that it is done."""
        broadcast_control(self.rt, None)
        _farewell(self.rt)


def check_reported_loss(iteration: int, reports: list, loss: float) -> None:
    """NonFiniteLoss naming the iteration and the first rank and micro-batch whose loss was NaN or
    infinite. Raised after the gather: every rank has finished the iteration and waits for the next
    broadcast, so rank 0 can still release them (``close``) and write the iterations before it."""
    from sparsebalance.loop import check_loss

    bad = [r for r in reports if getattr(r, "nonfinite_microbatch", None) is not None]
    where = ""
    if bad:
        r = min(bad, key=lambda r: r.rank)
        where = (f" (rank {r.rank}: dp_rank {r.dp_rank}, stage {r.stage}, micro-batch "
                 f"{r.nonfinite_microbatch})")
    check_loss(loss if not bad else math.nan, iteration, where=where,
               hint="lower realrun.lr or set realrun.grad_clip")
