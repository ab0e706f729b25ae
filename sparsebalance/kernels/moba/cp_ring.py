"""MoBA attention on a context-parallel (CP) group, P2P ring variant, on the CPU path.

:func:`moba_attention_cp_ring`: only the pooled block sums are all-reduced (the gate's means: never
the K/V themselves); each rank gates its own queries once (``ring_step.plan``); K and V (one tensor,
every rank's rows known from the group's index) then travel around the ring, and at each step the rank runs
its ring-step call on the keys it holds (``ring_step.step_forward``: the dense runs, its own blocks
at its own step, the gate's held past blocks as tiles), merged by log-sum-exp. The received K/V
are not kept: the backward passes K/V around the ring again, each with the fp32 dK/dV accumulated
so far (every rank adds its step's share, ``ring_step.step_backward`` from the merged output), and
a last hop brings each rank's gradient home: ``world - 1`` hops of K/V + dK/dV and one of dK/dV, as
Transformer Engine's ring does and the latency model prices it. Collectives are timed like the all-gather variant's (``cp.py``:
:func:`~sparsebalance.kernels.moba.cp.recording`): the gate's all-reduce (where a sequence is
sparse), one row per hop (and the
group's index, gathered once per micro-batch where the caller did not give it, ``cp.group_index``).

The step calls are what ``profile --cp`` times for the ``attn_*_cp_step`` rows. Checked forward and
backward against the single-process float64 reference on 2 and 4 gloo ranks
(tests/kernels/test_moba_cp.py). Shapes as ``cp.py``.
"""

from __future__ import annotations

from typing import Any

from sparsebalance.data.sequence import blocks
from sparsebalance.kernels.moba.cp import _timed, group_indices

__all__ = ["moba_attention_cp_ring"]


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


def _means(k: Any, index: Any, bounds: list[int], block_size: int, group: Any) -> list[Any]:
    """Per sequence ``[n_blocks, H_kv, D]``: every block's mean key over the group (pooled sums and
    counts, one all-reduce row)."""
    import torch
    import torch.distributed as dist

    from sparsebalance.kernels.moba.gate import gate_dtype

    gd = gate_dtype(k.dtype)
    b = torch.as_tensor(bounds, dtype=torch.int64)
    seq = torch.bucketize(index, b[1:], right=True)
    nb = [blocks(bounds[i + 1] - bounds[i], block_size) if bounds[i + 1] > bounds[i] else 0
          for i in range(len(bounds) - 1)]
    offset = [0, *torch.tensor(nb).cumsum(0).tolist()]
    gid = torch.as_tensor(offset[:-1], dtype=torch.int64)[seq] + (index - b[seq]) // block_size
    sums = torch.zeros(offset[-1], k.shape[1], k.shape[2], dtype=gd).index_add_(0, gid, k.detach().to(gd))
    count = torch.zeros(offset[-1], dtype=gd).index_add_(0, gid, torch.ones(index.shape[0], dtype=gd))
    _timed(lambda: (dist.all_reduce(sums, group=group), dist.all_reduce(count, group=group)))
    means = sums / count.clamp(min=1)[:, None, None]
    return [means[offset[i]:offset[i + 1]] for i in range(len(nb))]


_RING: Any = None


def _ring_function() -> Any:
    import torch
    import torch.distributed as dist

    from sparsebalance.kernels.moba.gate import gate_dtype
    from sparsebalance.kernels.moba.ring_step import blocks_of, merge, plan, step_backward, step_forward

    def place(buf: Any, rows: Any, kv: Any, D: int) -> tuple[Any, Any]:
        """The packed K and V buffers with a step's held rows written in."""
        buf[0].index_copy_(0, rows, kv[..., :D])
        buf[1].index_copy_(0, rows, kv[..., D:])
        return buf

    class _RingMoba(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, args):
            index, bounds, block_size, topks, group = args
            world, me = dist.get_world_size(group), dist.get_rank(group)
            per = group_indices(index, group)  # every rank's rows: a hop sends K/V alone
            cdt = gate_dtype(q.dtype)
            T, (_, H, D), hk = bounds[-1], q.shape, k.shape[1]
            mine = blocks_of(index, bounds, block_size)
            Q = q.new_zeros((T, H, D), dtype=cdt).index_copy_(0, index, q.detach().to(cdt))
            # the gate's exchange only where a sequence is sparse (a dense one attends every past block)
            sparse = any(topks[i] < blocks(bounds[i + 1] - bounds[i], block_size) for i in range(len(topks)))
            means = _means(k, index, bounds, block_size, group) if sparse else []
            rank_plan = plan(Q, None, bounds, block_size, topks, mine, means=means)
            buf = (q.new_zeros((T, hk, D), dtype=cdt), q.new_zeros((T, hk, D), dtype=cdt))
            own = kv = torch.cat([k.detach(), v.detach()], dim=-1).to(cdt)
            steps, acc, lse = [], None, None
            for s in range(world):
                idx = per[(me - s) % world]  # the rank whose keys arrive at step s
                if s:  # one hop (one trace row)
                    kv = _timed(lambda kv=kv, n=idx.shape[0]: _shift(kv, n, group, True))
                K, V = place(buf, idx, kv, D)
                o, lo, saved = step_forward(rank_plan, Q, K, V, blocks_of(idx, bounds, block_size))
                acc, lse = (o, lo) if acc is None else merge(acc, lse, o, lo)
                steps.append(saved)
            # the received K/V are not kept: the backward passes them around again (module docstring)
            ctx.state = (rank_plan, steps, Q, buf, acc, lse, own, per, me, group, index)
            ctx.dtypes = (q.dtype, k.dtype, v.dtype)
            return acc[index].to(q.dtype)

        @staticmethod
        def backward(ctx, dout):
            rank_plan, steps, Q, buf, acc, lse, kv, per, me, group, index = ctx.state
            world, D = len(steps), Q.shape[2]
            dO = acc.new_zeros(acc.shape).index_copy_(0, index, dout.to(acc.dtype))
            dq, grad = torch.zeros_like(Q), None
            for s, saved in enumerate(steps):
                idx = per[(me - s) % world]
                if s:  # one hop: the keys, and their gradient so far, travel on together (one row)
                    kv, grad = _timed(lambda kv=kv, g=grad, n=idx.shape[0]: (_shift(kv, n, group, True),
                                                                             _shift(g, n, group, True)))
                K, V = place(buf, idx, kv, D)
                gq, gk, gv = step_backward(rank_plan, saved, Q, K, V, acc, lse, dO)
                dq += gq
                step = torch.cat([gk[idx], gv[idx]], dim=-1)  # the held keys' share
                grad = step if grad is None else grad + step
            if world > 1:  # the last hop brings each rank's gradient home (one row)
                grad = _timed(lambda g=grad: _shift(g, per[me].shape[0], group, True))
            ctx.state = None
            qd, kd, vd = ctx.dtypes
            return dq[index].to(qd), grad[..., :D].to(kd), grad[..., D:].to(vd), None

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
    return _RING.apply(q, k, v, (index.to(torch.int64), bounds, block_size, topks, group))
