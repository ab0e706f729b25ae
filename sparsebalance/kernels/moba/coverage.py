"""Gate coverage: how much of the gate's softmax mass over past blocks a budget keeps.

For query ``t`` (block ``c >= 1``) and head ``h``: ``p = softmax(s(t, j) / sqrt(D))`` over past blocks
``j < c``; the chosen ``k - 1`` blocks are the largest entries of ``p`` (ties do not change the sum), so
their share is the sum of the ``min(k - 1, c)`` largest probabilities. Coverage of a sequence at ``k``
is the mean share over all (token with past blocks, head) pairs; 1.0 for a sequence without past
blocks. This is the C(k) curve the DST policy and the coverage model consume.
"""

from __future__ import annotations

import math
from typing import Any

from sparsebalance.kernels.moba.gate import block_means, gate_scores, past_mask

#: Rows of [rows, H, n_blocks] processed at once (bounds memory for long sequences).
ROW_CHUNK = 4096


def sequence_coverage(q: Any, k: Any, block_size: int, topks: list[int]) -> Any:
    """Coverage of one sequence (``q`` ``[L, H, D]``, ``k`` ``[L, H_kv, D]``): float64 ``[len(topks)]``."""
    import torch

    L, H, D = q.shape
    means = block_means(k.double(), block_size)
    nb = means.shape[0]
    ks = torch.tensor(topks, dtype=torch.int64)
    total = torch.zeros(len(topks), dtype=torch.float64)
    count = 0
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
        total += share.sum(dim=(0, 1))
        count += (r1 - r0) * H
    if count == 0:
        return torch.ones(len(topks), dtype=torch.float64)
    return total / count


def coverage(q: Any, k: Any, cu_seqlens: Any, block_size: int, topks: list[int]) -> Any:
    """Coverage ``[N, len(topks)]`` float64 of packed sequences (see the module docstring)."""
    import torch

    cu = [int(x) for x in cu_seqlens.tolist()]
    rows = [sequence_coverage(q[a:b].detach().cpu(), k[a:b].detach().cpu(), block_size, topks)
            for a, b in zip(cu[:-1], cu[1:])]
    return torch.stack(rows) if rows else torch.zeros(0, len(topks), dtype=torch.float64)
