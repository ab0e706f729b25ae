"""Work the MoBA Triton kernels execute, counted from a call's index tables (no kernel run).

Executed work = (query row, key) pairs that pass through a ``tl.dot`` -- tile rows x tile keys per
tile visited, masked or not -- summed over query heads. Attended work = the (query, key) pairs MoBA
semantics attends (own block causally plus the chosen past blocks). Their ratio says how much of
the kernel's arithmetic is wasted on masked entries.

Two decompositions are counted:

* ``union`` -- the query-tile-major kernel of commit 301d238 (replaced): a tile of ``block_m`` rows
  looped over the *union* of the past blocks its rows selected, each a full key block, plus its own
  block causally in ``block_n`` key tiles. Kept here only to report the before/after ratio; it is
  recomputed from the selection table ``sel`` exactly as that kernel's index builder did.
* ``gather`` -- the shipped key-block-major kernel (``triton_impl.py``): per (key block, kv head)
  the (query, head) rows that chose the block, in tiles of ``block_m`` gathered rows against the
  whole block; the own block per query tile, causally, in ``block_n`` key tiles.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparsebalance.data.sequence import blocks


def attended_pairs(lengths: list[int], block_size: int, topks: list[int], heads: int) -> int:
    """Exact attended (query, key) pairs summed over heads (closed form per sequence)."""
    total = 0
    for L, k in zip(lengths, topks):
        nb = blocks(L, block_size)
        for c in range(nb):
            s = min(block_size, L - c * block_size)
            total += s * (s + 1) // 2 + block_size * s * min(k - 1, c)
    return total * heads


def own_tile_pairs(lengths: list[int], block_size: int, block_m: int, block_n: int, heads: int) -> int:
    """Pairs executed for the own blocks: each query tile of ``block_m`` rows (aligned to its
    sequence start) runs key tiles of ``block_n`` from its block start up to its last row."""
    total = 0
    for L in lengths:
        for t in range(0, L, block_m):
            start = (t // block_size) * block_size
            total += block_m * block_n * -(-(t + block_m - start) // block_n)
    return total * heads


def union_work(sel: Any, lengths: list[int], block_size: int, block_m: int, block_n: int) -> int:
    """Executed pairs of the union (query-tile-major) kernel for selection ``sel`` int [T, H, K1].

    Per (query tile, head): ``block_m`` x (own key tiles x ``block_n`` + |union| x ``block_size``),
    where the union is the set of distinct past blocks the tile's rows selected (-1 = none).
    """
    import torch

    T, H, K1 = sel.shape
    pad = torch.full((1, H, K1), -1, dtype=sel.dtype)
    selp = torch.cat([sel.cpu(), pad])
    rows = []
    s0 = 0
    for L in lengths:
        for t in range(s0, s0 + L, block_m):
            r = torch.arange(t, t + block_m)
            rows.append(torch.where(r < s0 + L, r, T))
        s0 += L
    past = 0
    for i in range(0, len(rows), 4096):  # bounded memory: 4096 tiles at a time
        idx = torch.stack(rows[i:i + 4096])                                   # [n, BM]
        tsel = selp[idx].permute(0, 2, 1, 3).reshape(idx.shape[0], H, -1).long()
        tsel = tsel.sort(dim=-1).values
        distinct = (tsel >= 0) & torch.cat([torch.ones_like(tsel[..., :1], dtype=torch.bool),
                                            tsel[..., 1:] != tsel[..., :-1]], dim=-1)
        past += int(distinct.sum())
    return block_m * block_size * past + own_tile_pairs(lengths, block_size, block_m, block_n, H)


def gather_work(index: Any, block_size: int, block_m: int, block_n: int, heads: int, kv_heads: int, *,
                backward: bool = False) -> int:
    """Executed pairs of the shipped key-block-major kernel, from the tables of ``index``.

    Forward: every forward item runs ``block_m`` gathered rows against its whole past block; every
    own+merge query tile runs ``block_n`` key tiles from its first key row (own block start, or
    sequence start when dense or masked) to its last row. Backward: every backward item runs its entries in
    tiles of ``block_m`` against each of the block's key sub-tiles; every own item runs, per query
    head of its group and per key sub-tile, the row tiles from the one holding the sub-tile's first
    key to its row end (block end, or sequence end when dense or masked).
    """
    total = 0
    group = heads // kv_heads
    for ch in index.chunks:
        if backward:
            n = (ch.bwd_items[1] - ch.bwd_items[0]).long()
            total += int(((n + block_m - 1) // block_m).sum()) * block_m * block_size
            own = np.concatenate([ch.own_items.cpu().numpy(), ch.own_items_masked.cpu().numpy()], 1)
            for start, blen, rend in zip(*own[:3].tolist()):
                for sub in range(0, blen, block_n):
                    first = (sub // block_m) * block_m
                    total += group * -(-(rend - start - first) // block_m) * block_m * block_n
        else:
            total += ch.fwd_items.shape[1] * block_m * block_size
            t = np.concatenate([ch.q_tiles.cpu().numpy(), ch.q_tiles_masked.cpu().numpy()], 1).astype(np.int64)
            keys = -(-(t[0] + block_m - t[1]) // block_n) * block_n  # from the first key row
            total += int(keys.sum()) * block_m * heads
    return total
