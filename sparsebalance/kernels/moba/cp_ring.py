"""MoBA attention on a context-parallel (CP) group, P2P ring variant, on the CPU path.

:func:`moba_attention_cp_ring`: only the pooled block sums are all-reduced (the gate's means, where a
sequence is sparse; never the K/V themselves); each rank gates its own queries once
(``ring_step.plan``); K and V (one tensor; every rank's rows known from the group's index) then
travel around the ring, and at each step the rank runs its ring-step call on the keys it holds
(``ring_step.step_forward``: the dense runs, its own blocks at its own step, the gate's held past
blocks as tiles), merged by log-sum-exp. The received K/V are not kept: the backward passes K/V
around the ring again, each with the fp32 dK/dV accumulated so far (every rank adds its step's
share, ``ring_step.step_backward`` from the merged output), and a last hop brings each rank's
gradient home: ``world - 1`` hops of K/V + dK/dV and one of dK/dV, as Transformer Engine's ring does
and the latency model prices it. Collectives are timed like the all-gather variant's (``cp.py``:
:func:`~sparsebalance.kernels.moba.cp.recording`): the gate's all-reduce, one row per hop, and the
group's index, gathered once per micro-batch where the caller did not give it (``cp.group_index``).

One rank's side lives in :class:`RingRank` (its buffers, gate, steps and the backward's), which
:func:`moba_attention_cp_ring` drives between processes and ``profile --cp`` drives alone, every
rank's K/V given, timing each step for the ``attn_*_cp_step`` rows. Checked forward and backward
against the single-process float64 reference on 2 and 4 gloo ranks (tests/kernels/test_moba_cp.py).
Shapes as ``cp.py``.
"""

from __future__ import annotations

import itertools
from typing import Any

from sparsebalance.data.sequence import blocks
from sparsebalance.kernels.moba.cp import _timed, blocks_of, group_indices

__all__ = ["RingRank", "moba_attention_cp_ring", "pooled"]


def _shift(t: Any, rows: int, group: Any, forward: bool) -> Any:
    """This rank's ``t`` to the next rank of the ring (``forward``; the previous one otherwise), and
    the other neighbour's (``rows`` rows of the same shape) in return."""
    import torch.distributed as dist

    world, me = dist.get_world_size(group), dist.get_rank(group)
    to, frm = ((me + 1) % world, (me - 1) % world) if forward else ((me - 1) % world, (me + 1) % world)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    into = t.new_empty((rows, *t.shape[1:]))
    send = dist.isend(t.contiguous(), glob(to), group=group)
    dist.recv(into, glob(frm), group=group)
    send.wait()
    return into


def pooled(k: Any, index: Any, bounds: list[int], block_size: int) -> tuple[Any, Any]:
    """(sums ``[blocks, H_kv, D]``, counts ``[blocks]``, gate dtype) of the key rows ``k`` at packed
    positions ``index``, over every block of the batch (sequence after sequence): what a rank
    contributes to the gate's all-reduce."""
    import torch

    from sparsebalance.kernels.moba.gate import gate_dtype

    gd = gate_dtype(k.dtype)
    b = torch.as_tensor(bounds, dtype=torch.int64)
    seq = torch.bucketize(index, b[1:], right=True)
    offset = _offsets(bounds, block_size)
    gid = torch.as_tensor(offset[:-1], dtype=torch.int64)[seq] + (index - b[seq]) // block_size
    sums = torch.zeros(offset[-1], k.shape[1], k.shape[2], dtype=gd).index_add_(0, gid, k.detach().to(gd))
    count = torch.zeros(offset[-1], dtype=gd).index_add_(0, gid, torch.ones(index.shape[0], dtype=gd))
    return sums, count


def _offsets(bounds: list[int], block_size: int) -> list[int]:
    nb = [blocks(bounds[i + 1] - bounds[i], block_size) if bounds[i + 1] > bounds[i] else 0
          for i in range(len(bounds) - 1)]
    return [0, *itertools.accumulate(nb)]


class RingRank:
    """One rank's side of the ring for one layer's attention call, the exchanges left to the caller
    (:func:`moba_attention_cp_ring` between processes; ``profile --cp`` alone, every rank's K/V given):
    its queries and the packed buffers, the gate, each step's call and merge, and the backward's."""

    def __init__(self, q: Any, k: Any, v: Any, index: Any, per: list[Any], me: int, bounds: list[int],
                 block_size: int, topks: list[int]) -> None:
        import torch

        from sparsebalance.kernels.moba.gate import gate_dtype

        cdt = gate_dtype(q.dtype)
        T, (_, H, D), hk = bounds[-1], q.shape, k.shape[1]
        self.index, self.per, self.me, self.bounds, self.block_size, self.topks = index, per, me, bounds, block_size, topks
        self.dtypes = (q.dtype, k.dtype, v.dtype)
        self.D = D
        self.Q = q.new_zeros((T, H, D), dtype=cdt).index_copy_(0, index, q.detach().to(cdt))
        self.buf = (q.new_zeros((T, hk, D), dtype=cdt), q.new_zeros((T, hk, D), dtype=cdt))
        self.own = torch.cat([k.detach(), v.detach()], dim=-1).to(cdt)
        self.mine = blocks_of(index, bounds, block_size)
        self.held = {}  # source rank -> its blocks (the same at every layer's step)
        self.sparse = any(topks[i] < blocks(bounds[i + 1] - bounds[i], block_size) for i in range(len(topks)))
        """Whether a sequence is sparse: only then is the gate run (a dense one attends every past block)."""
        self.steps: list = []
        self.plan: Any = None
        self.acc = self.lse = None

    def gate_sums(self) -> tuple[Any, Any] | None:
        """This rank's block sums and counts for the gate's all-reduce (None: no sparse sequence)."""
        return pooled(self.own[..., :self.D], self.index, self.bounds, self.block_size) if self.sparse else None

    def begin(self, sums: Any = None, count: Any = None) -> None:
        """Gate this rank's queries from the group's (all-reduced) ``sums`` and ``count``."""
        from sparsebalance.kernels.moba.ring_step import plan

        means: list = []
        if self.sparse:
            mu = sums / count.clamp(min=1)[:, None, None]
            off = _offsets(self.bounds, self.block_size)
            means = [mu[off[i]:off[i + 1]] for i in range(len(off) - 1)]
        self.plan = plan(self.Q, None, self.bounds, self.block_size, self.topks, self.mine, means=means)

    def _keys(self, s: int, kv: Any) -> tuple[Any, Any, Any]:
        """The packed K and V buffers with step ``s``'s keys ``kv`` written in, and their blocks."""

        src = (self.me - s) % len(self.per)
        idx = self.per[src]
        if src not in self.held:
            self.held[src] = blocks_of(idx, self.bounds, self.block_size)
        self.buf[0].index_copy_(0, idx, kv[..., :self.D])
        self.buf[1].index_copy_(0, idx, kv[..., self.D:])
        return self.buf[0], self.buf[1], self.held[src]

    def forward_step(self, s: int, kv: Any) -> None:
        """Step ``s`` on the keys ``kv`` (K then V on the last axis) of rank ``me - s``, merged in."""
        from sparsebalance.kernels.moba.ring_step import merge, step_forward

        K, V, held = self._keys(s, kv)
        o, lo, saved = step_forward(self.plan, self.Q, K, V, held)
        self.acc, self.lse = (o, lo) if self.acc is None else merge(self.acc, self.lse, o, lo)
        self.steps.append(saved)

    def output(self) -> Any:
        """This rank's rows of the merged output, in q's dtype."""
        return self.acc[self.index].to(self.dtypes[0])

    def backward_begin(self, dout: Any) -> None:
        import torch

        self.dO = self.acc.new_zeros(self.acc.shape).index_copy_(0, self.index, dout.to(self.acc.dtype))
        self.dq = torch.zeros_like(self.Q)

    def backward_step(self, s: int, kv: Any) -> Any:
        """Step ``s``'s backward on the keys ``kv``: ``[rows, H_kv, 2 D]`` its share of their gradient."""
        import torch

        from sparsebalance.kernels.moba.ring_step import step_backward

        K, V, _ = self._keys(s, kv)
        gq, gk, gv = step_backward(self.plan, self.steps[s], self.Q, K, V, self.acc, self.lse, self.dO)
        self.dq += gq
        idx = self.per[(self.me - s) % len(self.per)]
        return torch.cat([gk[idx], gv[idx]], dim=-1)

    def backward_end(self) -> Any:
        """This rank's dQ rows, in q's dtype."""
        return self.dq[self.index].to(self.dtypes[0])


_RING: Any = None


def _ring_function() -> Any:
    import torch
    import torch.distributed as dist

    class _RingMoba(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, args):
            index, per, bounds, block_size, topks, group = args
            world, me = dist.get_world_size(group), dist.get_rank(group)
            rank = RingRank(q, k, v, index, per, me, bounds, block_size, topks)
            sums = rank.gate_sums()
            if sums is not None:  # the gate's exchange (one trace row)
                _timed(lambda: [dist.all_reduce(x, group=group) for x in sums])
            rank.begin(*(sums or ()))
            kv = rank.own
            for s in range(world):
                if s:  # one hop (one trace row)
                    kv = _timed(lambda kv=kv, n=per[(me - s) % world].shape[0]: _shift(kv, n, group, True))
                rank.forward_step(s, kv)
            # the received K/V are not kept: the backward passes them around again (module docstring)
            ctx.rank, ctx.group = rank, group
            return rank.output()

        @staticmethod
        def backward(ctx, dout):
            rank, group = ctx.rank, ctx.group
            world, me, per = len(rank.per), rank.me, rank.per
            rank.backward_begin(dout)
            kv, grad = rank.own, None
            for s in range(world):
                if s:  # one hop: the keys, and their gradient so far, travel on together (one row)
                    n = per[(me - s) % world].shape[0]
                    kv, grad = _timed(lambda kv=kv, g=grad, n=n: (_shift(kv, n, group, True), _shift(g, n, group, True)))
                step = rank.backward_step(s, kv)
                grad = step if grad is None else grad + step
            if world > 1:  # the last hop brings each rank's gradient home (one row)
                grad = _timed(lambda g=grad: _shift(g, per[me].shape[0], group, True))
            ctx.rank = None
            _, kd, vd = rank.dtypes
            D = rank.D
            return rank.backward_end(), grad[..., :D].to(kd), grad[..., D:].to(vd), None

    return _RingMoba


def moba_attention_cp_ring(q: Any, k: Any, v: Any, index: Any, cu_seqlens: Any, block_size: int, topk: Any,
                           group: Any = None) -> Any:
    """MoBA attention of this rank's queries on the CP group, P2P ring variant (module docstring)."""
    import torch

    global _RING
    if _RING is None:
        _RING = _ring_function()
    bounds = [int(x) for x in cu_seqlens.tolist()]
    n = len(bounds) - 1
    topks = ([int(x) for x in topk.reshape(-1).tolist()] if isinstance(topk, torch.Tensor) else [int(topk)] * n)
    per = group_indices(index, group)  # every rank's rows (kept on the caller's index): a hop sends K/V alone
    return _RING.apply(q, k, v, (index.to(torch.int64), per, bounds, block_size, topks, group))
