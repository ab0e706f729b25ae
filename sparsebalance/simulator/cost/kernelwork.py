"""Executed work of the MoBA kernel we ship (``kernels/moba/``), one sequence, one layer: the pairs each
kernel family multiplies, the gathered entries and buckets -- the counts ``kernelcost.py`` prices.

Executed (row, key) pairs are counted as the kernels tile them: exact for the own loops (query-major
forward and dQ, key-major dK/dV), expected for the gathered tiles (each non-empty bucket pads its last
tile by (rows - 1) / 2 on average; every past block is assumed chosen by some row). Tested against
brute-force loops (``tests/simulator/test_kernelcost.py``) and real plan tables
(``tests/kernels/test_kernelcost_counts.py``). All functions broadcast over numpy arrays of lengths and
budgets; ``heads``/``kv_heads`` are per tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.errors import check

DENSE, SPARSE, MASKED = 0, 1, 2
"""Path codes: dense (k >= n), sparse (key-block-major), masked (dense loops under the selection)."""
PATHS = ("dense", "sparse", "masked")

# Launch configuration of the shipped kernel at head dim 128 (kernels/moba/launch.py CHOSEN and the caps of
# triton_impl.py / plan.py), mirrored because simulator/ may not import kernels/;
# tests/kernels/test_kernelcost_counts.py asserts they agree.
FWD_TILE = (64, 32)   # fwd_past and bwd_dq_past: gathered entries per item, keys per step
OWN_TILE = (64, 32)   # fwd_own_merge and bwd_dq_own: query rows per tile, keys per step
KV_TILE = (32, 64)    # bwd_kv: rows per step, keys of the owned sub-tile
PARTIAL_BYTES = 1 << 30


@dataclass(kw_only=True, slots=True, frozen=True)
class Shape:
    """Attention dimensions on one tensor-parallel rank."""

    heads: int
    """Query heads on this rank."""
    kv_heads: int
    """Key/value heads on this rank (replicated when the model has fewer than the TP degree)."""
    head_dim: int
    """Head dimension."""
    block: int
    """MoBA block size."""
    dtype_bytes: int = 2
    """Bytes per q/k/v element (2 for bf16)."""

    def __post_init__(self) -> None:
        check(self.block >= 16 and self.block & (self.block - 1) == 0, "block", "must be a power of two >= 16")


def _tile(tile: tuple[int, int], block: int) -> tuple[int, int]:
    return min(tile[0], block), min(tile[1], block)


def _tri(t):
    return t * (t + 1) // 2


def _segments(L, k, block: int, dense):
    """(segments, tokens per full segment, tokens of the last): every block (sparse), or the whole
    sequence as one segment (``dense``: dense and masked loops)."""
    n = blocks(L, block)
    return np.where(dense, 1, n), np.where(dense, L, block), np.where(dense, L, L - (n - 1) * block)


def own_pairs(L, k, block: int, dense=None):
    """Executed pairs per query head of the query-major own loops (forward own + merge, backward dQ):
    query tiles of ``bm`` rows over each segment, key tiles of ``bn`` (bn divides bm) up to the
    tile's last row: bm^2 t (t + 1) / 2 per segment of t = ceil(len / bm) tiles. ``dense``: the
    whole sequence is one segment (default: k >= n)."""
    L, k = np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64)
    dense = k >= blocks(L, block) if dense is None else dense
    bm, _ = _tile(OWN_TILE, block)
    segs, full, last = _segments(L, k, block, dense)
    return bm * bm * ((segs - 1) * _tri(-(-full // bm)) + _tri(-(-last // bm)))


def kv_own_pairs(L, k, block: int, dense=None):
    """Executed pairs per query head of the kv kernel's own pieces: key sub-tiles of ``bn`` keys, each
    over the row tiles of ``bm`` (bm divides bn) from its first key to the segment end. A segment of
    S sub-tiles whose last holds r keys: bn^2 S (S - 1) / 2 + S bn bm ceil(r / bm)."""
    L, k = np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64)
    dense = k >= blocks(L, block) if dense is None else dense
    bm, bn = _tile(KV_TILE, block)
    segs, full, last = _segments(L, k, block, dense)

    def seg(len_):
        S = -(-len_ // bn)
        r = len_ - (S - 1) * bn
        return bn * bn * S * (S - 1) // 2 + S * bn * bm * -(-r // bm)
    return (segs - 1) * seg(full) + seg(last)


def past_attended(L, k, block: int):
    """Attended pairs per query head in chosen past blocks: block x sum over rows of min(k - 1, c)."""
    L, k = np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64)
    n = blocks(L, block)
    r = L - (n - 1) * block
    a = np.maximum(k - 1, 0)
    m = n - 1                                                 # full blocks before the last
    t = np.minimum(a, np.maximum(m - 1, 0))
    full = t * (t + 1) // 2 + t * (m - 1 - t)                 # blocks c = 1..m-1: sum of min(a, c)
    rows = block * full + r * np.minimum(a, m)                 # sum over rows of min(k - 1, c)
    return np.where(k >= n, 0, block * rows)


def forward_chunks(L, k, s: Shape):
    """(forward chunks, blocks per chunk, k1p): runs of whole blocks whose partial buffer (rows x H x
    k1p x D values) stays under PARTIAL_BYTES."""
    L, k = np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64)
    n = blocks(L, s.block)
    k1p = np.maximum(2, 2 ** np.ceil(np.log2(np.maximum(k - 1, 1))).astype(np.int64))
    per = np.maximum(1, PARTIAL_BYTES // (s.block * s.heads * k1p * s.head_dim * s.dtype_bytes))
    return np.where(k >= n, 1, -(-n // per)), per, k1p


def _bucket_chunks(n, chunks, per):
    """(chunk, available past block) pairs: sum over chunks i of min(n - 1, (i + 1) per - 1)."""
    n, chunks = np.asarray(n), np.asarray(chunks)
    i = np.arange(int(np.max(chunks))).reshape(-1, *[1] * n.ndim)
    avail = np.minimum(n - 1, (i + 1) * per - 1)
    return np.where(i < chunks, np.maximum(avail, 0), 0).sum(axis=0)


def default_path(L, k, block: int):
    """The path without a choice: dense at k >= n, sparse below."""
    L, k = np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64)
    return np.where(k >= blocks(L, block), DENSE, SPARSE)


def _path(L, k, block: int, path):
    """Path codes broadcast to (L, k): ``None`` -> :func:`default_path`; a name or code for k < n (a
    budget k >= n is always the dense path)."""
    if path is None:
        return default_path(L, k, block)
    p = np.asarray(PATHS.index(path) if isinstance(path, str) else path, dtype=np.int64)
    return np.where(np.asarray(k) >= blocks(np.asarray(L), block), DENSE, p)


def work(L, k, s: Shape, path=None) -> dict:
    """Executed pairs (all heads) per kernel family and the entry / bucket counts of one sequence on
    ``path`` (see :func:`_path`): ``fwd`` (past + own), ``kv`` (the kv kernel), ``dq`` (the dQ kernels)."""
    L, k = np.broadcast_arrays(np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64))
    n = blocks(L, s.block)
    path = _path(L, k, s.block, path)
    sparse = path == SPARSE
    chunks, per, k1p = forward_chunks(L, k, s)
    chunks = np.where(sparse, chunks, 1)                      # only gathered rows need partial slots
    H = s.heads
    own = H * own_pairs(L, k, s.block, dense=~sparse)         # dense and masked: the whole prefix
    kv_own = H * kv_own_pairs(L, k, s.block, dense=~sparse)
    past = np.where(sparse, H * past_attended(L, k, s.block), 0)
    entries = past // s.block                                 # gathered (row, head) choices
    gathers = sparse & (k > 1)
    buckets = np.where(gathers, s.kv_heads * _bucket_chunks(n, chunks, per), 0)   # (bucket, chunk) runs
    buckets_all = np.where(gathers, s.kv_heads * (n - 1), 0)                     # buckets over all chunks
    pad_f = s.block * (_tile(FWD_TILE, s.block)[0] - 1) / 2 * buckets
    pad_kv = s.block * (_tile(KV_TILE, s.block)[0] - 1) / 2 * buckets_all
    return {"n": n, "sparse": sparse, "masked": path == MASKED, "gated": gathers | (path == MASKED),
            "chunks": chunks, "k1p": k1p, "entries": entries, "buckets": buckets, "buckets_all": buckets_all,
            "own": own, "past": past, "attended": H * _attended_per_head(L, k, s.block),
            "fwd": own + past + pad_f, "kv": kv_own + past + pad_kv, "dq": own + past + pad_f}


def _attended_per_head(L, k, block: int):
    n = blocks(L, block)
    r = L - (n - 1) * block
    own = (n - 1) * _tri(block) + _tri(r)
    return np.where(k >= n, _tri(L), own + past_attended(L, k, block))
