"""MoBA attention on a context-parallel (CP) group: the all-gather variant, in PyTorch.

Each rank of a CP group holds a layout's share of every packed sequence's tokens (Q, K and V of its
key blocks: :func:`cp_token_index`, the same layouts as ``simulator/cost/contextparallel.py``) and
computes the attention of its own queries. K and V are all-gathered (gloo or NCCL), so every rank
sees every key at its global position; the gate scores each query against the mean key of every
block (the pooled block means, computed from the gathered K) and picks, as ``naive.py`` does, the
``topk - 1`` best past blocks (stable order: the lower block wins a tie) plus the query's own block,
causally. The backward sums every rank's dK/dV and keeps the rank's own rows: the reduce-scatter of
the gradients, written as an all-reduce so that gloo runs it too.

This is a correct, test-sized implementation (dense ``[heads, local queries, sequence]`` masks per
sequence, any dtype, differentiable through autograd), checked forward and backward against the
single-process float64 reference on 2 and 4 gloo ranks; the P2P ring with per-step masks and
log-sum-exp merging, and the real run's use of it, are the next steps (docs/costmodel.md section 11).

Shapes: the packed batch has ``T`` tokens (``cu_seqlens`` int ``[N + 1]``); a rank holds ``T_r``
of them, ``index`` (int64 ``[T_r]``) their packed positions in its order; ``q`` ``[T_r, H, D]``,
``k``/``v`` ``[T_r, H_kv, D]``; ``topk`` an int or an int tensor ``[N]`` (own block included).
"""

from __future__ import annotations

import math
from typing import Any

from sparsebalance.data.sequence import blocks

__all__ = ["cp_token_index", "moba_attention_cp"]


def cp_token_index(cu_seqlens: Any, block_size: int, cp: int, layout: str) -> list[Any]:
    """Per rank, the packed positions (int64 tensor) of the tokens it holds: each sequence's key
    blocks dealt by ``layout`` (``contiguous``, ``zigzag``, ``stripe``), in block order; a sequence
    with too few blocks for the layout (cp; 2 cp for zigzag) stays whole on rank ``i mod cp`` (its
    index in the batch)."""
    import numpy as np
    import torch

    from sparsebalance.simulator.cost.contextparallel import min_blocks, shards

    bounds = [int(x) for x in cu_seqlens.tolist()]
    per_rank: list[list[np.ndarray]] = [[] for _ in range(cp)]
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        L = b - a
        if L == 0:
            continue
        n = blocks(L, block_size)
        if n < min_blocks(layout, cp):
            per_rank[i % cp].append(np.arange(a, b))
            continue
        for r, part in enumerate(shards(n, cp, layout)):
            tok = [np.arange(a + j * block_size, min(a + (j + 1) * block_size, b)) for j in sorted(part)]
            per_rank[r].append(np.concatenate(tok) if tok else np.zeros(0, dtype=np.int64))
    return [torch.as_tensor(np.concatenate(p) if p else np.zeros(0, dtype=np.int64), dtype=torch.int64)
            for p in per_rank]


def _all_gather_rows(x: Any, group: Any) -> Any:
    """``x`` ``[T_r, ...]`` of every rank, concatenated in rank order (ranks may hold different
    counts). Backward: the gradient summed over ranks, the rank's own rows kept."""
    import torch
    import torch.distributed as dist

    class _Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            world, me = dist.get_world_size(group), dist.get_rank(group)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(sizes, torch.tensor([t.shape[0]], dtype=torch.int64), group=group)
            sizes = [int(s) for s in sizes]
            top = max(sizes)
            pad = t.new_zeros((top, *t.shape[1:]))
            pad[: t.shape[0]] = t
            parts = [torch.empty_like(pad) for _ in range(world)]
            dist.all_gather(parts, pad.contiguous(), group=group)
            ctx.sizes, ctx.me = sizes, me
            return torch.cat([p[:s] for p, s in zip(parts, sizes)], dim=0)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=group)  # every rank's contribution to every row
            start = sum(ctx.sizes[: ctx.me])
            return grad[start:start + ctx.sizes[ctx.me]]

    return _Gather.apply(x)


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


def moba_attention_cp(q: Any, k: Any, v: Any, index: Any, cu_seqlens: Any, block_size: int, topk: Any,
                      group: Any = None) -> Any:
    """MoBA attention of this rank's queries (``[T_r, H, D]``, in ``index``'s order) on the CP group
    ``group`` (default: the world), all-gather variant (module docstring)."""
    import torch

    from sparsebalance.kernels.moba.naive import _gate_dtype, _topk_list

    T_r, H, D = q.shape
    group_size = H // k.shape[1]
    index_all = _all_gather_rows(index.to(torch.int64).unsqueeze(1), group).squeeze(1).detach()
    total = int(cu_seqlens[-1])
    k_all = _all_gather_rows(k, group)
    v_all = _all_gather_rows(v, group)
    K = k_all.new_zeros((total, *k.shape[1:])).index_copy(0, index_all, k_all)  # global packed order
    V = v_all.new_zeros((total, *v.shape[1:])).index_copy(0, index_all, v_all)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    ks = _topk_list(topk, len(bounds) - 1)
    seq_of = torch.bucketize(index.to(torch.int64), torch.as_tensor(bounds[1:], dtype=torch.int64), right=True)
    scale = 1.0 / math.sqrt(D)
    out = q.new_zeros(T_r, H, v.shape[-1])
    gd = _gate_dtype(q.dtype)
    for i in range(len(bounds) - 1):
        rows = torch.nonzero(seq_of == i).squeeze(1)
        a, b = bounds[i], bounds[i + 1]
        if rows.numel() == 0 or b == a:
            continue
        L = b - a
        pos = index[rows].to(torch.int64) - a  # positions in the sequence
        kseq, vseq = K[a:b], V[a:b]
        nb = blocks(L, block_size)
        means = torch.stack([kseq[j * block_size:min((j + 1) * block_size, L)].to(gd).mean(dim=0)
                             for j in range(nb)]).repeat_interleave(group_size, dim=1)  # [nb, H, D]
        qs = q[rows]
        sel = _selection(qs, pos, means, block_size, ks[i])  # [Lq, H, nb]
        key = torch.arange(L)
        kblk, qblk = key // block_size, pos // block_size
        own = (qblk[:, None] == kblk[None, :]) & (key[None, :] <= pos[:, None])  # [Lq, L]
        mask = own[None] | sel[:, :, kblk].permute(1, 0, 2)  # [H, Lq, L]
        kh = kseq.repeat_interleave(group_size, dim=1)
        vh = vseq.repeat_interleave(group_size, dim=1)
        s = torch.einsum("thd,shd->hts", qs, kh) * scale
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        out = out.index_copy(0, rows, torch.einsum("hts,shd->thd", p, vh))
    return out
