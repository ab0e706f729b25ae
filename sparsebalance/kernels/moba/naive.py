"""Reference MoBA attention: dense ``[L, L]`` masks per sequence, any dtype, differentiable.

This module is the oracle the other implementations are tested against, so it is written to be
obviously correct rather than fast: block means by an explicit loop over blocks, selection by a
stable descending sort (ties: the lower block index wins, the rule of ``gate.py``), one dense boolean
mask per sequence and head, and a plain masked softmax. It deliberately does not import ``gate.py``,
so that tests of the shared selection code have an independent check. Memory is O(H * L^2) per
sequence: use it for short sequences only.

Shapes (packed variable-length layout, as FlashAttention's varlen API):
``q`` ``[T, H, D]``, ``k``/``v`` ``[T, H_kv, D]``, ``cu_seqlens`` int32 ``[N + 1]``, ``topk`` an int
or an integer tensor ``[N]`` (per-sequence budget, own block included).
"""

from __future__ import annotations

import math
from typing import Any

from sparsebalance.data.sequence import blocks


def _gate_dtype(dtype: Any) -> Any:
    """Gate scores are computed in float32 for half-precision inputs, else in the input dtype."""
    import torch

    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _topk_list(topk: Any, n: int) -> list[int]:
    import torch

    if isinstance(topk, torch.Tensor):
        return [int(x) for x in topk.reshape(-1).tolist()]
    return [int(topk)] * n


def naive_selection(q: Any, k: Any, block_size: int, topk: int) -> Any:
    """Selected past blocks of one sequence as a boolean tensor ``[L, H, n_blocks]``.

    ``q`` ``[L, H, D]`` and ``k`` ``[L, H_kv, D]`` are one sequence. Entry ``[t, h, j]`` is True when
    query ``t`` of head ``h`` attends past block ``j`` (``j < t // block_size``) in full.
    """
    import torch

    L, H, _ = q.shape
    group = H // k.shape[1]
    nb = blocks(L, block_size)
    gd = _gate_dtype(q.dtype)
    means = torch.stack([k[j * block_size:min((j + 1) * block_size, L)].to(gd).mean(dim=0)
                         for j in range(nb)])                                 # [nb, H_kv, D]
    means = means.repeat_interleave(group, dim=1)                            # [nb, H, D]
    scores = torch.einsum("thd,jhd->thj", q.detach().to(gd), means.detach())  # [L, H, nb]
    sel = torch.zeros(L, H, nb, dtype=torch.bool, device=q.device)
    for t in range(L):
        c = t // block_size
        if c == 0 or topk <= 1:
            continue
        past = scores[t, :, :c]                                               # [H, c]
        order = torch.sort(past, dim=-1, descending=True, stable=True).indices
        chosen = order[:, :topk - 1]
        sel[t].scatter_(1, chosen, True)
    return sel


def naive_mask(q: Any, k: Any, block_size: int, topk: int) -> Any:
    """Dense attention mask of one sequence, ``[H, L, L]`` bool (True = query row attends key col)."""
    import torch

    L = q.shape[0]
    pos = torch.arange(L, device=q.device)
    blk = pos // block_size
    own = (blk[:, None] == blk[None, :]) & (pos[None, :] <= pos[:, None])  # [L, L]
    sel = naive_selection(q, k, block_size, topk)                          # [L, H, nb]
    past = sel[:, :, blk].permute(1, 0, 2)                                 # [H, L, L] via key's block
    return own[None] | past


def moba_attention_naive(q: Any, k: Any, v: Any, cu_seqlens: Any, block_size: int, topk: Any) -> Any:
    """MoBA attention by dense masks; returns ``[T, H, D]`` in the dtype of ``q``.

    Computes in the input dtype (use float64 inputs for a high-precision reference). Gradients flow
    to ``q``, ``k`` and ``v`` through the masked softmax; the selection itself is not differentiable.
    """
    import torch

    T, H, D = q.shape
    group = H // k.shape[1]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    ks = _topk_list(topk, len(bounds) - 1)
    scale = 1.0 / math.sqrt(D)
    outs = []
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        if b == a:
            continue
        qs, kseq, vseq = q[a:b], k[a:b], v[a:b]
        mask = naive_mask(qs, kseq, block_size, ks[i])                        # [H, L, L]
        kh = kseq.repeat_interleave(group, dim=1)                             # [L, H, D]
        vh = vseq.repeat_interleave(group, dim=1)
        s = torch.einsum("thd,shd->hts", qs, kh) * scale
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hts,shd->thd", p, vh))
    if not outs:
        return q.new_zeros(T, H, v.shape[-1])
    return torch.cat(outs, dim=0)


def moba_coverage_naive(q: Any, k: Any, cu_seqlens: Any, block_size: int, topks: Any) -> Any:
    """Brute-force coverage ``[N, len(topks)]`` (float64) by Python loops over tokens and heads: the
    test oracle of ``docs/coverage.md``'s definition, written independently of ``data/coverage.py``
    (mean over routed (token, head) pairs of the ``k - 1`` largest past-block probabilities)."""
    import torch

    _, H, D = q.shape
    group = H // k.shape[1]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    ks = [int(x) for x in topks]
    res = torch.ones(len(bounds) - 1, len(ks), dtype=torch.float64)
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        L = b - a
        nb = blocks(L, block_size)
        qs = q[a:b].detach().double()
        means = [k[a + j * block_size:a + min((j + 1) * block_size, L)].detach().double().mean(dim=0)
                 for j in range(nb)]
        totals = [0.0] * len(ks)
        count = 0
        for t in range(L):
            c = t // block_size
            if c == 0:
                continue
            for h in range(H):
                s = torch.tensor([float(qs[t, h] @ means[j][h // group]) for j in range(c)],
                                 dtype=torch.float64) / math.sqrt(D)
                p = sorted(torch.softmax(s, dim=0).tolist(), reverse=True)
                for n, kk in enumerate(ks):
                    totals[n] += sum(p[:max(kk - 1, 0)])
                count += 1
        if count:
            res[i] = torch.tensor(totals, dtype=torch.float64) / count
    return res
