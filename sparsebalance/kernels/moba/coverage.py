"""Routing coverage measured from real gate scores (definition: ``docs/coverage.md``,
code: :mod:`sparsebalance.data.coverage`).

Per query token with past blocks and per head, the gate probabilities are ``softmax(s(t, j) /
sqrt(D))`` over its past blocks ``j < c`` (``gate.py``'s scores); the share a budget ``k`` keeps is
the sum of the ``k - 1`` largest (the routed blocks; the own block is attended whatever the gate
says and is not part of the mass). Shares are averaged per query block (its tokens and heads) and
reduced to C(k) by :func:`sparsebalance.data.coverage.aggregate`, the same reduction the policy
model uses.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import numpy as np

from sparsebalance.data.coverage import aggregate
from sparsebalance.kernels.moba.gate import block_means, gate_scores, past_mask

#: Rows of [rows, H, n_blocks] processed at once (bounds memory for long sequences).
ROW_CHUNK = 4096


def block_shares(q: Any, k: Any, block_size: int, topks: list[int]) -> Any:
    """Mean kept share per query block ``1..n-1`` of one sequence (``q`` ``[L, H, D]``, ``k``
    ``[L, H_kv, D]``): float64 ``[n - 1, len(topks)]``."""
    import torch

    L, H, D = q.shape
    means = block_means(k.double(), block_size)
    nb = means.shape[0]
    ks = torch.tensor(topks, dtype=torch.int64)
    total = torch.zeros(nb, len(topks), dtype=torch.float64)
    for r0 in range(block_size, L, ROW_CHUNK):  # rows of block 0 have no past blocks
        r1 = min(r0 + ROW_CHUNK, L)
        s = gate_scores(q[r0:r1].double(), means) / math.sqrt(D)           # [R, H, nb]
        past = past_mask(r0, r1 - r0, nb, block_size)                        # [R, nb]
        p = torch.softmax(s.masked_fill(~past[:, None, :], float("-inf")), dim=-1)
        cum = torch.cumsum(torch.sort(p, dim=-1, descending=True).values, dim=-1)   # [R, H, nb]
        c = past.sum(dim=-1)                                                 # [R] past blocks
        take = torch.minimum((ks - 1)[None, :], c[:, None])                 # [R, K] blocks kept
        cum0 = torch.cat([cum.new_zeros(*cum.shape[:2], 1), cum], dim=-1)   # share of 0 blocks = 0
        share = torch.gather(cum0, 2, take[:, None, :].expand(-1, H, -1))  # [R, H, K]
        # A full budget keeps everything: write 1 exactly rather than a rounded cumulative sum.
        share = torch.where((take == c[:, None])[:, None, :], 1.0, share)
        blk = torch.arange(r0, r1) // block_size
        total.index_add_(0, blk, share.sum(dim=1))
    per_block = torch.full((nb,), float(block_size * H), dtype=torch.float64)
    per_block[-1] = (L - (nb - 1) * block_size) * H
    return (total / per_block[:, None])[1:]


def sequence_coverage(q: Any, k: Any, block_size: int, topks: list[int]) -> np.ndarray:
    """C(k) of one sequence at each budget of ``topks``: float64 ``[len(topks)]``."""
    shares = block_shares(q, k, block_size, topks).numpy()
    return aggregate(shares, q.shape[0], block_size)


def coverage(q: Any, k: Any, cu_seqlens: Any, block_size: int, topks: list[int]) -> Any:
    """Coverage ``[N, len(topks)]`` float64 of packed sequences (see the module docstring)."""
    import torch

    cu = [int(x) for x in cu_seqlens.tolist()]
    rows = [sequence_coverage(q[a:b].detach().cpu(), k[a:b].detach().cpu(), block_size, topks)
            for a, b in pairwise(cu)]
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, len(topks), dtype=torch.float64)
