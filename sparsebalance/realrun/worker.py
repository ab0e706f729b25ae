"""What one rank does in one iteration: its stage's F/B actions in schedule order, the DP gradient
all-reduce after the pipeline flush, the optimizer step; every action timed into trace rows.

Loss: each micro-batch's summed next-token loss is divided by the label tokens of the *whole global
batch*, and DP replicas all-reduce gradients with SUM. The step is then the gradient of the global
batch's token-mean loss whatever the plan, so a pipelined, data-parallel run and a single process
running the same micro-batches take the same step (up to float summation order).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sparsebalance.realrun.config import RealrunConfig, global_rank


@dataclass(kw_only=True, slots=True)
class IterationMessage:
    """What rank 0 broadcasts per iteration (picklable, no torch)."""

    iteration: int
    ranks: list
    """[dp_rank][microbatch] -> list of (sequence id, int token array [length])."""
    budgets: list
    """[dp_rank][microbatch] -> budget (int or per-layer tuple)."""
    label_tokens: int
    """Labelled tokens of the whole global batch (sum of length - 1): the loss divisor."""


@dataclass(kw_only=True, slots=True)
class RankReport:
    """What each rank sends back to rank 0 after an iteration."""

    rank: int
    dp_rank: int
    stage: int
    rows: list = field(default_factory=list)
    """Trace rows (TRACE_COLUMNS order); times in seconds from the run's shared origin."""
    cpu: list = field(default_factory=list)
    """(index into ``rows``, (thread CPU s, of which system s, minor faults)) of each F/B row
    (kernels/cpuclock.py)."""
    loss: float = 0.0
    """Sum of this rank's micro-batch losses (non-zero on last stages only)."""
    coverage: dict = field(default_factory=dict)
    """seq id -> coverage curve (tuple) measured on this rank's coverage layer."""
    start_s: float = 0.0
    end_s: float = 0.0


class StageWorker:
    """One rank: (dp_rank, stage) of a PP x DP run."""

    def __init__(self, *, rank: int, dp_rank: int, stage: int, pp: int, dp: int, schedule: str,
                 stage_module: Any, rr: RealrunConfig, block_size: int, groups: dict, device: Any,
                 origin: float) -> None:
        import torch

        from sparsebalance.realrun.p2p import P2P

        self.rank, self.dp_rank, self.stage, self.pp, self.dp = rank, dp_rank, stage, pp, dp
        self.schedule, self.module, self.rr = schedule, stage_module, rr
        self.block_size, self.groups, self.device, self.origin = block_size, groups, device, origin
        self.params = [p for p in stage_module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=rr.lr, weight_decay=rr.weight_decay)
        self.p2p = P2P(fwd_group=groups["fwd"], bwd_group=groups["bwd"], device=device)
        lr = stage_module.layer_range
        self.coverage_here = rr.coverage_layer >= 0 and rr.coverage_layer in lr

    def now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.origin

    def run(self, msg: IterationMessage) -> RankReport:
        import torch
        import torch.distributed as dist

        from sparsebalance.kernels.cpuclock import thread_usage, usage_delta
        from sparsebalance.kernels.qwen2 import MobaArgs, pack
        from sparsebalance.simulator.schedules import stage_orders

        if self.rr.fail_rank == self.rank and self.rr.fail_iteration == msg.iteration:
            raise RuntimeError(f"injected fault (realrun.fail_rank = {self.rank})")
        it, s, d = msg.iteration, self.stage, self.dp_rank
        mbs = msg.ranks[d]
        order = stage_orders(self.schedule, self.pp, len(mbs))[s]
        rep = RankReport(rank=self.rank, dp_rank=d, stage=s)
        rows = rep.rows
        prev = global_rank(d, s - 1, self.pp) if s > 0 else None
        nxt = global_rank(d, s + 1, self.pp) if s < self.pp - 1 else None
        saved: dict[int, tuple[Any, Any]] = {}
        gated: list[tuple[list, Any]] = []  # (sequences, MobaArgs holding the coverage layer's q/k)
        self.opt.zero_grad(set_to_none=True)
        dist.barrier(group=self.groups["world"])
        rep.start_s = self.now()
        for op, _, j in order:
            seqs = mbs[j]
            tokens = sum(len(t) for _, t in seqs)
            budget = msg.budgets[d][j]
            brow = budget if isinstance(budget, int) else float(sum(budget) / len(budget))
            if op == "F":
                x = None
                if prev is not None:
                    t0 = self.now()
                    x = self.p2p.recv(prev, microbatch=j, grad=False).requires_grad_()
                    rows.append((it, d, s, j, "P2P", t0, self.now(), tokens, brow))
                t0, u0 = self.now(), thread_usage()
                batch = pack([t for _, t in seqs], device=self.device)
                moba = MobaArgs(cu_seqlens=batch.cu_seqlens, topk=budget, block_size=self.block_size,
                                backend=self.rr.attention_backend,
                                coverage_layer=self.rr.coverage_layer if self.coverage_here else None)
                out = self.module(x, batch, moba)
                if nxt is None:
                    out = out / msg.label_tokens
                t1 = self.now()
                rows.append((it, d, s, j, "F", t0, t1, tokens, brow))
                rep.cpu.append((len(rows) - 1, usage_delta(u0, thread_usage())))
                if nxt is not None:
                    self.p2p.send(out, nxt, microbatch=j, grad=False)
                else:
                    rep.loss += float(out.detach())
                saved[j] = (x, out)
                if self.coverage_here:
                    gated.append((seqs, moba))
            else:
                x, out = saved.pop(j)
                grad = None
                if nxt is not None:
                    t0 = self.now()
                    grad = self.p2p.recv(nxt, microbatch=j, grad=True)
                    rows.append((it, d, s, j, "P2P", t0, self.now(), tokens, brow))
                t0, u0 = self.now(), thread_usage()
                torch.autograd.backward(out, grad_tensors=grad)
                t1 = self.now()
                rows.append((it, d, s, j, "B", t0, t1, tokens, brow))
                rep.cpu.append((len(rows) - 1, usage_delta(u0, thread_usage())))
                if prev is not None:
                    self.p2p.send(x.grad, prev, microbatch=j, grad=True)
        self.p2p.wait_sends()
        t0 = self.now()
        self._allreduce()
        rows.append((it, d, s, -1, "ALLREDUCE", t0, self.now(), 0, 0))
        t0 = self.now()
        self._step()
        rep.end_s = self.now()
        rows.append((it, d, s, -1, "OPTIM", t0, rep.end_s, 0, 0))
        # DST's coverage from the kept gate inputs, after the iteration's end: it is measurement for
        # the tuning policy, not training work, and computed between F actions it would delay this
        # stage's next action (and the pipeline behind it) by time no trace row shows.
        for seqs, moba in gated:
            for (sid, _), curve in zip(seqs, moba.coverage_curves()):
                rep.coverage[int(sid)] = tuple(float(c) for c in curve)
        if self.rr.manual_gc:
            import gc

            gc.collect()  # between iterations, outside the timed one (kernels/cpuclock.py)
        return rep

    def _allreduce(self) -> None:
        """Sum gradients over the DP replicas of this stage (one flat buffer, one call), and over the
        first and last stage of a replica for a tied embedding."""
        import torch
        import torch.distributed as dist

        for p in self.params:
            if p.grad is None:  # a parameter unused by these micro-batches still joins the sum
                p.grad = torch.zeros_like(p)
        tied = self.module.tied_parameter()
        if tied is not None:
            dist.all_reduce(tied.grad, group=self.groups["tied"])
        if self.dp > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            dist.all_reduce(flat, group=self.groups["dp"])
            off = 0
            for p in self.params:
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n

    def _step(self) -> None:
        import torch
        import torch.distributed as dist

        if self.rr.grad_clip is not None:
            # after the DP sum every replica holds the same gradients: world sum = dp x global norm^2
            sq = torch.stack([p.grad.double().pow(2).sum() for p in self.params]).sum()
            tied = self.module.tied_parameter()
            if tied is not None and self.module.last:  # counted once, on the first stage
                sq = sq - tied.grad.double().pow(2).sum()
            dist.all_reduce(sq, group=self.groups["world"])
            norm = float(sq / self.dp) ** 0.5
            if norm > self.rr.grad_clip:
                for p in self.params:
                    p.grad.mul_(self.rr.grad_clip / (norm + 1e-6))
        self.opt.step()
