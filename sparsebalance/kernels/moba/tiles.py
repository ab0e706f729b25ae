"""Layout of the CPU MoBA path (``chunked.py``): which rows are causal, the block tables, the gate's
choice per sparse row, and the tiles that group (query row, head) pairs by the key block they chose.

* :func:`layout` splits a packed micro-batch. Rows of a sequence's first ``topk`` blocks attend every
  past block (a row of block ``c <= topk - 1`` has at most ``topk - 1`` of them), i.e. they are plain
  causal attention: that **prefix** (the whole sequence when ``topk >= n_blocks``) runs as one causal
  call, with no gate and no merge. Every later row (``c >= topk``, the **sparse rows**) has at least
  ``topk`` past blocks, so it chooses exactly ``n = topk - 1`` of them: its entries fill a dense
  ``[H, R, n]`` table, which is what makes the merge a gather instead of a scatter. Sparse rows are
  cut into **chunks** of whole query blocks whose gate scores and gathered tile rows stay under
  ``chunk_elements``.
* :func:`select_mask` is the gate's top-``n`` choice among past blocks with the tie-break of
  ``gate.py`` (lower block index wins). The ``n``-th largest score comes from ``numpy.partition``
  (introselect: ~6x faster than ``torch.topk`` or ``argpartition`` on rows of 32-256 blocks); rows
  where ``score >= n-th value`` does not hold for exactly ``n`` blocks (an exact tie at the ``n``-th
  value, or -inf/NaN scores) are redone by a stable descending sort, which is the rule itself.
* :func:`group` sorts a chunk's entries by (kv head, key block) -- a stable radix sort of 16-bit keys
  (numpy) where they fit -- and pads each group to whole tiles of ``TILE`` rows. It also returns each
  entry's lane (``pos``), by which the forward gathers the tile outputs back row by row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparsebalance.data.sequence import blocks
from sparsebalance.kernels.moba.gate import block_means

#: Query rows per tile (powers of two) -> relative cost of one tile row in the fused CPU kernel,
#: forward + backward against a 32-key block (this VM, one thread, D = 16, 381K rows;
#: ``benchmarks/bench_moba_tiles.py``): small tiles pay the kernel's per-tile work, large ones are
#: padded more. ``group`` picks the size that minimises padded rows x cost; forcing
#: TILE_MIN = TILE_MAX (a power of two) fixes it (tests).
TILE_COST = {32: 1.5, 64: 1.2, 128: 1.17, 256: 1.01, 512: 1.0, 1024: 0.89}
TILE_MIN, TILE_MAX = 32, 1024


@dataclass(slots=True)
class Layout:
    """Which rows are causal, where the own and key blocks are, how the sparse rows are chunked."""

    dense: list[tuple[int, int]]
    """(start, end) rows attended causally: whole dense sequences and the prefix of sparse ones."""
    own_idx: Any
    """int64 [NO * B]: packed row of each token of every own block (blocks >= topk; clamped)."""
    own_src: Any
    """int64 [m]: positions in ``own_idx`` that hold a real token (the last block may be partial)."""
    own_rows: Any
    """int64 [m]: ``own_idx[own_src]``, the packed rows of those tokens."""
    n_own: int
    """NO, own blocks of sparse rows."""
    key_idx: Any
    """int64 [NK * B]: packed row of each token of every block that can be a past block."""
    n_keys: int
    """NK, blocks 0 .. n_blocks - 2 of every sequence with sparse rows and ``topk >= 2``."""
    chunks: list[list[tuple[int, int, int, int, int]]]
    """Pieces per chunk: (sequence start, first key block in ``key_idx``, n selected, t0, t1) = sparse
    rows [t0, t1) of the sequence (whole blocks, relative to its start)."""
    dense_rows: list[tuple[int, int] | None] = field(default_factory=list)
    """Per ``dense`` entry (a, b): None when all its rows are wanted (causal attention over [a, b)),
    else rows [r0, b) (absolute; a run of consecutive wanted blocks, ``query_blocks``) that attend
    keys [a, b): causally within [r0, b), every key before r0."""
    partial: bool = False
    """Only some query blocks are wanted (``query_blocks``): rows outside them stay unset, and the
    forward zero-fills its output so that no padding row ever reads garbage."""
    memo: dict = field(default_factory=dict)
    """Index tensors that depend on the layout only (per piece: future-block mask, key offsets, packed
    row-heads), built on first use: a layout is reused by every layer of a step (``chunked.py``)."""


def _rows(starts: list[int], ends: list[int], B: int, last: int, device: Any) -> tuple[Any, Any]:
    """Rows of blocks starting at ``starts`` (clamped to ``last``) and which of them are real."""
    import torch

    idx = torch.tensor(starts, dtype=torch.int64, device=device)[:, None] + torch.arange(B, device=device)
    valid = (idx < torch.tensor(ends, dtype=torch.int64, device=device)[:, None]).reshape(-1)
    return idx.reshape(-1).clamp_(max=last), valid


def layout(cu: list[int], B: int, topks: list[int], heads: int, dim: int, device: Any,
           chunk_elements: int, query_blocks: list[tuple[int, ...]] | None = None) -> Layout:
    """``query_blocks``: per sequence the query blocks whose rows are wanted (a context-parallel
    rank's share, ``kernels/moba/cp.py``), None for all. Own blocks, gate pieces and the rows of a
    causal prefix (or of a dense sequence) cover only those."""
    dense, dense_rows, own_s, own_e, key_s, pieces = [], [], [], [], [], []

    def add_dense(a: int, b: int, want, upto: int) -> None:  # blocks < upto of [a, b), causally
        mine = [j for j in want if j < upto]
        if len(mine) == upto:
            dense.append((a, b))
            dense_rows.append(None)
            return
        # some blocks only (a CP rank's): per run of them, its rows against the keys up to its end,
        # so that a rank does its causal share of the work, not whole rows of the range
        for run in _runs(mine):
            end = min(a + (run[-1] + 1) * B, b)
            dense.append((a, end))
            dense_rows.append((a + run[0] * B, end))

    for i in range(len(cu) - 1):
        a, L = cu[i], cu[i + 1] - cu[i]
        nb, n = blocks(L, B), topks[i] - 1
        want = range(nb) if query_blocks is None else query_blocks[i]
        if not want or L == 0:
            continue
        if n + 1 >= nb:
            add_dense(a, a + L, want, nb)
            continue
        if min(want) <= n:
            add_dense(a, a + (n + 1) * B, want, n + 1)
        sparse = [j for j in want if j > n]
        own_s += [a + j * B for j in sparse]
        own_e += [a + L] * len(sparse)
        if n == 0 or not sparse:
            continue
        k0 = len(key_s)
        key_s += [a + j * B for j in range(nb - 1)]
        # per query block: gate scores (B x heads x nb) and gathered tile rows (B x heads x n x dim)
        per_block = B * heads * max(nb, n * dim)
        step = max(1, chunk_elements // per_block)
        for run in _runs(sparse):  # consecutive wanted blocks, cut into chunks of ``step``
            pieces += [(a, k0, n, c0 * B, min((c0 + step) * B, (run[-1] + 1) * B, L),
                        per_block * (min(c0 + step, run[-1] + 1) - c0)) for c0 in range(run[0], run[-1] + 1, step)]
    chunks: list[list] = []
    size = chunk_elements
    for *piece, cost in pieces:
        if size + cost > chunk_elements:
            chunks.append([])
            size = 0
        chunks[-1].append(tuple(piece))
        size += cost
    last = max(cu[-1] - 1, 0)
    own_idx, valid = _rows(own_s, own_e, B, last, device)
    own_src = valid.nonzero().squeeze(1)
    key_idx, _ = _rows(key_s, [cu[-1]] * len(key_s), B, last, device)
    return Layout(dense=dense, dense_rows=dense_rows, own_idx=own_idx, own_src=own_src, own_rows=own_idx.index_select(0, own_src),
                  n_own=len(own_s), key_idx=key_idx, n_keys=len(key_s), chunks=chunks,
                  partial=query_blocks is not None)


def _runs(js: list[int]) -> list[list[int]]:
    """Ascending ints cut into runs of consecutive ones."""
    out: list[list[int]] = []
    for j in js:
        if out and j == out[-1][-1] + 1:
            out[-1].append(j)
        else:
            out.append([j])
    return out


def choose(s: Any, n: int) -> Any:
    """Top-``n`` mask of each row of ``s`` ``[rows, nb]`` (``n < nb``), ties to the lower index."""
    import numpy as np
    import torch

    nb = s.shape[-1]
    if s.device.type == "cpu":
        kth = torch.from_numpy(np.partition(s.numpy(), nb - n, axis=-1)[:, nb - n:nb - n + 1])
    else:
        kth = torch.topk(s, n, dim=-1).values[:, -1:]
    mask = s >= kth
    bad = mask.sum(-1) != n                              # a tie at the n-th value, or -inf / NaN
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(1)
        # stable: among equal scores the lower block index comes first, i.e. wins
        idx = torch.sort(s.index_select(0, rows), dim=-1, descending=True, stable=True).indices[:, :n]
        mask[rows] = torch.zeros(rows.numel(), nb, dtype=torch.bool, device=s.device).scatter_(1, idx, True)
    return mask


def select_mask(scores: Any, past: Any, n: int) -> Any:
    """Gate choice ``[R, H, nb]`` bool: the ``n`` largest past scores per row (all past blocks when
    fewer), ties to the lower block index. ``scores`` ``[R, H, nb]``, ``past`` ``[R, nb]`` bool."""
    R, H, nb = scores.shape
    if n >= nb:
        return past[:, None, :].expand(R, H, nb).clone()
    s = scores.masked_fill(~past[:, None, :], float("-inf")).contiguous()
    # a row with fewer than n past blocks ties at -inf; the sort puts its past blocks (lower) first
    return choose(s.view(R * H, nb), n).view(R, H, nb) & past[:, None, :]


@dataclass(slots=True)
class Tiles:
    """One chunk's tiles: lane i of tile t holds packed (row * H + head) ``tab[t * TILE + i]``."""

    tab: Any
    """int64 [nt * TILE] (padded lanes hold 0: finite, never read back, no gradient)."""
    lane: Any
    """bool [nt, 1, TILE]: the lane holds a real (row, head, block) entry."""
    kv: Any
    """int64 [nt]: kv head * NK + key block of the tile (row of the block-major K/V)."""
    pos: Any
    """int64 [E]: the lane of each entry, entries in the pieces' ``[H, R, n]`` order."""
    pieces: list[tuple[int, int, int, int, int]]
    """(sequence start, t0, t1, n, first entry) of each piece of the chunk."""
    kept: Any = None
    """(q, k, v) gathered into tiles, when the forward kept them for the backward."""


def group(keys: Any, rowheads: Any, n_groups: int) -> tuple[Any, Any, Any, Any]:
    """Tile the entries: ``(tab, lane, kv, pos)`` of :class:`Tiles` from each entry's group key
    (``< n_groups``) and packed (row * H + head)."""
    import numpy as np
    import torch

    E, dev = keys.numel(), keys.device
    if n_groups <= 1 << 16 and dev.type == "cpu":  # numpy's stable sort is a radix sort on 16 bits
        perm = torch.from_numpy(np.argsort(keys.numpy().astype(np.uint16), kind="stable"))
    else:
        perm = torch.sort(keys, stable=True).indices
    ks = keys.index_select(0, perm)
    counts = torch.bincount(ks, minlength=n_groups)
    sizes = [t for t in TILE_COST if TILE_MIN <= t <= TILE_MAX] or [TILE_MIN]
    TILE = min(sizes, key=lambda t: int(((counts + t - 1) // t).sum()) * t * TILE_COST.get(t, 1.0))
    per_group = (counts + TILE - 1) // TILE
    first = torch.cumsum(counts, 0) - counts                              # first sorted entry
    tile0 = torch.cumsum(per_group, 0) - per_group
    # sorted entry i of group k is its (i - first[k])-th: lane tile0[k] * TILE + i - first[k]
    slot = (tile0 * TILE - first).index_select(0, ks) + torch.arange(E, device=dev)
    nt = int(per_group.sum())
    lane = torch.zeros(nt * TILE, dtype=torch.bool, device=dev).index_fill_(0, slot, True)
    tab = torch.zeros(nt * TILE, dtype=torch.int64, device=dev).index_copy_(0, slot, rowheads.index_select(0, perm))
    pos = torch.empty(E, dtype=torch.int64, device=dev).index_copy_(0, perm, slot)
    kv = torch.repeat_interleave(torch.arange(n_groups, device=dev), per_group)
    return tab, lane.view(nt, 1, TILE), kv, pos


def _piece_consts(memo: dict, a: int, k0: int, n: int, t0: int, t1: int, B: int, H: int, g: int,
                  n_keys: int, dev: Any) -> tuple[Any, Any, Any]:
    """(future-block mask [R, nbp], key offset [H, 1, 1], packed row-heads [H * R * n]) of a piece."""
    import torch

    if (a, t0, n) not in memo:
        R, nbp = t1 - t0, (t1 - 1) // B
        c = torch.arange(t0, t1, device=dev) // B
        future = torch.arange(nbp, device=dev)[None, :] >= c[:, None]
        key_off = ((torch.arange(H, device=dev) // g) * n_keys + k0)[:, None, None]
        rows = torch.arange(a + t0, a + t1, device=dev) * H
        rowheads = (rows[None, :] + torch.arange(H, device=dev)[:, None])[:, :, None].expand(H, R, n)
        memo[(a, t0, n)] = (future, key_off, rowheads.reshape(-1))
    return memo[(a, t0, n)]


def chunk_tiles(q: Any, k: Any, pieces, B: int, n_keys: int, memo: dict) -> Tiles:
    """Gate the chunk's sparse rows (gate-dtype ``q`` ``[T, H, D]``, ``k`` ``[T, H_kv, D]``) and tile
    the chosen (row, head, block) entries."""
    import torch

    H, hk, D = q.shape[1], k.shape[1], q.shape[2]
    g = H // hk
    dev = q.device
    keys_l, rh_l, meta, e0 = [], [], [], 0
    for a, k0, n, t0, t1 in pieces:
        R, nbp = t1 - t0, (t1 - 1) // B                   # nbp: blocks before the last row's block
        future, key_off, rowheads = _piece_consts(memo, a, k0, n, t0, t1, B, H, g, n_keys, dev)
        means = block_means(k[a:a + nbp * B], B)          # [nbp, hk, D], full blocks only
        # scores [hk, g * R, nbp] = [H, R, nbp] (head h = kv head * g + group member)
        qh = q[a + t0:a + t1].view(R, hk, g, D).permute(1, 2, 0, 3).reshape(hk, g * R, D)
        s = torch.bmm(qh, means.permute(1, 2, 0)).view(H, R, nbp).masked_fill_(future, float("-inf"))
        sel = choose(s.view(H * R, nbp), n).view(-1, nbp).nonzero()[:, 1].view(H, R, n)  # ascending
        keys_l.append((sel + key_off).view(-1))
        rh_l.append(rowheads)
        meta.append((a, t0, t1, n, e0))
        e0 += H * R * n
    keys = keys_l[0] if len(keys_l) == 1 else torch.cat(keys_l)
    rowheads = rh_l[0] if len(rh_l) == 1 else torch.cat(rh_l)
    tab, lane, kv, pos = group(keys, rowheads, hk * n_keys)
    return Tiles(tab=tab, lane=lane, kv=kv, pos=pos, pieces=meta)
