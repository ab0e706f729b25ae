"""Work the MoBA Triton kernels execute, counted from a call's plan tables (no kernel run).

Executed work = (query row, key) pairs that pass through a ``tl.dot`` -- tile rows x tile keys per
tile visited, masked or not -- summed over query heads. Attended work = the (query, key) pairs MoBA
semantics attends (own block causally plus the chosen past blocks). Their ratio says how much of
the kernel's arithmetic is wasted on masked entries.

Two decompositions are counted:

* ``union`` -- the query-tile-major kernel of commit 301d238 (replaced): a tile of ``block_m`` rows
  looped over the *union* of the past blocks its rows selected, each a full key block, plus its own
  block causally in ``block_n`` key tiles. Kept here only to report the before/after ratio; it is
  recomputed from a selection table ``sel`` exactly as that kernel's index builder did.
* the shipped key-block-major kernels (:func:`executed`): per (key block, kv head) bucket the
  (query, head) rows that chose the block, in tiles against the whole block; the own blocks per
  query tile (forward, dQ) and per key sub-tile (dK/dV), causally -- from the plan's tables and the
  entries per (bucket, chunk), which :func:`bucket_counts` takes from a selection (``gate.py`` in
  PyTorch: no Triton needed) or an index's ``ptr``.
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


def selection(q: Any, k: Any, bounds: list[int], block_size: int, topks: list[int], k1p: int) -> Any:
    """The gate's choice as the kernels' ``sel`` table (int32 [T, H, k1p], ascending, -1 padded), by
    ``gate.select_blocks`` in PyTorch (sequences with k >= n blocks: none)."""
    import torch

    from sparsebalance.kernels.moba import gate

    sel = torch.full((q.shape[0], q.shape[1], k1p), -1, dtype=torch.int32)
    for s0, s1, kk in zip(bounds[:-1], bounds[1:], topks):
        if 1 < kk < blocks(s1 - s0, block_size):
            idx, valid = gate.select_blocks(q[s0:s1], k[s0:s1], block_size, kk)
            sel[s0:s1, :, :kk - 1] = torch.where(valid, idx, -1).int()
    return sel


def bucket_counts(plan: Any, sel: Any = None, index: Any = None) -> np.ndarray:
    """Entries per (bucket, forward chunk) [n_blocks x H_kv, chunks] of a call: from its selection
    table ``sel`` (the rows of its sparse sequences) or from an ``index`` (its ``ptr``)."""
    from sparsebalance.kernels.moba.plan import SPARSE

    nbk = plan.n_blocks * plan.HKV
    out = np.zeros((nbk, plan.nc), dtype=np.int64)
    if index is not None:
        return np.diff(index.ptr.cpu().numpy()).reshape(nbk, plan.nc) if plan.entries else out
    s = sel.cpu().numpy().astype(np.int64)
    starts = np.array([c.row0 for c in plan.chunks])
    G = plan.H // plan.HKV
    for s0, L, base, _, kind in plan.sel_seqs:
        if kind == SPARSE:
            part = s[s0:s0 + L]
            t, h, slot = np.nonzero(part >= 0)
            b = (base + part[t, h, slot]) * plan.HKV + h // G
            np.add.at(out, (b, np.searchsorted(starts, s0 + t, side="right") - 1), 1)
    return out


def executed(plan: Any, counts: np.ndarray) -> dict[str, int]:
    """Executed pairs of the forward (``fwd``: past items + own query tiles), of the dK/dV kernel
    (``kv``: own pieces + gathered pieces) and of the dQ kernels (``dq``: own query tiles + the
    forward's items), from the plan's tables and the entries per (bucket, chunk)."""
    B, H = plan.block, plan.H
    fp, om, kv, dqo = (plan.cfg[n] for n in ("fwd_past", "fwd_own_merge", "bwd_kv", "bwd_dq_own"))
    items = int((-(-counts // fp.block_m)).sum())
    past = items * fp.block_m * B
    tiles = np.concatenate([np.concatenate([c.q_tiles.cpu().numpy(), c.q_tiles_masked.cpu().numpy()], 1)
                            for c in plan.chunks], 1).astype(np.int64)

    def own(cfg):
        return int((-(-(tiles[0] + cfg.block_m - tiles[1]) // cfg.block_n) * cfg.block_n).sum()) * cfg.block_m * H

    pieces = np.concatenate([plan.dev["own"].cpu().numpy(), plan.dev["own_masked"].cpu().numpy()], 1).astype(np.int64)
    kv_own = int(((pieces[6] - pieces[5]) * -(-(pieces[4] - pieces[3]) // kv.block_m)).sum()) * kv.block_m * kv.block_n
    per_bucket, piece = counts.sum(1), plan.bwd_entries
    full, rest = per_bucket // piece, per_bucket % piece
    kv_past = int((full * -(-piece // kv.block_m) + -(-rest // kv.block_m)).sum()) * kv.block_m * B
    return {"fwd": past + own(om), "kv": kv_own + kv_past, "dq": past + own(dqo)}
