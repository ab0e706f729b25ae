"""What one rank does in one iteration: its device's F/B (or F/I/W) actions in schedule order over
its model chunks (``chunks.py``), the DP gradient all-reduce after the pipeline flush, the optimizer
step; every action timed into trace rows.

Loss: each micro-batch's summed next-token loss is divided by the label tokens of the *whole global
batch*, and DP replicas all-reduce gradients with SUM. The step is then the gradient of the global
batch's token-mean loss whatever the plan, so a pipelined, data-parallel run and a single process
running the same micro-batches take the same step (up to float summation order).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sparsebalance.realrun.config import RealrunConfig, global_rank


@dataclass(kw_only=True, slots=True)
class IterationMessage:
    """What rank 0 broadcasts per iteration (picklable, no torch)."""

    iteration: int
    ranks: list
    """[dp_rank][microbatch] -> list of (sequence id, int token array [length]), or of (sequence id,
    tokens, int label array [length]) where the data names its labels (``Sequence.labels``)."""
    budgets: list
    """[dp_rank][microbatch] -> :class:`~sparsebalance.simulator.budget.Budget`."""
    label_tokens: int
    """Labelled tokens of the whole global batch (sum of length - 1, or of the given labels): the
    loss divisor."""


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
    hits: tuple = (0, 0)
    """(labels predicted exactly, labels) over this rank's last-stage forwards (``realrun.score_labels``)."""
    nonfinite_microbatch: int | None = None
    """The first micro-batch whose loss was NaN or infinite (rank 0 stops the run naming it)."""
    coverage: dict = field(default_factory=dict)
    """seq id -> coverage curve (tuple) measured on this rank's coverage layer."""
    start_s: float = 0.0
    end_s: float = 0.0


class StageWorker:
    """One rank: (dp_rank, stage, tp_rank or cp_rank) of a PP x DP x (CP x) TP run, with its model chunks."""

    def __init__(self, *, rank: int, dp_rank: int, stage: int, tp_rank: int = 0, cp_rank: int = 0, cluster: Any,
                 chunks: dict, rr: RealrunConfig, model: Any, groups: dict, device: Any,
                 origin: float) -> None:
        import torch

        from sparsebalance.realrun.p2p import P2P
        from sparsebalance.realrun.tp import kv_copies, replicated_kv_params
        from sparsebalance.simulator.layout import placement

        c = cluster
        self.rank, self.dp_rank, self.stage, self.tp_rank = rank, dp_rank, stage, tp_rank
        self.pp, self.dp, self.tp = c.pp, c.dp, c.tp
        self.cp, self.cp_rank, self.cp_layout, self.cp_comm = c.cp, cp_rank, c.cp_layout, c.cp_comm
        self.lane, self.lanes = (cp_rank, c.cp) if c.cp > 1 else (tp_rank, c.tp)
        """The innermost mesh coordinate and its size: the TP rank, or the CP rank (tp = 1)."""
        self.schedule, self.virtual_stages = c.schedule, c.virtual_stages
        self.placement = placement(c.schedule, c.pp, c.virtual_stages)
        self.chunks, self.rr = chunks, rr
        self.block_size, self.groups, self.device, self.origin = model.block_size, groups, device, origin
        self.model_cfg = model
        self.kv_r = kv_copies(model.kv_heads, c.tp)
        """Ranks sharing a KV head (1: KV heads split, ``tp.py``)."""
        self.kv_params = ([p for mod in chunks.values() for p in replicated_kv_params(mod.model.layers)]
                          if self.kv_r > 1 else [])
        self.params = [p for mod in chunks.values() for p in mod.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=rr.lr, weight_decay=rr.weight_decay)
        self.p2p = P2P(fwd_group=groups["fwd"], bwd_group=groups["bwd"], device=device)
        for mod in chunks.values():
            mod.score = rr.score_labels and mod.last
        self.coverage_vs = next((vs for vs, mod in chunks.items()
                                 if rr.coverage_layer >= 0 and rr.coverage_layer in mod.layer_range), None)

    def now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.origin

    def run(self, msg: IterationMessage) -> RankReport:
        from contextlib import nullcontext

        import torch.distributed as dist

        from sparsebalance.kernels.cpuclock import thread_usage, usage_delta
        from sparsebalance.kernels.moba.cp import CPContext
        from sparsebalance.kernels.moba.cp import recording as cp_recording
        from sparsebalance.kernels.qwen2 import MobaArgs, pack
        from sparsebalance.realrun.chunks import DeviceActions, Route
        from sparsebalance.simulator.schedule.schedules import stage_orders

        if self.rr.fail_rank == self.rank and self.rr.fail_iteration == msg.iteration:
            raise RuntimeError(f"injected fault (realrun.fail_rank = {self.rank})")
        it, s, d = msg.iteration, self.stage, self.dp_rank
        mbs = msg.ranks[d]
        m = len(mbs)
        order = stage_orders(self.schedule, self.pp, m, self.virtual_stages)[s]
        rep = RankReport(rank=self.rank, dp_rank=d, stage=s)
        report = self.tp_rank == 0 and self.cp_rank == 0  # TP peers compute the same values; CP: see loss
        route = Route(placement=self.placement, me=s,
                      rank_of=lambda dev: global_rank(d, dev, self.pp, self.lane, self.lanes))
        cp_loss = 0.0  # with CP every rank's share of the loss, summed over the CP group below
        acts = DeviceActions(chunks=self.chunks, route=route, p2p=self.p2p, m=m, now=self.now)
        split = any(k in ("I", "W") for k, _, _ in order)
        batches: dict[int, Any] = {}
        gated: list[tuple[list, Any]] = []  # (sequences, MobaArgs holding the coverage layer's q/k)
        self.opt.zero_grad(set_to_none=True)
        dist.barrier(group=self.groups["world"])
        rep.start_s = self.now()
        for kind, vs, j in order:
            seqs = mbs[j]
            tokens = sum(len(x[1]) for x in seqs)
            budget = msg.budgets[d][j]
            brow = budget.value if budget.is_uniform else budget.mean()

            def row(op: str, t0: float, t1: float, u0: tuple | None = None, j=j, tokens=tokens,
                    brow=brow) -> None:
                """A trace row; ``u0``: the thread's usage at t0 for compute rows (CPU columns)."""
                if report:
                    rep.rows.append((it, d, s, j, op, t0, t1, tokens, brow))
                    if u0 is not None:
                        rep.cpu.append((len(rep.rows) - 1, usage_delta(u0, thread_usage())))

            # CP collectives inside the action (its attention's gathers, hops, gradients' way back):
            # CP_COMM rows, timed where they run (kernels/moba/cp.py)
            timing = (cp_recording(self.now, lambda t0, t1, row=row: row("CP_COMM", t0, t1))
                      if self.cp > 1 and report else nullcontext())
            with timing:
                if kind == "F":
                    held: dict[str, Any] = {}  # under CP: this rank's token index of micro-batch j, once packed

                    def make_batch(seqs=seqs, j=j, held=held) -> Any:  # packed inside F's timed span, once per j
                        if j not in batches:
                            batches[j] = pack([x[1] for x in seqs], device=self.device,
                                              labels=[x[2] if len(x) > 2 else None for x in seqs])
                            if self.cp > 1:  # this rank's share of every sequence, once per micro-batch
                                from sparsebalance.kernels.moba.cp import cp_token_index, group_index
                                from sparsebalance.kernels.qwen2 import cp_slice

                                # every rank's share is known here: the all-gather variant needs no
                                # collective to learn where the gathered rows go
                                idx = group_index(cp_token_index(batches[j].cu_seqlens, self.block_size, self.cp,
                                                                 self.cp_layout), self.cp_rank)
                                batches[j] = (cp_slice(batches[j], idx), idx)
                        if self.cp > 1:
                            held["index"] = batches[j][1]
                            return batches[j][0]
                        return batches[j]

                    # every TP rank gates: each holds a share of the heads; under CP no rank sees whole sequences
                    gate = vs == self.coverage_vs and self.cp == 1
                    moba_for = partial(MobaArgs, budget=budget, block_size=self.block_size,
                                       backend=self.rr.attention_backend,
                                       coverage_layer=self.rr.coverage_layer if gate else None)
                    if self.cp > 1:
                        def moba_for(cu_seqlens, base_for=moba_for, held=held):  # the index is known once packed
                            return base_for(cu_seqlens=cu_seqlens, cp=CPContext(index=held["index"],
                                                                                group=self.groups["cp"],
                                                                                comm=self.cp_comm))
                    loss, moba = acts.forward(vs, j, make_batch, moba_for, msg.label_tokens, split, row)
                    if loss is not None and self.cp > 1:
                        cp_loss += float(loss)
                        loss = None
                    if loss is not None and report:
                        value = float(loss)
                        rep.loss += value
                        if self.rr.score_labels:
                            h = self.chunks[vs].hits
                            rep.hits = (rep.hits[0] + h[0], rep.hits[1] + h[1])
                        if rep.nonfinite_microbatch is None and not math.isfinite(value):
                            rep.nonfinite_microbatch = j
                    if gate:
                        gated.append((seqs, moba))
                elif kind == "B":
                    acts.backward(vs, j, row)
                elif kind == "I":
                    acts.backward_input(vs, j, row)
                else:
                    acts.backward_weight(vs, j, row)
        acts.check_done()
        self.p2p.wait_sends()
        if self.cp > 1 and self.stage == self.placement[-1]:  # the loss of the whole sequences
            import torch

            total = torch.tensor([cp_loss], dtype=torch.float64)
            dist.all_reduce(total, group=self.groups["cp"])
            if report:
                rep.loss = float(total)
                if not math.isfinite(rep.loss):
                    rep.nonfinite_microbatch = 0
        t0 = self.now()
        self._allreduce()
        if report:
            rep.rows.append((it, d, s, -1, "ALLREDUCE", t0, self.now(), 0, 0))
        t0 = self.now()
        self._step()
        rep.end_s = self.now()
        if report:
            rep.rows.append((it, d, s, -1, "OPTIM", t0, rep.end_s, 0, 0))
        # DST's coverage from the kept gate inputs, after the iteration's end: it is measurement for
        # the tuning policy, not training work, and computed between F actions it would delay this
        # stage's next action (and the pipeline behind it) by time no trace row shows.
        self._coverage(gated, rep)
        if self.rr.manual_gc:
            import gc

            gc.collect()  # between iterations, outside the timed one (kernels/cpuclock.py)
        return rep

    def _coverage(self, gated: list, rep: RankReport) -> None:
        """Each kept sequence's coverage curve into ``rep``. With TP a rank's curve averages over its
        own heads only; the TP ranks hold equal head counts, so the mean of their curves is the
        curve over all heads (one all-reduce of the concatenated curves)."""
        import numpy as np

        curves = [(int(sid), curve) for seqs, moba in gated
                  for (sid, *_), curve in zip(seqs, moba.coverage_curves())]
        if self.tp > 1 and curves:
            import torch
            import torch.distributed as dist

            flat = torch.from_numpy(np.concatenate([c for _, c in curves]))
            dist.all_reduce(flat, group=self.groups["tp"])
            flat = (flat / self.tp).numpy()
            off = 0
            for i, (sid, c) in enumerate(curves):
                curves[i] = (sid, flat[off:off + len(c)])
                off += len(c)
        if self.tp_rank == 0:
            for sid, curve in curves:
                rep.coverage[sid] = tuple(float(c) for c in curve)

    def tied_parameters(self) -> list:
        return [p for p in (mod.tied_parameter() for mod in self.chunks.values()) if p is not None]

    def global_state_dict(self) -> dict[str, Any]:
        """The weights of every chunk of this rank under Hugging Face names (whole tensors)."""
        from sparsebalance.realrun.tp import collapse_kv

        out: dict[str, Any] = {}
        for mod in self.chunks.values():
            out |= mod.global_state_dict()
        m = self.model_cfg
        return {k: collapse_kv(k, t, m.kv_heads, m.head_dim, self.tp) for k, t in out.items()}

    def _allreduce(self) -> None:
        """Sum gradients over the DP replicas of this stage and TP rank (one flat buffer of the local
        shards, one call), over the devices of the first and last vstage for a tied embedding, and
        over the TP ranks sharing a replicated KV head."""
        import torch
        import torch.distributed as dist

        from sparsebalance.realrun.tp import local_grad, sum_replicated_kv

        for p in self.params:
            if p.grad is None:  # a parameter unused by these micro-batches still joins the sum
                p.grad = torch.zeros_like(p)
        for tied in self.tied_parameters():
            dist.all_reduce(local_grad(tied), group=self.groups["tied"])
        if self.kv_params:
            sum_replicated_kv(self.kv_params, self.groups["kv"])
        if self.dp * self.cp > 1:  # DP replicas and CP ranks hold the same weights
            grads = [local_grad(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.groups["dp"])
            off = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[off:off + n].view_as(g))
                off += n

    def _step(self) -> None:
        import torch.distributed as dist

        from sparsebalance.realrun.tp import grad_sq_sum, local_grad

        if self.rr.grad_clip is not None:
            # after the DP sum every replica holds the same gradients: world sum = dp x global norm^2
            sq = grad_sq_sum(self.params, self.tp, {id(p): self.kv_r for p in self.kv_params})
            for mod in self.chunks.values():
                tied = mod.tied_parameter()
                if tied is not None and mod.last:  # counted once, on the first stage
                    sq = sq - local_grad(tied).double().pow(2).sum() / self.tp
            dist.all_reduce(sq, group=self.groups["world"])
            norm = float(sq / (self.dp * self.cp)) ** 0.5
            if norm > self.rr.grad_clip:
                for p in self.params:
                    p.grad.mul_(self.rr.grad_clip / (norm + 1e-6))
        self.opt.step()
