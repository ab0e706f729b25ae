"""MoBA attention on a context-parallel (CP) group, P2P ring variant, in PyTorch.

:func:`moba_attention_cp_ring`: only the pooled block means are all-gathered (for the gate); the
per-step masks are computed before the ring; K and V (one tensor) travel around the ring, each
step's partial output is merged by log-sum-exp, and in the backward the K/V gradients travel the
ring the other way (the rotation's own backward) back to their rank. It builds dense ``[heads, local
queries, keys]`` masks per step: a correctness path, test-sized, not fast. Its collectives are timed
like the all-gather variant's (``cp.py``: :func:`~sparsebalance.kernels.moba.cp.recording`).

Checked forward and backward against the single-process float64 reference on 2 and 4 gloo ranks
(tests/kernels/test_moba_cp.py). Shapes as ``cp.py``.
"""

from __future__ import annotations

import math
from typing import Any

from sparsebalance.data.sequence import blocks
from sparsebalance.kernels.moba.cp import _timed

__all__ = ["moba_attention_cp_ring"]


def _selection(q_rows: Any, pos: Any, means: Any, block_size: int, topk: int) -> Any:
    """[Lq, H, n] past blocks chosen by queries at positions ``pos`` (``naive.naive_selection``'s
    rule on a subset of rows: stable descending sort, the lower block wins a tie)."""
    import torch

    Lq, H, _ = q_rows.shape
    nb = means.shape[0]
    scores = torch.einsum("thd,jhd->thj", q_rows.detach().to(means.dtype), means.detach())
    sel = torch.zeros(Lq, H, nb, dtype=torch.bool, device=q_rows.device)
    for t in range(Lq):
        c = int(pos[t]) // block_size
        if c == 0 or topk <= 1:
            continue
        order = torch.sort(scores[t, :, :c], dim=-1, descending=True, stable=True).indices
        sel[t].scatter_(1, order[:, :topk - 1], True)
    return sel


def _rotate(x: Any, group: Any) -> Any:
    """``x`` of the previous rank of the ring (rank r gets rank r - 1's); backward: the gradient goes
    back to the rank it came from (rank r - 1 gets rank r's). Ranks may hold different row counts."""
    import torch
    import torch.distributed as dist

    def exchange(out, into, to, frm):  # send ``out`` to group rank ``to`` while receiving ``into``
        glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        send = dist.isend(out, glob(to), group=group)
        dist.recv(into, glob(frm), group=group)
        send.wait()
        return into

    def shift(t, to, frm):
        def both():
            n_in = exchange(torch.tensor([t.shape[0]], dtype=torch.int64), torch.zeros(1, dtype=torch.int64), to, frm)
            return exchange(t.contiguous(), t.new_empty((int(n_in), *t.shape[1:])), to, frm)

        return _timed(both)

    class _Rotate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            world, me = dist.get_world_size(group), dist.get_rank(group)
            ctx.world, ctx.me = world, me
            return shift(t, (me + 1) % world, (me - 1) % world)

        @staticmethod
        def backward(ctx, grad):
            return shift(grad, (ctx.me - 1) % ctx.world, (ctx.me + 1) % ctx.world)

    return _Rotate.apply(x)


def moba_attention_cp_ring(q: Any, k: Any, v: Any, index: Any, cu_seqlens: Any, block_size: int, topk: Any,
                           group: Any = None) -> Any:
    """MoBA attention of this rank's queries on the CP group, P2P ring variant (module docstring)."""
    import torch
    import torch.distributed as dist

    from sparsebalance.kernels.moba.naive import _gate_dtype, _topk_list

    T_r, H, D = q.shape
    H_kv = k.shape[1]
    world = dist.get_world_size(group)
    index = index.to(torch.int64)
    bounds = torch.as_tensor([int(x) for x in cu_seqlens.tolist()], dtype=torch.int64)
    n_seq = len(bounds) - 1
    ks = _topk_list(topk, n_seq)
    gd = _gate_dtype(q.dtype)
    seq_of = torch.bucketize(index, bounds[1:], right=True)  # sequence of each local token
    pos = index - bounds[seq_of]  # position in its sequence
    blk = pos // block_size
    # the gate: every rank's pooled block sums and counts, all-gathered (never the K/V themselves)
    nb = [blocks(int(bounds[i + 1] - bounds[i]), block_size) if bounds[i + 1] > bounds[i] else 0 for i in range(n_seq)]
    offset = torch.as_tensor([0] + list(torch.tensor(nb).cumsum(0).tolist()), dtype=torch.int64)
    gid = offset[seq_of] + blk  # global block id of each local token
    sums = torch.zeros(int(offset[-1]), H_kv, D, dtype=gd).index_add_(0, gid, k.detach().to(gd))
    count = torch.zeros(int(offset[-1]), dtype=gd).index_add_(0, gid, torch.ones(T_r, dtype=gd))
    _timed(lambda: (dist.all_reduce(sums, group=group), dist.all_reduce(count, group=group)))
    means = (sums / count.clamp(min=1)[:, None, None]).repeat_interleave(H // H_kv, dim=1)  # [blocks, H, D]
    # per local query: the chosen past blocks (global ids), as naive.py's rule
    chosen = torch.zeros(T_r, H, int(offset[-1]), dtype=torch.bool)
    for i in range(n_seq):
        rows = torch.nonzero(seq_of == i).squeeze(1)
        if rows.numel():
            sel = _selection(q[rows], pos[rows], means[offset[i]:offset[i + 1]], block_size, ks[i])
            chosen[rows, :, offset[i]:offset[i + 1]] = sel
    scale = 1.0 / math.sqrt(D)
    kv = torch.cat([k, v], dim=-1)  # one tensor travels: one chain of rotations, the same on every rank
    meta = torch.stack([seq_of, pos, gid], dim=1)
    acc = lse = None
    for step in range(world):
        if step:  # one hop: the keys and their positions (one trace row)
            kv, meta = _timed(lambda kv=kv, meta=meta: (_rotate(kv, group), _rotate(meta, group).detach()))
        kseq, vseq = kv[..., :D], kv[..., D:]
        k_seq, k_pos, k_gid = meta[:, 0], meta[:, 1], meta[:, 2]
        same = seq_of[:, None] == k_seq[None, :]  # [T_r, T_s]
        own = same & (blk[:, None] == k_pos[None, :] // block_size) & (k_pos[None, :] <= pos[:, None])
        past = same & chosen[:, :, k_gid].permute(1, 0, 2)  # [H, T_r, T_s]
        mask = own[None] | past
        kh = kseq.repeat_interleave(H // H_kv, dim=1)
        vh = vseq.repeat_interleave(H // H_kv, dim=1)
        s = torch.einsum("thd,shd->hts", q, kh) * scale
        s = s.masked_fill(~mask, float("-inf"))
        step_lse = torch.logsumexp(s, dim=-1)  # [H, T_r]; -inf where no key of this step is attended
        p = torch.exp(s - torch.where(torch.isfinite(step_lse), step_lse, 0.0)[..., None])
        o = torch.einsum("hts,shd->htd", p, vh)
        if acc is None:
            acc, lse = o, step_lse
        else:  # merge by log-sum-exp
            new = torch.logaddexp(lse, step_lse)
            safe = torch.where(torch.isfinite(new), new, 0.0)
            acc = acc * torch.exp(lse - safe)[..., None] + o * torch.exp(step_lse - safe)[..., None]
            lse = new
    return acc.permute(1, 0, 2)
