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

A sparse sequence the dispatcher puts on the **masked dense path** (``masked[i]``; the rule is
``simulator.cost.kernelcost.choose_path``) runs those same dense loops, but every (row, key tile) pair
is masked by the row's selection: ``bits`` [T, H, W] int32 holds, per (token, head), one bit per
local block (its chosen past blocks and its own block), W = ceil(n_blocks / 32) of the longest
masked sequence. Its selection is computed as usual, turned into bits, and then cleared from ``sel``
so nothing of it is gathered; its tiles go to separate tables (``*_masked``, launched with the
kernels' MASKED variant) and carry the sequence start in their last row (-1 in the other tables).

Memory: selection runs in row chunks of about ``chunk_elems`` gate scores against the chunk's past
blocks only; index building holds O(entries of one chunk) int64 temporaries. Nothing is
O(T x n_blocks) (``benchmarks/bench_selection_memory.py`` measures the peak).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsebalance.data.sequence import blocks


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
    """int32 [5, n_own]: (block start row, block length, end of the rows that see it causally, kv head,
    mask start) per backward own-block program; the row end is the block end, or the sequence end for a
    dense or masked sequence; mask start is the sequence start on the masked dense path, else -1."""
    q_tiles: torch.Tensor
    """int32 [5, n_qtiles]: (first row, first key row, own block end row, slots to merge, mask start) per
    forward own+merge tile; the first key is the block start, or the sequence start for a dense or masked
    sequence (0 slots); mask start as in ``own_items``."""
    own_items_masked: torch.Tensor
    """``own_items`` of the masked-path blocks (launched apart, by the MASKED variant of the kernel)."""
    q_tiles_masked: torch.Tensor
    """``q_tiles`` of the masked-path blocks (launched apart: the MASKED variant has no merge loop)."""


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
    bits: torch.Tensor | None = None
    """int32 [T, H, W]: per (token, head) the blocks a masked-path row attends (bit j of word j // 32,
    own block included); None when no sequence is on the masked path."""
    words: int = 1
    """W, the words per (token, head) row of ``bits``."""
    masked: list[bool] = field(default_factory=list)
    """Per sequence: on the masked dense path (True) or not (key-block-major or dense)."""


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
        if kk <= 0 or kk + 1 >= blocks(s1 - s0, block_size):  # no past block, or dense: no selection
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


def _blocks(bounds: list[int], block_size: int, topks: list[int], masked: list[bool]) -> np.ndarray:
    """Global key blocks as int64 [7, n_blocks] (host): start row, length, first key row its queries
    see (block start, or sequence start when dense or masked), end of the rows that see it (block end,
    or sequence end when dense or masked), slots its queries merge, the global id of its sequence's
    block 0, and the mask start (sequence start when masked, else -1)."""
    b = np.asarray(bounds, dtype=np.int64)
    s0, s1 = b[:-1], b[1:]
    nb = blocks(s1 - s0, block_size)
    seq = np.repeat(np.arange(len(nb)), nb)
    base = np.cumsum(nb) - nb
    c = np.arange(int(nb.sum())) - base[seq]                      # block index within its sequence
    start = s0[seq] + c * block_size
    length = np.minimum(block_size, s1[seq] - start)
    k = np.asarray(topks, dtype=np.int64)[seq]
    mk = np.asarray(masked, dtype=bool)[seq] & (k < nb[seq])
    dense = (k >= nb[seq]) | mk                                  # the dense loops (masked or not)
    kfirst = np.where(dense, s0[seq], start)
    rend = np.where(dense, s1[seq], start + length)
    slots = np.where(dense, 0, np.minimum(k - 1, c))
    return np.stack([start, length, kfirst, rend, slots, base[seq], np.where(mk, s0[seq], -1)])


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
    (at least one block per run). ``blk_lens`` counts the rows that need partial slots (0 for the
    blocks of dense and masked sequences, which write none)."""
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


def selection_bits(sel: torch.Tensor, s0: int, s1: int, block_size: int, words: int, out: torch.Tensor,
                   *, chunk_elems: int = 1 << 24) -> None:
    """Write the blocks rows [s0, s1) attend into ``out[s0:s1]`` (int32 [T, H, words]): bit j % 32 of
    word j // 32 for each chosen past block j of ``sel`` and for the row's own block.

    int32 throughout; a row's blocks are distinct, so a scatter-add of their bits is their OR (bit 31
    is the sign bit: -2^31 plus distinct lower bits never overflows). Word w goes to column w + 1 of
    the accumulator, so an empty slot (-1: (-1 + 32) >> 5 = 0) lands in a column that is dropped --
    no validity mask. Row chunks of about ``chunk_elems`` slots bound the temporaries."""
    H, k1p = sel.shape[1], sel.shape[2]
    rows = max(1, chunk_elems // (H * k1p))
    for r0 in range(s0, s1, rows):
        r1 = min(s1, r0 + rows)
        acc = torch.zeros((r1 - r0, H, words + 1), dtype=torch.int32, device=sel.device)
        s = sel[r0:r1]
        acc.scatter_add_(2, ((s + 32) >> 5).long(), 1 << (s & 31))
        own = torch.arange(r0 - s0, r1 - s0, device=sel.device, dtype=torch.int32) // block_size
        shape = (r1 - r0, H, 1)
        acc.scatter_add_(2, ((own >> 5) + 1).long().view(-1, 1, 1).expand(shape),
                         (1 << (own & 31)).view(-1, 1, 1).expand(shape))
        out[r0:r1] = acc[:, :, 1:]


def build_index(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                topk: torch.Tensor, block_m: int, *, bwd_rows: int = 1024,
                partial_bytes: int = 1 << 30, masked: list[bool] | None = None) -> MobaIndex:
    """Selection plus the per-chunk tables for one call (see the module docstring). ``masked``: per
    sequence, run it on the masked dense path (ignored for dense sequences); default none."""
    from sparsebalance.kernels.moba.work import attended_pairs

    dev = q.device
    _, H, D = q.shape
    HKV = k.shape[1]
    G = H // HKV
    bounds = [int(x) for x in cu_seqlens.cpu().tolist()]
    topks = [int(x) for x in topk.cpu().tolist()]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    nbs = [blocks(L, block_size) for L in lengths]
    masked = [bool(m) and k < n for m, k, n in zip(masked or [False] * len(lengths), topks, nbs)]
    # slots per row: the largest budget of a sequence that is not dense (dense ones have none)
    k1 = max([k - 1 for k, n in zip(topks, nbs) if k < n], default=0)
    k1p = max(2, _next_pow2(k1))
    sel = select_blocks(q, k, bounds, block_size, topks, k1p)
    words = max([-(-n // 32) for n, m in zip(nbs, masked) if m], default=1)
    bits = None
    if any(masked):
        bits = torch.zeros((q.shape[0], H, words), dtype=torch.int32, device=dev)
        for i in np.flatnonzero(masked).tolist():
            selection_bits(sel, bounds[i], bounds[i + 1], block_size, words, bits)
            sel[bounds[i]:bounds[i + 1]] = -1                          # nothing of it is gathered
    if not any(k < n and not m for k, n, m in zip(topks, nbs, masked)):
        k1 = 0                                                         # no partials to merge anywhere
    blk = _blocks(bounds, block_size, topks, masked)                   # host tables, vectorised
    start, length, kfirst, rend, slots, _, mstart = blk
    n_blocks = blk.shape[1]
    i32 = {"dtype": torch.int32, "device": dev}
    blk_start = row_base = None
    if k1:
        blk_start = torch.tensor(start, **i32)
        # per row: global id of its sequence's block 0 (turns a local selection into a global key block)
        nb = np.asarray(nbs)
        row_base = torch.tensor(np.repeat(np.cumsum(nb) - nb, lengths), **i32)
    chunks = []
    no_items = torch.zeros((5, 0), **i32)                              # every empty table
    gathers = np.repeat([k < n and not m for k, n, m in zip(topks, nbs, masked)], nbs)
    for b0, b1 in _chunk_bounds(np.where(gathers, length, 0).tolist(), H * k1p * D * q.element_size(),
                                partial_bytes):
        row0, row1 = int(start[b0]), int(start[b1 - 1] + length[b1 - 1])
        if k1 == 0 or not bool(slots[b0:b1].any()):  # dense, masked or no past choice: nothing to gather
            codes, fwd_items, bwd_items = torch.zeros(0, **i32), no_items, no_items
        else:
            codes, fwd_items, bwd_items = _gather(sel, row0, row1, row_base, k1p, H, G, n_blocks, blk_start,
                                                  block_m, bwd_rows)
        ids = np.arange(b0, b1)
        own = np.stack([np.repeat(start[ids], HKV), np.repeat(length[ids], HKV),
                        np.repeat(rend[ids], HKV), np.tile(np.arange(HKV), b1 - b0),
                        np.repeat(mstart[ids], HKV)])
        per = -(-length[ids] // block_m)                            # query tiles per block
        tb = np.repeat(ids, per)
        tile_row = start[tb] + block_m * (np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per))
        qt = np.stack([tile_row, kfirst[tb], start[tb] + length[tb], slots[tb], mstart[tb]])
        om, tm = own[4] >= 0, qt[4] >= 0

        def table(a):  # boolean column selection can leave numpy column-major; kernels need row-major
            return torch.tensor(np.ascontiguousarray(a), **i32) if a.shape[1] else no_items

        chunks.append(MobaChunk(row0=row0, row1=row1, codes=codes, fwd_items=fwd_items, bwd_items=bwd_items,
                                own_items=table(own[:, ~om]), q_tiles=table(qt[:, ~tm]),
                                own_items_masked=table(own[:, om]), q_tiles_masked=table(qt[:, tm])))
    return MobaIndex(sel=sel, k1p=k1p, k1=k1, chunks=chunks,
                     attended_pairs=attended_pairs(lengths, block_size, topks, H),
                     bits=bits, words=words, masked=masked)
