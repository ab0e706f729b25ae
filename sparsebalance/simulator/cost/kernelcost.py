"""Cost model of the MoBA kernel we ship (``kernels/moba/triton_impl.py``), one sequence, one layer.

What the kernel does per call (docs/costmodel.md has the derivations and every constant's source):

* a sequence whose budget covers all its blocks (k >= n) runs **dense** causal attention in the
  own-block kernels (FlashAttention-2's loops): no gate, no gathered entries, no partials;
* otherwise the dispatcher picks, per sequence, the cheaper (forward + backward, by this model:
  :func:`choose_path`) of two paths that both compute exactly MoBA attention:
  - **sparse** (key-block-major, below);
  - **masked** dense: the gate as below, the selection turned into a per-(row, head) bit table of the
    blocks it attends (PyTorch), then the dense loops with every (row, key tile) pair masked by the
    row's bit for the tile's block -- dense tiles, no index, no partials, no merge;
* sparse path: the **gate** (PyTorch, ``gate.py`` via ``triton_select.select_blocks``) scores each row
  chunk against its past block means and takes the top k-1; the **index** (PyTorch) gathers every
  (row, head, choice) into buckets by key block; then per forward chunk two Triton kernels run: the
  **past** kernel (``block_m`` gathered rows x one whole key block, partial output + LSE written) and
  the **own + merge** kernel (own block causally, partials merged by LSE);
* backward: PyTorch glue (delta, fp32 accumulators, casts) and per chunk two Triton kernels with
  FlashAttention-2's five matmuls per tile pair (S, dP, dV, dK, dQ; dQ/dK/dV by atomic adds).

Executed (row, key) pairs -- what the tensor cores really multiply -- are counted like
``kernels/moba/work.py`` counts them from index tables: exact for the own blocks and the dense path,
expected for the gathered tiles (each non-empty bucket pads its last tile by (block_m - 1) / 2 rows
on average; every past block is assumed chosen by some row, an upper bound that random gate scores
meet and real ones come close to, see docs/costmodel.md). Per-element byte and op counts of the
PyTorch phases were measured with ``python -m sparsebalance.kernels.moba.opcount`` (ATen-level
counts; ``tests/kernels/test_kernelcost_counts.py`` re-checks them).

All functions broadcast over numpy arrays of lengths and budgets. ``heads``/``kv_heads`` are per
tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.errors import check

DENSE, SPARSE, MASKED = 0, 1, 2
"""Path codes: dense (k >= n), sparse (key-block-major), masked (dense loops under the selection)."""
PATHS = ("dense", "sparse", "masked")

# Launch configuration of the shipped kernel (kernels/moba/triton_impl.py: launch_config, PARTIAL_BYTES,
# BWD_ROWS; select_blocks' chunk_elems). Mirrored here because simulator/ may not import kernels/;
# tests/kernels/test_kernelcost_counts.py asserts they agree.
TILE_M = 64
TILE_N = 64
PARTIAL_BYTES = 1 << 30
BWD_ROWS = 1024
GATE_CHUNK_ELEMS = 1 << 24

# ATen-level counts of the PyTorch phases, measured with `python -m sparsebalance.kernels.moba.opcount`
# and a least-squares fit over 10 shapes (docs/costmodel.md; within 2 % of the counter at every shape).
SELECT_OPS_PER_SEQ = 3          # k -> fp32, block means, sel table fill
SELECT_OPS_PER_CHUNK = 27       # score GEMM, past mask, masked_fill, top-k, tie check, sort, casts
                                # (+2 copies with 1 < kv heads < heads; +2 per sequence with a ragged last block)
SELECT_SYNCS_PER_CHUNK = 1      # bool(ambiguous.any())
INDEX_OPS_PER_CALL = 3          # cu_seqlens / the budget to the host, empty item table
INDEX_OPS_PER_CHUNK = 73 + 2    # nonzero, bucket arithmetic, stable sort, bincount, cumsum, item tables
                                # (+ 2 host-to-device copies of the tile tables, not seen on the CPU)
INDEX_SYNCS_PER_CALL = 2        # cu_seqlens and the budget read on the host
INDEX_SYNCS_PER_CHUNK = 7       # nonzero / repeat_interleave (data-dependent sizes)
INDEX_BYTES_PER_ENTRY = 150.0   # per gathered (row, head, choice)
INDEX_BYTES_PER_SLOT = 10.0     # per (row, head, K1P) capacity slot scanned
INDEX_BYTES_PER_BUCKET = 889.0  # per (key block, kv head): bincount, cumsum, pointers
INDEX_BYTES_PER_ROW = 16.6
SORT_EXTRA_BYTES_PER_ENTRY = 96.0  # a GPU radix sort of int32 keys + int64 values: ~4 digit passes x 2 x 12 B
BITS_OPS_PER_CALL = 2           # bit table zeroed, the sequence's selection cleared from sel
BITS_OPS_PER_CHUNK = 16         # per row chunk of selection_bits (shifts, casts, two scatter-adds, copy)
BITS_BYTES = (64.0, 36.0, 43.0)  # per (row, head, K1P) slot, per (row, head, W + 1) word, per row
                                 # (least squares over 7 shapes, within 1.7 % of the counter)
BWD_GLUE_OPS = 11
BWD_GLUE_BYTES = (38.0, 20.0, 12.0)  # per (row, head, d), per (row, kv head, d), per (row, head)


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
        check(self.block % TILE_M == 0 or self.block < TILE_M, "block", f"must be a multiple of {TILE_M} or smaller")
        check(TILE_M == TILE_N, "TILE_N", "the own-block closed forms assume square tiles")


def _tiles(block: int) -> tuple[int, int]:
    return min(TILE_M, block), min(TILE_N, block)


def _tri(t):
    return t * (t + 1) // 2


def own_pairs(L, k, block: int):
    """Executed pairs per query head of the own-block kernels (forward = backward, exact): query tiles
    of ``bm`` rows run key tiles up to their last row, over each block (sparse) or the whole sequence
    (dense, k >= n): bm^2 t (t + 1) / 2 per segment of t tiles (bm == bn)."""
    L, k = np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64)
    bm, _ = _tiles(block)
    n = blocks(L, block)
    r = L - (n - 1) * block                                   # tokens in the last block
    sparse = (n - 1) * _tri(block // bm) + _tri(-(-r // bm))
    return bm * bm * np.where(k >= n, _tri(-(-L // bm)), sparse)


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
    """Forward chunks: runs of whole blocks whose partial buffer stays under PARTIAL_BYTES."""
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
    """Executed and attended pairs (all heads) and the entry/bucket counts of one sequence on ``path``
    (see :func:`_path`)."""
    L, k = np.broadcast_arrays(np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64))
    bm, _ = _tiles(s.block)
    n = blocks(L, s.block)
    path = _path(L, k, s.block, path)
    sparse = path == SPARSE
    chunks, per, k1p = forward_chunks(L, k, s)
    chunks = np.where(sparse, chunks, 1)                      # only gathered rows need partial slots
    own = s.heads * own_pairs(L, np.where(sparse, k, n), s.block)   # dense and masked: dense tiles
    past = np.where(sparse, s.heads * past_attended(L, k, s.block), 0)
    entries = past // s.block                                 # gathered (row, head) choices
    buckets = np.where(sparse & (k > 1), s.kv_heads * _bucket_chunks(n, chunks, per), 0)
    # the last tile of each non-empty bucket holds (bm - 1) / 2 padding rows on average; the backward
    # splits buckets at BWD_ROWS, a multiple of bm, so it pads the same tiles
    pad = s.block * (bm - 1) / 2 * buckets
    return {"n": n, "sparse": sparse, "masked": path == MASKED, "chunks": chunks, "k1p": k1p,
            "entries": entries, "buckets": buckets,
            "own": own, "past": past, "attended": s.heads * _attended_per_head(L, k, s.block),
            "fwd": own + past + pad, "bwd": own + past + pad}


def _attended_per_head(L, k, block: int):
    n = blocks(L, block)
    r = L - (n - 1) * block
    own = (n - 1) * _tri(block) + _tri(r)
    return np.where(k >= n, _tri(L), own + past_attended(L, k, block))


def gate_counts(L, k, s: Shape) -> dict:
    """FLOPs, bytes, ops and syncs of selection (sparse sequences only), chunked as select_blocks does."""
    L, k = np.broadcast_arrays(np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64))
    B, H, D = s.block, s.heads, s.head_dim
    n = blocks(L, B)
    sparse = (k < n) & (k > 1)
    rows = np.maximum(B, GATE_CHUNK_ELEMS // np.maximum(1, H * n))
    flops = np.zeros(L.shape)
    nbytes = np.zeros(L.shape)
    nch = np.where(sparse, -(-(L - B) // rows), 0)
    gqa = 1 < s.kv_heads < H  # einsum over (kv head, group) copies q and the scores once more
    for i in range(int(nch.max(initial=0))):
        r0 = B + i * rows
        r1 = np.minimum(L, r0 + rows)
        R = np.where(i < nch, r1 - r0, 0)
        npast = np.maximum((r1 - 1) // B, 0)
        w = np.minimum(k, npast)
        flops += 2.0 * R * H * D * npast
        nbytes += (R * H * D * (10 + 8 * gqa) + R * H * npast * (16 + 8 * gqa) + R * H * w * 12 + R * H * 30
                   + R * H * (k - 1) * 109 + R * npast * 4)
    k1p = forward_chunks(L, k, s)[2]
    nbytes += np.where(sparse, L * s.kv_heads * D * 10 + L * H * k1p * 4, 0)
    ragged = (L % B) != 0  # the last block's mean is a second reduction and a cat
    ops = np.where(sparse, SELECT_OPS_PER_SEQ + 2 * ragged + (SELECT_OPS_PER_CHUNK + 2 * gqa) * nch, 0)
    return {"flops": flops, "bytes": nbytes, "ops": ops, "syncs": np.where(sparse, SELECT_SYNCS_PER_CHUNK * nch, 0)}


def bits_chunks(L, k, s: Shape):
    """Row chunks of ``triton_select.selection_bits``: about GATE_CHUNK_ELEMS (row, head, K1P) slots each."""
    k1p = forward_chunks(L, k, s)[2]
    return -(-np.asarray(L, dtype=np.int64) // np.maximum(1, GATE_CHUNK_ELEMS // (s.heads * k1p)))


def index_counts(L, k, s: Shape, path=None) -> dict:
    """Bytes, ops and syncs of index building. A sequence without past choices (dense, or k = 1)
    only gets its tile tables copied from the host; a masked one builds its selection bits instead."""
    L, k = np.broadcast_arrays(np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64))
    w = work(L, k, s, path)
    e = w["entries"]
    gather = w["sparse"] & (k > 1)
    nbytes = (INDEX_BYTES_PER_ENTRY + SORT_EXTRA_BYTES_PER_ENTRY) * e + INDEX_BYTES_PER_SLOT * L * s.heads * w["k1p"] \
        + INDEX_BYTES_PER_BUCKET * w["n"] * s.kv_heads + INDEX_BYTES_PER_ROW * L
    words = -(-w["n"] // 32)
    bb = BITS_BYTES
    bits = bb[0] * L * s.heads * w["k1p"] + bb[1] * L * s.heads * (words + 1) + bb[2] * L
    tables = 16 * L / TILE_M
    nbytes = np.where(gather, nbytes, np.where(w["masked"], bits + tables, 8 * L * s.heads + tables))
    ops = INDEX_OPS_PER_CALL + np.where(gather, INDEX_OPS_PER_CHUNK, 1 + 2) * w["chunks"] \
        + np.where(w["masked"], BITS_OPS_PER_CALL + BITS_OPS_PER_CHUNK * bits_chunks(L, k, s), 0)
    syncs = INDEX_SYNCS_PER_CALL + np.where(gather, INDEX_SYNCS_PER_CHUNK * w["chunks"], 0)
    return {"bytes": nbytes, "ops": ops, "syncs": syncs}


def kernel_counts(L, k, s: Shape, *, backward: bool, path=None) -> dict:
    """Triton kernels: FLOPs of the executed tiles and the HBM bytes a dense FlashAttention kernel
    does not move (its own traffic is inside the published efficiency): gathered q reads, partial
    outputs written and merged, index reads (forward); dK/dV atomics per program, index reads
    (backward); on the masked path one int32 word per row and tile pair (the row's bit of the block)."""
    L = np.asarray(L, dtype=np.int64)
    w = work(L, k, s, path)
    e, D, eb, B = w["entries"], s.head_dim, s.dtype_bytes, s.block
    bm, bn = _tiles(B)
    mask_bytes = np.where(w["masked"], s.heads * _tri(-(-L // bm)) * bm * 4, 0)
    if not backward:
        past_bytes = e * (2 * D * eb + 8)                    # q gathered + partial (o, lse) written + code
        merge_bytes = e * (D * eb + 8)                       # partial read + sel slot
        return {"flops_past": 4.0 * D * (w["fwd"] - w["own"]), "flops_own": 4.0 * D * w["own"],
                "bytes_past": past_bytes, "bytes_own": merge_bytes + mask_bytes,
                "launches": np.where(w["sparse"], 2, 1) * w["chunks"]}
    items = w["buckets"] + e / BWD_ROWS
    own_items = w["n"] * s.heads  # a program per key block and query head (dK / dV atomics each)
    return {"flops_past": 10.0 * D * (w["bwd"] - w["own"]), "flops_own": 10.0 * D * w["own"],
            "bytes_past": e * 4 * (B // bn) + items * 16 * B * D, "bytes_own": own_items * 16 * B * D + mask_bytes,
            "launches": np.where(w["sparse"], 2, 1) * w["chunks"]}


def phase_times(L, k, s: Shape, hw, *, backward: bool = False, path=None) -> dict:
    """Seconds of each phase of one sequence's attention on ``path`` (default: the dispatcher's
    :func:`choose_path`). ``hw``: peak, bandwidth, efficiencies and launch overhead, as
    ``simulator.cost.hardware.Hardware``. A Triton kernel costs max(FLOPs / (peak x efficiency), extra bytes
    / (bandwidth x memory efficiency)); a PyTorch phase bytes / bandwidth (the gate: max with its GEMM)
    plus (ops + syncs) x launch overhead."""
    L, k = np.broadcast_arrays(np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64))
    if path is None:
        path = choose_path(L, k, s, hw)
    bw = hw.memory_bandwidth * hw.memory_efficiency
    eff = hw.attention_bwd_efficiency if backward else hw.attention_fwd_efficiency
    kern = kernel_counts(L, k, s, backward=backward, path=path)
    parts = {
        "past": np.maximum(kern["flops_past"] / (hw.peak_flops * eff), kern["bytes_past"] / bw),
        "own": np.maximum(kern["flops_own"] / (hw.peak_flops * eff), kern["bytes_own"] / bw),
        "launch": kern["launches"] * hw.launch_overhead,
    }
    if backward:
        gb = BWD_GLUE_BYTES
        glue = L * s.heads * s.head_dim * gb[0] + L * s.kv_heads * s.head_dim * gb[1] + L * s.heads * gb[2]
        parts["glue"] = glue / bw + BWD_GLUE_OPS * hw.launch_overhead
    else:
        g = gate_counts(L, k, s)
        parts["gate"] = (np.maximum(g["flops"] / (hw.peak_flops * hw.gemm_efficiency), g["bytes"] / bw)
                         + (g["ops"] + g["syncs"]) * hw.launch_overhead)
        ix = index_counts(L, k, s, path)
        parts["index"] = ix["bytes"] / bw + (ix["ops"] + ix["syncs"]) * hw.launch_overhead
    return parts


def call_fixed(hw, *, backward: bool = False) -> float:
    """Seconds of one attention call (one layer, one packed micro-batch) that do not repeat per
    sequence: one kernel launch (every path launches at least one), and in the forward the index's
    per-call ops and host syncs (``INDEX_OPS_PER_CALL``, ``INDEX_SYNCS_PER_CALL``), in the backward
    the glue's ops (``BWD_GLUE_OPS``). :func:`phase_times` prices a sequence as a call of its own, so
    it includes these once; an analytical profile's attention rows leave them out and its sidecar
    carries them (``attention_call_s``), paid once per micro-batch (docs/costmodel.md section 3)."""
    ops = (BWD_GLUE_OPS + 1) if backward else (INDEX_OPS_PER_CALL + INDEX_SYNCS_PER_CALL + 1)
    return ops * hw.launch_overhead


def path_time(L, k, s: Shape, hw, path) -> np.ndarray:
    """Forward + backward seconds of one sequence's attention on ``path``."""
    return sum(phase_times(L, k, s, hw, path=path).values()) + sum(
        phase_times(L, k, s, hw, backward=True, path=path).values())


def choose_path(L, k, s: Shape, hw) -> np.ndarray:
    """The dispatcher's rule (``kernels/moba/triton_impl.py`` calls it per sequence, and the analytical
    profiles price its choice): dense at k >= n; below, the masked dense path where this model prices
    its forward + backward below the sparse path's, else sparse (ties: sparse). Forward + backward
    because one choice serves both passes of a training step."""
    L, k = np.broadcast_arrays(np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64))
    cheaper = path_time(L, k, s, hw, MASKED) < path_time(L, k, s, hw, SPARSE)
    return np.where(k >= blocks(L, s.block), DENSE, np.where(cheaper, MASKED, SPARSE))
