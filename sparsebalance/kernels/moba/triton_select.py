"""Block selection and the index tables of the key-block-major MoBA Triton kernels (PyTorch).

Selection follows the contract of issue 4 (``gate.py``): a query at position t of its sequence lies
in block c = t // B and, among past blocks j < c, attends the (topk - 1) with the highest gate score
s(t, j) = q_t . mean(k over block j) (all of them when c <= topk - 1); ties go to the lower index.

Tables (all int32, on q's device):

* ``sel`` [T, H, K1P]: past blocks each (token, head) chose (local block ids, ascending), -1 padded;
  K1P = next power of two >= max(topk) - 1.
* Per **chunk** of whole key blocks (query rows [row0, row1)), so that the forward's partial outputs
  (one per chosen block, ``D`` values each) stay under ``partial_bytes``:
  - ``codes``: every valid selection slot of the chunk, ``code = ((t - row0) * H + h) * K1P + s``
    (its row in the partial-output buffer), sorted by *bucket* = (global key block, kv head) and, in
    a bucket, by code: the queries that chose each key block, gathered;
  - forward items: one per ``block_m`` entries of a bucket; backward items: one per at most
    ``bwd_rows`` entries of a bucket (long buckets -- e.g. a sink block every query picks -- are
    split so no program runs for much longer than the others);
  - own-block items (backward) and query tiles (forward own block + merge) of the chunk's blocks.

A sequence whose budget covers all its blocks (topk >= n_blocks) is dense causal attention: it gets
no selection and no gathered entries; its query tiles attend every key from the sequence start
(FlashAttention-2's forward) and its key tiles take every later row of the sequence (FA-2's dK/dV
loop), in the same own-block kernels. No partial outputs are written for it.

Memory: selection runs in row chunks of about ``chunk_elems`` gate scores against the chunk's past
blocks only; index building holds O(entries of one chunk) int64 temporaries. Nothing is
O(T x n_blocks) (``benchmarks/bench_selection_memory.py`` measures the peak).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(kw_only=True, slots=True)
class MobaChunk:
    """Index tables of one chunk of query rows ``[row0, row1)`` (a run of whole key blocks)."""

    row0: int
    """First row (token) of the chunk."""
    row1: int
    """One past the last row of the chunk."""
    codes: torch.Tensor
    """int32 [n_entries]: gathered selection slots, sorted by (global key block, kv head), then code."""
    fwd_items: torch.Tensor
    """int32 [4, n_fwd]: (first entry, end entry, first key row of the block, kv head) per forward program."""
    bwd_items: torch.Tensor
    """int32 [4, n_bwd]: the same for the backward past-block programs (ranges of <= bwd_rows entries)."""
    own_items: torch.Tensor
    """int32 [4, n_own]: (block start row, block length, end of the rows that see it causally, kv head) per
    backward own-block program; the row end is the block end, or the sequence end for a dense sequence."""
    q_tiles: torch.Tensor
    """int32 [4, n_qtiles]: (first row, first key row, own block end row, slots to merge) per forward
    own+merge tile; the first key is the block start, or the sequence start for a dense sequence (0 slots)."""


@dataclass(kw_only=True, slots=True)
class MobaIndex:
    """Everything the kernels need besides q, k, v."""

    sel: torch.Tensor
    """int32 [T, H, K1P]: selected past blocks per (token, head), local block ids; -1 = none."""
    k1p: int
    """Width of ``sel`` (a power of two >= 2)."""
    k1: int
    """max(topk) - 1: slots the merge visits."""
    chunks: list[MobaChunk] = field(default_factory=list)
    """Row chunks, in order."""
    attended_pairs: int = 0
    """(query row, key) pairs attended, summed over heads (FLOP counting: 4 * D per pair forward)."""


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def select_blocks(q: torch.Tensor, k: torch.Tensor, bounds: list[int], block_size: int,
                  topks: list[int], k1p: int, *, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """Top-(k-1) past blocks per (token, head): int32 [T, H, k1p], local block ids, -1 padded.

    Uses ``gate.py`` (block means, scores, exact lower-index tie-break) on row chunks of about
    ``chunk_elems`` scores, each scored against the past blocks of its rows only.
    """
    from sparsebalance.kernels.moba import gate

    T, H, _ = q.shape
    sel = torch.full((T, H, k1p), -1, dtype=torch.int32, device=q.device)
    for s in range(len(bounds) - 1):
        s0, s1, kk = bounds[s], bounds[s + 1], topks[s] - 1
        if kk <= 0 or kk + 1 >= -(-(s1 - s0) // block_size):  # no past block, or dense: no selection
            continue
        means = gate.block_means(k[s0:s1], block_size)  # [nb, H_kv, D]
        nb = means.shape[0]
        rows = max(block_size, chunk_elems // max(1, H * nb))
        for r0 in range(s0 + block_size, s1, rows):  # block 0 has no past blocks
            r1 = min(s1, r0 + rows)
            npast = (r1 - 1 - s0) // block_size  # blocks before the chunk's last row
            scores = gate.gate_scores(q[r0:r1], means[:npast])
            past = gate.past_mask(r0 - s0, r1 - r0, npast, block_size, q.device)
            idx, valid = gate.select_topk(scores, past, kk)
            sel[r0:r1, :, :kk] = torch.where(valid, idx, -1).to(torch.int32)
    return sel


def _blocks(bounds: list[int], block_size: int, topks: list[int]) -> np.ndarray:
    """Global key blocks as int64 [6, n_blocks] (host): start row, length, first key row its queries
    see (block start, or sequence start when dense), end of the rows that see it (block end, or
    sequence end when dense), slots its queries merge, and the global id of its sequence's block 0."""
    b = np.asarray(bounds, dtype=np.int64)
    s0, s1 = b[:-1], b[1:]
    nb = -(-(s1 - s0) // block_size)
    seq = np.repeat(np.arange(len(nb)), nb)
    base = np.cumsum(nb) - nb
    c = np.arange(int(nb.sum())) - base[seq]                      # block index within its sequence
    start = s0[seq] + c * block_size
    length = np.minimum(block_size, s1[seq] - start)
    k = np.asarray(topks, dtype=np.int64)[seq]
    dense = k >= nb[seq]
    kfirst = np.where(dense, s0[seq], start)
    rend = np.where(dense, s1[seq], start + length)
    slots = np.where(dense, 0, np.minimum(k - 1, c))
    return np.stack([start, length, kfirst, rend, slots, base[seq]])


def _items(counts: torch.Tensor, ptr: torch.Tensor, per: int, blk_start: torch.Tensor, hkv: int) -> torch.Tensor:
    """(e0, e1, key start, kv head) for every run of <= ``per`` entries of every non-empty bucket."""
    nz = torch.nonzero(counts).squeeze(1)
    n_it = (counts[nz] + per - 1) // per
    bucket = nz.repeat_interleave(n_it)
    first = torch.cumsum(n_it, 0) - n_it
    j = torch.arange(bucket.numel(), device=counts.device) - first.repeat_interleave(n_it)
    e0 = ptr[bucket] + j * per
    e1 = torch.minimum(e0 + per, ptr[bucket + 1])
    return torch.stack([e0, e1, blk_start[bucket // hkv].long(), bucket % hkv]).to(torch.int32).contiguous()


def _chunk_bounds(blk_lens: list[int], row_cost: int, partial_bytes: int) -> list[tuple[int, int]]:
    """Split the global blocks into runs whose partial-output buffer stays under ``partial_bytes``
    (at least one block per run)."""
    out, first, rows = [], 0, 0
    for b, n in enumerate(blk_lens):
        if rows and (rows + n) * row_cost > partial_bytes:
            out.append((first, b))
            first, rows = b, 0
        rows += n
    out.append((first, len(blk_lens)))
    return out


def _gather(sel, row0: int, row1: int, row_base, k1p: int, H: int, G: int, n_blocks: int, blk_start,
            block_m: int, bwd_rows: int):
    """Codes of the valid selection slots of rows [row0, row1), sorted by (global key block, kv head),
    and the forward / backward item tables over them."""
    HKV = H // G
    flat = sel[row0:row1].reshape(-1)
    code = torch.nonzero(flat >= 0).squeeze(1).to(torch.int32)        # slot rows of the partial buffer
    h = (code // k1p) % H
    bucket = (row_base[row0 + code // (H * k1p)] + flat[code]) * HKV + h // G
    bucket, order = torch.sort(bucket, stable=True)
    codes = code[order].contiguous()
    counts = torch.bincount(bucket, minlength=n_blocks * HKV)
    ptr = torch.zeros(n_blocks * HKV + 1, dtype=torch.long, device=sel.device)
    ptr[1:] = torch.cumsum(counts, 0)
    return codes, _items(counts, ptr, block_m, blk_start, HKV), _items(counts, ptr, bwd_rows, blk_start, HKV)


def build_index(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                topk: torch.Tensor, block_m: int, *, bwd_rows: int = 1024,
                partial_bytes: int = 1 << 30) -> MobaIndex:
    """Selection plus the per-chunk tables for one call (see the module docstring)."""
    from sparsebalance.kernels.moba.work import attended_pairs

    dev = q.device
    _, H, D = q.shape
    HKV = k.shape[1]
    G = H // HKV
    bounds = [int(x) for x in cu_seqlens.cpu().tolist()]
    topks = [int(x) for x in topk.cpu().tolist()]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    # slots per row: the largest budget of a sequence that is not dense (dense ones have none)
    k1 = max([k - 1 for k, L in zip(topks, lengths) if k < -(-L // block_size)], default=0)
    k1p = max(2, _next_pow2(k1))
    sel = select_blocks(q, k, bounds, block_size, topks, k1p)
    blk = _blocks(bounds, block_size, topks)                           # host tables, vectorised
    start, length, kfirst, rend, slots, _ = blk
    n_blocks = blk.shape[1]
    i32 = {"dtype": torch.int32, "device": dev}
    blk_start = row_base = None
    if k1:
        blk_start = torch.tensor(start, **i32)
        # per row: global id of its sequence's block 0 (turns a local selection into a global key block)
        nb = -(-np.asarray(lengths) // block_size)
        row_base = torch.tensor(np.repeat(np.cumsum(nb) - nb, lengths), **i32)
    chunks = []
    no_items = torch.zeros((4, 0), **i32)
    for b0, b1 in _chunk_bounds(length.tolist(), H * k1p * D * q.element_size(), partial_bytes):
        row0, row1 = int(start[b0]), int(start[b1 - 1] + length[b1 - 1])
        if k1 == 0 or not bool(slots[b0:b1].any()):  # dense or no past choice: nothing to gather
            codes, fwd_items, bwd_items = torch.zeros(0, **i32), no_items, no_items
        else:
            codes, fwd_items, bwd_items = _gather(sel, row0, row1, row_base, k1p, H, G, n_blocks, blk_start,
                                                  block_m, bwd_rows)
        blocks = np.arange(b0, b1)
        own = np.stack([np.repeat(start[blocks], HKV), np.repeat(length[blocks], HKV),
                        np.repeat(rend[blocks], HKV), np.tile(np.arange(HKV), b1 - b0)])
        per = -(-length[blocks] // block_m)                            # query tiles per block
        tb = np.repeat(blocks, per)
        tile_row = start[tb] + block_m * (np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per))
        qt = np.stack([tile_row, kfirst[tb], start[tb] + length[tb], slots[tb]])
        chunks.append(MobaChunk(row0=row0, row1=row1, codes=codes, fwd_items=fwd_items, bwd_items=bwd_items,
                                own_items=torch.tensor(own, **i32), q_tiles=torch.tensor(qt, **i32)))
    return MobaIndex(sel=sel, k1p=k1p, k1=k1, chunks=chunks,
                     attended_pairs=attended_pairs(lengths, block_size, topks, H))
