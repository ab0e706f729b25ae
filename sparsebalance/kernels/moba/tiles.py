"""Layout of the CPU MoBA path (``chunked.py``): dense vs sparse sequences, block tables, the gate's
selection as a mask, and the tiles that group (query row, head) pairs by the key block they chose.

* :func:`layout` splits a packed micro-batch: sequences whose budget covers every block are dense
  (causal attention of the whole sequence); the others get a block table (row of every token of every
  block, for the own-block attention and the block-major K/V) and are cut into **chunks** of whole
  query blocks whose gate scores and gathered tile rows stay under ``chunk_elements``.
* :func:`select_mask` is the gate's top-``n`` choice among past blocks, as a boolean mask, with the
  tie-break of ``gate.py`` (lower block index wins). The ``n``-th largest score comes from
  ``numpy.partition`` (introselect: ~6x faster than ``torch.topk`` on rows of 32-128 blocks); rows
  where that value is shared by a chosen and an unchosen block (exact ties) are redone by the exact
  rule.
* :func:`chunk_tiles` gates a chunk and groups its selections: the mask viewed as
  ``[kv head, block, row, head in group]`` is read back by ``nonzero`` already grouped by
  (kv head, block), a counting sort without a sort; each group is padded to whole tiles of
  ``TILE`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparsebalance.kernels.moba.gate import block_means, gate_scores, past_mask

#: Query rows per tile: a power of two near 1/8 of the mean group size, within these bounds. Larger
#: tiles reload K/V less often in the fused kernel; smaller ones pad less (measured best on this CPU).
TILE_MIN, TILE_MAX = 32, 512


@dataclass(slots=True)
class Layout:
    """Where the sparse sequences' blocks are, which sequences are dense, how blocks are chunked."""

    dense: list[tuple[int, int]]
    """(start, end) rows of sequences attended densely (topk >= their block count)."""
    blk_idx: Any
    """int64 [NB * B]: packed row of each token of every block of the sparse sequences (clamped)."""
    own_src: Any
    """int64 [n]: positions in ``blk_idx`` that hold a real token (the last block may be partial)."""
    own_rows: Any
    """int64 [n]: ``blk_idx[own_src]``, the packed rows of those tokens."""
    n_blocks: int
    """NB, blocks of all sparse sequences."""
    chunks: list[list[tuple[int, int, int, int, int, int]]]
    """Pieces per chunk: (sequence start, length, its first global block, n selected, c0, c1) =
    query blocks [c0, c1) of one sequence."""


def layout(cu: list[int], B: int, topks: list[int], heads: int, dim: int, device: Any,
           chunk_elements: int) -> Layout:
    import torch

    dense, starts, ends, pieces = [], [], [], []
    for i in range(len(cu) - 1):
        a, L = cu[i], cu[i + 1] - cu[i]
        nb = -(-L // B)
        if topks[i] >= nb:
            dense.append((a, a + L))
            continue
        gb = len(starts)
        starts += [a + j * B for j in range(nb)]
        ends += [a + L] * nb
        n = topks[i] - 1
        if n == 0:
            continue
        # per query block: gate scores (B x heads x nb) and gathered tile rows (B x heads x n x dim)
        per_block = B * heads * max(nb, n * dim)
        step = max(1, chunk_elements // per_block)
        pieces += [(a, L, gb, n, c0, min(c0 + step, nb), per_block * (min(c0 + step, nb) - c0))
                   for c0 in range(1, nb, step)]  # block 0 has no past block
    chunks: list[list] = []
    size = chunk_elements
    for *piece, cost in pieces:
        if size + cost > chunk_elements:
            chunks.append([])
            size = 0
        chunks[-1].append(tuple(piece))
        size += cost
    idx = torch.tensor(starts, dtype=torch.int64, device=device)[:, None] + torch.arange(B, device=device)
    valid = (idx < torch.tensor(ends, dtype=torch.int64, device=device)[:, None]).reshape(-1)
    idx = idx.reshape(-1).clamp_(max=max(cu[-1] - 1, 0))
    own_src = valid.nonzero().squeeze(1)
    return Layout(dense=dense, blk_idx=idx, own_src=own_src, own_rows=idx.index_select(0, own_src),
                  n_blocks=len(starts), chunks=chunks)


def select_mask(scores: Any, past: Any, n: int) -> Any:
    """Gate choice ``[R, H, nb]`` bool: the ``n`` largest past scores per row (all past blocks when
    fewer), ties to the lower block index. ``scores`` ``[R, H, nb]``, ``past`` ``[R, nb]`` bool."""
    import numpy as np
    import torch

    R, H, nb = scores.shape
    s = scores.masked_fill(~past[:, None, :], float("-inf")).contiguous()
    if n >= nb:
        return past[:, None, :].expand(R, H, nb).clone()
    if s.device.type == "cpu":
        kth = torch.from_numpy(np.partition(s.numpy(), nb - n, axis=-1)[..., nb - n:nb - n + 1])
    else:
        kth = torch.topk(s, n, dim=-1).values[..., -1:]
    # rows with fewer than n past blocks have kth = -inf: every past block is chosen
    mask = (s >= kth) & past[:, None, :]
    ambiguous = mask.sum(-1) > n                                    # a tie at the n-th value
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero(as_tuple=True)
        sub, kv = s[rows], kth[rows]
        above, equal = sub > kv, sub == kv
        need = n - above.sum(-1, keepdim=True)
        mask[rows] = above | (equal & (torch.cumsum(equal, dim=-1) <= need))
    return mask


@dataclass(slots=True)
class Tiles:
    """One chunk's tiles: ``rows[t, i]`` = packed (row * H + head) of lane i of tile t."""

    rows: Any
    """int64 [nt * TILE] (padded lanes repeat a real entry of their group)."""
    lane: Any
    """bool [nt, 1, TILE]: the lane holds a real (row, head, block) entry."""
    kv: Any
    """int64 [nt]: kv head * NB + global block of the tile (row of the block-major K/V)."""
    q: Any = None
    """The gathered queries [nt, 1, tile, D] when the forward kept them for the backward."""


def chunk_tiles(q: Any, k: Any, pieces, B: int, n_blocks: int) -> Tiles | None:
    """Gate the chunk's query blocks and group the selected (row, head) pairs into tiles."""
    import torch

    H, hk = q.shape[1], k.shape[1]
    g = H // hk
    rows_l, kv_l = [], []
    for a, L, gb, n, c0, c1 in pieces:
        nb = -(-L // B)
        means = block_means(k[a:a + L], B)                                 # [nb, hk, D]
        t0, t1 = c0 * B, min(c1 * B, L)
        s = gate_scores(q[a + t0:a + t1], means)                          # [R, H, nb]
        sel = select_mask(s, past_mask(t0, t1 - t0, nb, B, q.device), n)
        # [R, hk, g, nb] -> [hk, nb, R, g]: nonzero lists entries grouped by (kv head, block)
        kh, j, r, h = sel.view(t1 - t0, hk, g, nb).permute(1, 3, 0, 2).nonzero().unbind(1)
        rows_l.append((a + t0 + r) * H + kh * g + h)
        kv_l.append(kh * n_blocks + gb + j)
    rows, kv = torch.cat(rows_l), torch.cat(kv_l)
    E = rows.numel()
    if E == 0:
        return None
    change = torch.ones(E, dtype=torch.bool, device=q.device)
    change[1:] = kv[1:] != kv[:-1]
    starts = change.nonzero().squeeze(1)                                  # first entry of each group
    counts = torch.diff(starts, append=starts.new_tensor([E]))
    gid = torch.cumsum(change, 0) - 1
    pos = torch.arange(E, device=q.device) - starts.index_select(0, gid)
    TILE = min(TILE_MAX, max(TILE_MIN, 1 << max(0, (E // (8 * starts.numel())).bit_length() - 1)))
    per_group = (counts + TILE - 1) // TILE
    tile0 = torch.cumsum(per_group, 0) - per_group
    slot = (tile0.index_select(0, gid) + pos // TILE) * TILE + pos % TILE
    nt = int(per_group.sum())
    lane = torch.zeros(nt * TILE, dtype=torch.bool, device=q.device)
    lane[slot] = True
    # padded lanes repeat their group's first entry (finite, weighted out); real lanes their own
    table = rows.index_select(0, torch.repeat_interleave(starts, per_group)).repeat_interleave(TILE)
    table[slot] = rows
    return Tiles(rows=table, lane=lane.view(nt, 1, TILE),
                 kv=torch.repeat_interleave(kv.index_select(0, starts), per_group))
