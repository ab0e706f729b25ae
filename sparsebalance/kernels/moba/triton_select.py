"""Block selection and the index tables the MoBA Triton kernels iterate (PyTorch, runs on any device).

Selection follows the contract of issue 4: a query at position t of its sequence lies in block
c = t // B and, among past blocks j < c, attends the (topk - 1) with the highest gate score
s(t, j) = q_t . mean(k over block j) (all of them when c <= topk - 1). Ties go to the lower block
index: selection is ``gate.py``'s, shared with the other implementations.

The kernels work on *query tiles* of ``block_m`` rows (a divisor of B, aligned to the sequence start,
so a tile never straddles a block or a sequence) and *key tiles* of ``block_n`` rows inside one key
block. This module builds, once per call:

* ``sel``     int32 [T, H, K1P]: the past blocks each (token, head) selected (block index within its
  sequence), padded with -1; K1P = next power of two >= max(topk) - 1.
* ``union``   int32 [n_qtiles, H, U]: per (query tile, head), the sorted union of its rows' past
  blocks (the forward and dq kernels loop over it), with ``ucount`` int32 [n_qtiles, H].
* the inverse index (dk/dv): for each (global key block, kv head), the (query tile, head) pairs
  that attend it, own block included, as CSR ``inv_ptr`` / ``inv_tile`` / ``inv_head``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class MobaIndex:
    """Everything the kernels need besides q, k, v. All tensors live on the device of q."""

    sel: torch.Tensor
    """int32 [T, H, K1P]: selected past blocks per (token, head), block index within the sequence; -1 = none."""
    k1p: int
    """Width of ``sel`` (a power of two >= 2)."""
    qt_start: torch.Tensor
    """int32 [n_qtiles]: first token (global row) of each query tile."""
    qt_seq_start: torch.Tensor
    """int32 [n_qtiles]: first token of the tile's sequence."""
    qt_seq_end: torch.Tensor
    """int32 [n_qtiles]: one past the last token of the tile's sequence."""
    qt_gblock: torch.Tensor
    """int32 [n_qtiles]: global id of the key block the tile lies in (its own block)."""
    union: torch.Tensor
    """int32 [n_qtiles, H, U]: sorted union of past blocks selected by the tile's rows (local ids)."""
    ucount: torch.Tensor
    """int32 [n_qtiles, H]: valid entries of ``union``."""
    kt_start: torch.Tensor
    """int32 [n_ktiles]: first token of each key tile (``block_n`` rows inside one key block)."""
    kt_gblock: torch.Tensor
    """int32 [n_ktiles]: global block id of each key tile."""
    kt_seq_end: torch.Tensor
    """int32 [n_ktiles]: one past the last token of the key tile's sequence."""
    inv_ptr: torch.Tensor
    """int32 [n_blocks * H_kv + 1]: CSR offsets of (global block, kv head) into ``inv_tile``/``inv_head``."""
    inv_tile: torch.Tensor
    """int32 [n_entries]: query tile of each inverse-index entry."""
    inv_head: torch.Tensor
    """int32 [n_entries]: query head of each inverse-index entry."""
    attended_pairs: int
    """Number of (query row, key) pairs attended, summed over heads (FLOP counting: 4 * D per pair fwd)."""


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def select_blocks(q: torch.Tensor, k: torch.Tensor, bounds: list[int], block_size: int,
                  topks: list[int], k1p: int, *, chunk_elems: int = 1 << 26) -> torch.Tensor:
    """Top-(k-1) past blocks per (token, head): int32 [T, H, k1p], local block ids, -1 padded.

    q: [T, H, D], k: [T, H_kv, D]; ``bounds`` = cu_seqlens as a list; ``topks`` one budget per sequence.
    Uses ``gate.py`` (block means, scores, exact lower-index tie-break) in row chunks of about
    ``chunk_elems`` scores, so memory stays bounded at 128K tokens.
    """
    from sparsebalance.kernels.moba import gate

    T, H, _ = q.shape
    sel = torch.full((T, H, k1p), -1, dtype=torch.int32, device=q.device)
    for s in range(len(bounds) - 1):
        s0, s1, kk = bounds[s], bounds[s + 1], topks[s] - 1
        if kk <= 0 or s1 - s0 <= block_size:
            continue
        means = gate.block_means(k[s0:s1], block_size)  # [nb, H_kv, D]
        nb = means.shape[0]
        rows = max(1, chunk_elems // max(1, H * nb))
        for r0 in range(s0 + block_size, s1, rows):  # block 0 has no past blocks
            r1 = min(s1, r0 + rows)
            scores = gate.gate_scores(q[r0:r1], means)
            past = gate.past_mask(r0 - s0, r1 - r0, nb, block_size, q.device)
            idx, valid = gate.select_topk(scores, past, kk)
            sel[r0:r1, :, :kk] = torch.where(valid, idx, -1).to(torch.int32)
    return sel


def build_index(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                topk: torch.Tensor, block_m: int, block_n: int) -> MobaIndex:
    """Selection plus the tile tables and inverse index for one call (see the module docstring)."""
    dev = q.device
    T, H, _ = q.shape
    HKV = k.shape[1]
    G = H // HKV
    bounds = [int(x) for x in cu_seqlens.cpu().tolist()]
    topks = [int(x) for x in topk.cpu().tolist()]
    k1p = max(2, _next_pow2(max(topks) - 1))
    sel = select_blocks(q, k, bounds, block_size, topks, k1p)

    qt_start, qt_s0, qt_s1, qt_gb, kt_start, kt_gb, kt_s1 = ([] for _ in range(7))
    gb0 = 0
    attended = 0
    for s in range(len(bounds) - 1):
        s0, s1 = bounds[s], bounds[s + 1]
        L = s1 - s0
        nb = -(-L // block_size)
        for t in range(s0, s1, block_m):
            qt_start.append(t); qt_s0.append(s0); qt_s1.append(s1); qt_gb.append(gb0 + (t - s0) // block_size)
        for t in range(s0, s1, block_n):
            kt_start.append(t); kt_gb.append(gb0 + (t - s0) // block_size); kt_s1.append(s1)
        # attended pairs per head: own block causal + (min(topk-1, c)) full past blocks per row
        pos = torch.arange(L)
        c = pos // block_size
        attended += int(((pos % block_size) + 1 + torch.clamp(c, max=topks[s] - 1) * block_size).sum()) * H
        gb0 += nb
    n_blocks = gb0
    i32 = {"dtype": torch.int32, "device": dev}
    qt_start_t = torch.tensor(qt_start, **i32)
    nq = len(qt_start)

    # union of the tile rows' selections, per (tile, head): scatter into a per-tile block bitmap
    nbmax = max(1, max(-(-(bounds[s + 1] - bounds[s]) // block_size) for s in range(len(bounds) - 1)))
    rows = qt_start_t.long()[:, None] + torch.arange(block_m, device=dev)[None, :]
    ends = torch.tensor(qt_s1, dtype=torch.long, device=dev)[:, None]
    rows = torch.where(rows < ends, rows, torch.full_like(rows, T))  # T -> padding row of -1
    sel_pad = torch.cat([sel, torch.full((1, H, k1p), -1, dtype=torch.int32, device=dev)])
    tsel = sel_pad[rows].permute(0, 2, 1, 3).reshape(nq, H, block_m * k1p).long()  # [nq, H, BM*K1P]
    tsel = torch.where(tsel >= 0, tsel, torch.full_like(tsel, nbmax))
    bitmap = torch.zeros(nq, H, nbmax + 1, dtype=torch.bool, device=dev)
    bitmap.scatter_(2, tsel, True)
    bitmap = bitmap[..., :nbmax]
    ucount = bitmap.sum(-1)
    U = max(1, int(ucount.max()))
    pos = torch.cumsum(bitmap, -1) - 1
    pos = torch.where(bitmap, pos, torch.full_like(pos, U))
    union = torch.zeros(nq, H, U + 1, dtype=torch.long, device=dev)
    union.scatter_(2, pos, torch.arange(nbmax, device=dev).expand(nq, H, nbmax).contiguous())
    union = union[..., :U]

    # inverse index: (global key block, kv head) -> [(query tile, head)], own block included
    qt_gb_t = torch.tensor(qt_gb, dtype=torch.long, device=dev)
    blk_base = qt_gb_t - (qt_start_t.long() - torch.tensor(qt_s0, dtype=torch.long, device=dev)) // block_size
    tile_ids = torch.arange(nq, device=dev)[:, None, None].expand(nq, H, U)
    head_ids = torch.arange(H, device=dev)[None, :, None].expand(nq, H, U)
    valid = torch.arange(U, device=dev)[None, None, :] < ucount[..., None]
    e_tile = torch.cat([tile_ids[valid], torch.arange(nq, device=dev).repeat_interleave(H)])
    e_head = torch.cat([head_ids[valid], torch.arange(H, device=dev).repeat(nq)])
    e_gb = torch.cat([(blk_base[:, None, None] + union)[valid], qt_gb_t.repeat_interleave(H)])
    key = e_gb * HKV + e_head // G
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=n_blocks * HKV)
    inv_ptr = torch.zeros(n_blocks * HKV + 1, dtype=torch.long, device=dev)
    inv_ptr[1:] = torch.cumsum(counts, 0)

    return MobaIndex(
        sel=sel, k1p=k1p, qt_start=qt_start_t, qt_seq_start=torch.tensor(qt_s0, **i32),
        qt_seq_end=torch.tensor(qt_s1, **i32), qt_gblock=qt_gb_t.to(torch.int32),
        union=union.to(torch.int32).contiguous(), ucount=ucount.to(torch.int32).contiguous(),
        kt_start=torch.tensor(kt_start, **i32), kt_gblock=torch.tensor(kt_gb, **i32),
        kt_seq_end=torch.tensor(kt_s1, **i32), inv_ptr=inv_ptr.to(torch.int32),
        inv_tile=e_tile[order].to(torch.int32).contiguous(), inv_head=e_head[order].to(torch.int32).contiguous(),
        attended_pairs=attended,
    )
