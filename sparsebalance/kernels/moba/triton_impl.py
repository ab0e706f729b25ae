"""MoBA block-sparse attention in Triton, key-block-major: forward, backward, autograd.Function.

Layout (FlashAttention varlen): q [T, H, D], k and v [T, H_kv, D], cu_seqlens int32 [N + 1], topk
LongTensor [N] (one budget per sequence, own block included). Semantics: ``naive.py`` / README.

Why key-block-major: rows of one query tile choose different past blocks, so a query-tile kernel
must visit the union of their choices (measured 3.5-4.3x the attended pairs at density 1/8,
``benchmarks/bench_moba_work.py``). Here every program owns one *key block* and the (query, head)
rows that chose it, gathered from the index (``triton_select.py``):

* forward, past blocks (``_fwd_past_kernel``): one program per ``BLOCK_M`` gathered rows of one
  (key block, kv head) -- the rows' partial attention over that block, stored normalised with its
  log-sum-exp (log2) in a partial buffer, one slot per (row, head, choice);
* forward, own block + merge (``_fwd_own_merge_kernel``): one program per (query tile, head) --
  causal attention inside the own block, then the row's partials merged by log-sum-exp in
  registers; writes O and LSE [H, T] (log2);
* backward (``_bwd_past_kernel``, ``_bwd_own_kernel``): one program per (key sub-tile of
  ``BLOCK_N`` keys, run of gathered rows); FlashAttention-2's five matmuls per tile pair (S, dP,
  dV, dK, dQ); dK/dV accumulate in registers over the run and are added once per program, dQ is
  added per tile pair -- all into fp32 buffers with atomics, as FlashAttention-2 does for dQ.

Integer arguments that change from call to call (item and tile counts, the chunk's first row, the
token count, bit words per row) are marked ``do_not_specialize``: Triton would otherwise compile a
variant for each combination of "is 1" / "divisible by 16" among them (up to 16 per kernel), each a
JIT compilation of seconds on a cold cache; where they enter an address it is a per-row gather,
never a vectorised access that alignment would speed up.

One causal test ``key <= query`` masks both kinds of tile: every key of a past block precedes the
query. Under ``TRITON_INTERPRET=1`` tiles are cast to fp32 before ``tl.dot`` (the interpreter
multiplies bf16 bit patterns); on a GPU bf16/fp16 tiles go to ``tl.dot`` directly (wgmma on
Hopper) and fp32 inputs use ``input_precision="ieee"``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from sparsebalance.errors import ConfigError
from sparsebalance.kernels.moba.triton_select import MobaIndex, build_index

LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def min_tile(device: torch.device | str) -> int:
    """Smallest query / key tile (rows) the kernels accept on ``device``: 16 where they are compiled
    for a GPU (``tl.dot`` needs every dimension >= 16 there; seen on an H100, 2026-11-26), 1 under the
    interpreter, which runs any tile and is how the tests cover several tiles per block at tiny sizes."""
    return 1 if _interpreting() or torch.device(device).type != "cuda" else 16


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    """a @ b with fp32 accumulation (fp32 operands under the interpreter or for fp32 inputs)."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a, b.to(a.dtype), input_precision=PREC)


@triton.jit(do_not_specialize=["n_items", "row0", "k1p_shift"])
def _fwd_past_kernel(Q, K, V, PO, PL, CODES, ITEMS, n_items, row0, sm_scale_log2, H, HKV, k1p_shift,
                     D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     F32_DOT: tl.constexpr, PREC: tl.constexpr):
    it = tl.program_id(0)
    e0 = tl.load(ITEMS + it)
    e1 = tl.load(ITEMS + n_items + it)
    kstart = tl.load(ITEMS + 2 * n_items + it)
    kvh = tl.load(ITEMS + 3 * n_items + it)
    e = e0 + tl.arange(0, BLOCK_M)
    ok = e < e1
    code = tl.load(CODES + e, mask=ok, other=0)
    rh = (row0 * H + (code >> k1p_shift)).to(tl.int64)  # t * H + h of each gathered row
    dd = tl.arange(0, D)
    q = tl.load(Q + rh[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for i in range(BLOCK // BLOCK_N):  # a past block is full and wholly before every gathered row
        cols = (kstart + i * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        k = tl.load(K + (cols[:, None] * HKV + kvh) * D + dd[None, :])
        v = tl.load(V + (cols[:, None] * HKV + kvh) * D + dd[None, :])
        s = _dot(q, tl.trans(k), F32_DOT, PREC) * sm_scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT, PREC)
        m_i = m_new
    acc = acc / l_i[:, None]
    slot = code.to(tl.int64)
    tl.store(PO + slot[:, None] * D + dd[None, :], acc.to(PO.dtype.element_ty), mask=ok[:, None])
    tl.store(PL + slot, m_i + tl.math.log2(l_i), mask=ok)


@triton.jit
def _picked(BITS, rh, row_ok, W, jb, mstart):
    """Per row (t * H + h): does it attend local block ``jb``? All True for an unmasked tile
    (``mstart`` < 0: the masked load returns -1, every bit set)."""
    on = row_ok & (tl.full(row_ok.shape, 0, tl.int32) + mstart >= 0)
    word = tl.load(BITS + rh * W + jb // 32, mask=on, other=-1)
    return ((word >> (jb % 32)) & 1) != 0


@triton.jit(do_not_specialize=["W", "n_tiles", "row0", "T", "k1p_shift"])
def _fwd_own_merge_kernel(Q, K, V, O, LSE, SEL, PO, PL, TILES, BITS, W, n_tiles, row0, sm_scale_log2, T, H, G,
                          k1p_shift, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, MASKED: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    HKV = H // G
    kvh = h // G
    q0 = tl.load(TILES + tile)
    kfirst = tl.load(TILES + n_tiles + tile)  # own block start, or sequence start when dense
    bend = tl.load(TILES + 2 * n_tiles + tile)
    n_slots = tl.load(TILES + 3 * n_tiles + tile)
    mstart = tl.load(TILES + 4 * n_tiles + tile)  # masked dense path: sequence start, else -1
    rows = q0 + tl.arange(0, BLOCK_M)
    row_ok = rows < bend
    rows64 = rows.to(tl.int64)
    dd = tl.arange(0, D)
    q = tl.load(Q + (rows64[:, None] * H + h) * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    if MASKED:  # a row may skip whole key tiles before its diagonal: a finite start keeps exp2 NaN-free
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # own block (whole causal prefix when dense or masked): key tiles up to the tile's last row;
    # afterwards every valid row has a finite running max (its diagonal), so merging -inf partials is safe
    for kstart in range(kfirst, q0 + BLOCK_M, BLOCK_N):
        cols = kstart + tl.arange(0, BLOCK_N)
        col_ok = cols < bend
        cols64 = cols.to(tl.int64)
        k = tl.load(K + (cols64[:, None] * HKV + kvh) * D + dd[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(V + (cols64[:, None] * HKV + kvh) * D + dd[None, :], mask=col_ok[:, None], other=0.0)
        s = _dot(q, tl.trans(k), F32_DOT, PREC) * sm_scale_log2
        keep = (cols[None, :] <= rows[:, None]) & col_ok[None, :]
        if MASKED:  # the key tile lies in one block: keep it for the rows that chose that block
            keep = keep & _picked(BITS, rows64 * H + h, row_ok, W, (kstart - mstart) // BLOCK, mstart)[:, None]
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT, PREC)
        m_i = m_new
    if not MASKED:  # masked tiles merge nothing (their own launch: triton_impl.moba_forward)
        # merge the partials of the chosen past blocks: (o_p normalised, lse_p) -> weight 2^(lse_p - m)
        for s in range(n_slots):
            j = tl.load(SEL + ((rows64 * H + h) << k1p_shift) + s, mask=row_ok, other=-1)
            have = j >= 0
            slot = (((rows64 - row0) * H + h) << k1p_shift) + s
            pl = tl.load(PL + slot, mask=have, other=float("-inf"))
            po = tl.load(PO + slot[:, None] * D + dd[None, :], mask=have[:, None], other=0.0).to(tl.float32)
            m_new = tl.maximum(m_i, pl)
            alpha = tl.math.exp2(m_i - m_new)
            beta = tl.math.exp2(pl - m_new)
            l_i = l_i * alpha + beta
            acc = acc * alpha[:, None] + po * beta[:, None]
            m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + (rows64[:, None] * H + h) * D + dd[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h * T + rows64, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _bwd_rows(Q, DO, DQ, LSE, DELTA, k, v, cols, col_ok, rh, row_ok, dk, dv, sm_scale, sm_scale_log2, T, H,
              BITS, W, jb, mstart, D: tl.constexpr, MASKED: tl.constexpr, F32_DOT: tl.constexpr,
              PREC: tl.constexpr):
    """One (key tile, gathered row tile) pair of the backward: five matmuls, transposed tiles
    [BLOCK_N, BLOCK_M]; dQ goes out by atomic add, dK/dV come back accumulated. ``MASKED``: also keep
    only the rows that chose the key tile's local block ``jb`` (masked dense path)."""
    dd = tl.arange(0, D)
    t = rh // H
    h = rh % H
    q = tl.load(Q + rh[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + rh[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + h * T + t, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + h * T + t, mask=row_ok, other=0.0)
    keep = (cols[:, None] <= t[None, :]) & row_ok[None, :] & col_ok[:, None]
    if MASKED:
        keep = keep & _picked(BITS, rh, row_ok, W, jb, mstart)[None, :]
    sT = _dot(k, tl.trans(q), F32_DOT, PREC) * sm_scale_log2
    pT = tl.where(keep, tl.math.exp2(sT - lse[None, :]), 0.0)
    dpT = _dot(v, tl.trans(do), F32_DOT, PREC)
    dsT = pT * (dpT - delta[None, :])
    dv += _dot(pT.to(do.dtype), do, F32_DOT, PREC)
    dk += _dot(dsT.to(q.dtype), q, F32_DOT, PREC)
    dq = _dot(tl.trans(dsT.to(k.dtype)), k, F32_DOT, PREC) * sm_scale
    tl.atomic_add(DQ + rh[:, None] * D + dd[None, :], dq, mask=row_ok[:, None])
    return dk, dv


@triton.jit(do_not_specialize=["n_items", "row0", "T", "k1p_shift"])
def _bwd_past_kernel(Q, K, V, DO, DQ, DK, DV, LSE, DELTA, CODES, ITEMS, n_items, row0, sm_scale, sm_scale_log2,
                     T, H, HKV, k1p_shift, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    # one flat grid, the key sub-tiles of an item adjacent: they run side by side and share the
    # item's q / dO / dQ rows through L2
    SUBS: tl.constexpr = BLOCK // BLOCK_N
    it = tl.program_id(0) // SUBS
    sub = tl.program_id(0) % SUBS
    e0 = tl.load(ITEMS + it)
    e1 = tl.load(ITEMS + n_items + it)
    kstart = tl.load(ITEMS + 2 * n_items + it)
    kvh = tl.load(ITEMS + 3 * n_items + it)
    dd = tl.arange(0, D)
    cols = kstart + sub * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols >= 0  # past blocks are full
    kv = (cols.to(tl.int64)[:, None] * HKV + kvh) * D + dd[None, :]
    k = tl.load(K + kv)
    v = tl.load(V + kv)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for r in range(e0, e1, BLOCK_M):
        e = r + tl.arange(0, BLOCK_M)
        ok = e < e1
        code = tl.load(CODES + e, mask=ok, other=0)
        rh = (row0 * H + (code >> k1p_shift)).to(tl.int64)
        dk, dv = _bwd_rows(Q, DO, DQ, LSE, DELTA, k, v, cols, col_ok, rh, ok, dk, dv, sm_scale, sm_scale_log2,
                           T, H, CODES, 1, 0, -1, D, False, F32_DOT, PREC)
    tl.atomic_add(DK + kv, dk * sm_scale)
    tl.atomic_add(DV + kv, dv)


@triton.jit(do_not_specialize=["W", "n_items", "T"])
def _bwd_own_kernel(Q, K, V, DO, DQ, DK, DV, LSE, DELTA, ITEMS, BITS, W, n_items, sm_scale, sm_scale_log2, T, H,
                    G, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    # grid (items x key sub-tiles, query heads of the group): a program per head, not a loop over the
    # group's heads, so a short varlen call or the masked dense path (one item per key block, all
    # later rows) still fills the GPU (8x the programs at G = 8); dK / dV were atomics already
    SUBS: tl.constexpr = BLOCK // BLOCK_N
    it = tl.program_id(0) // SUBS
    sub = tl.program_id(0) % SUBS
    g = tl.program_id(1)
    bstart = tl.load(ITEMS + it)
    blen = tl.load(ITEMS + n_items + it)
    rend = tl.load(ITEMS + 2 * n_items + it)  # block end, or sequence end when dense
    kvh = tl.load(ITEMS + 3 * n_items + it)
    mstart = tl.load(ITEMS + 4 * n_items + it)  # masked dense path: sequence start, else -1
    jb = (bstart - mstart) // BLOCK              # local id of the key block (masked path)
    HKV = H // G
    if sub * BLOCK_N < blen:  # the last block of a sequence may be short
        dd = tl.arange(0, D)
        cols = bstart + sub * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < bstart + blen
        kv = (cols.to(tl.int64)[:, None] * HKV + kvh) * D + dd[None, :]
        k = tl.load(K + kv, mask=col_ok[:, None], other=0.0)
        v = tl.load(V + kv, mask=col_ok[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        first = (sub * BLOCK_N // BLOCK_M) * BLOCK_M  # row tiles before the key tile see none of it
        for r in range(first, rend - bstart, BLOCK_M):
            rows = bstart + r + tl.arange(0, BLOCK_M)
            ok = rows < rend
            rh = rows.to(tl.int64) * H + kvh * G + g
            dk, dv = _bwd_rows(Q, DO, DQ, LSE, DELTA, k, v, cols, col_ok, rh, ok, dk, dv, sm_scale,
                               sm_scale_log2, T, H, BITS, W, jb, mstart, D, MASKED, F32_DOT, PREC)
        tl.atomic_add(DK + kv, dk * sm_scale, mask=col_ok[:, None])
        tl.atomic_add(DV + kv, dv, mask=col_ok[:, None])


#: Bytes of partial outputs (one D-vector per chosen block) held at once; larger calls run the forward
#: in chunks of whole key blocks (same result, a few more launches).
PARTIAL_BYTES = 1 << 30
#: Gathered rows per backward program at most (splits the long row lists of popular key blocks).
BWD_ROWS = 1024


def launch_config(block_size: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch options: BLOCK_M/BLOCK_N (divisors of the block), warps, stages.

    Picked with ``benchmarks/inspect_triton_sm90.py`` (sm_90a, bf16, block 128; table in
    kernels/moba/README.md, "Hopper compile check"): 64 x 64 tiles on 8 warps compile without spills at D = 64 and with the fewest
    spills at D = 128, every tl.dot lowering to wgmma; 4 warps spill in every kernel. Not yet tuned
    by GPU timings.
    """
    del head_dim, dtype  # one configuration for now; kept in the signature for tuning on a GPU
    return {"BLOCK_M": min(64, block_size), "BLOCK_N": min(64, block_size), "num_warps": 8, "num_stages": 2}


def _dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(cast tiles to fp32 before tl.dot, input_precision)."""
    if _interpreting():
        return True, "ieee"
    return dtype == torch.float32, "ieee" if dtype == torch.float32 else "tf32"


def _launch_opts(block_size: int, bm: int, bn: int, q: torch.Tensor) -> dict:
    cfg = launch_config(block_size, q.shape[2], q.dtype)
    f32, prec = _dot_mode(q.dtype)
    return {"D": q.shape[2], "BLOCK_M": bm, "BLOCK_N": bn, "F32_DOT": f32, "PREC": prec,
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def _bits(idx: MobaIndex) -> torch.Tensor:
    """The selection bit table, or a placeholder pointer when no sequence is on the masked path
    (then only the unmasked variants launch)."""
    return idx.sel if idx.bits is None else idx.bits


def _k1p_shift(idx: MobaIndex) -> int:
    """log2 of the index's slots per (token, head), a power of two: a runtime shift in the kernels, so
    budgets of every size share one compiled variant (a constexpr compiled one per power of two)."""
    shift = idx.k1p.bit_length() - 1
    assert 1 << shift == idx.k1p, idx.k1p
    return shift


def moba_forward(q, k, v, idx: MobaIndex, block_size: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [T, H, D] and LSE [H, T] (log2) for the selection in ``idx``."""
    T, H, D = q.shape
    HKV = k.shape[1]
    opts = _launch_opts(block_size, bm, bn, q)
    scale_log2 = LOG2E / math.sqrt(D)
    o = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    bits = _bits(idx)
    shift = _k1p_shift(idx)
    for ch in idx.chunks:
        slots = (ch.row1 - ch.row0) * H * idx.k1p if ch.codes.numel() else 1
        po = torch.empty((slots, D), dtype=q.dtype, device=q.device)
        pl = torch.empty(slots, dtype=torch.float32, device=q.device)
        n_f = ch.fwd_items.shape[1]
        if n_f:
            _fwd_past_kernel[(n_f,)](q, k, v, po, pl, ch.codes, ch.fwd_items, n_f, ch.row0, scale_log2, H, HKV,
                                     shift, BLOCK=block_size, **opts)
        for tiles, mk in ((ch.q_tiles, False), (ch.q_tiles_masked, True)):
            n_t = tiles.shape[1]
            if n_t:
                _fwd_own_merge_kernel[(n_t, H)](q, k, v, o, lse, idx.sel, po, pl, tiles, bits, idx.words, n_t,
                                                ch.row0, scale_log2, T, H, H // HKV, shift, BLOCK=block_size,
                                                MASKED=mk, **opts)
    return o, lse


def moba_backward(q, k, v, o, lse, do, idx: MobaIndex, block_size: int, bm: int, bn: int):
    """(dq, dk, dv) in the input dtype; accumulation in fp32 buffers by atomic adds."""
    T, H, D = q.shape
    HKV = k.shape[1]
    opts = _launch_opts(block_size, bm, bn, q)
    scale = 1.0 / math.sqrt(D)
    delta = (do.float() * o.float()).sum(-1).transpose(0, 1).contiguous()  # [H, T]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    subs = block_size // bn
    bits = _bits(idx)
    for ch in idx.chunks:
        n_b = ch.bwd_items.shape[1]
        if n_b:
            _bwd_past_kernel[(n_b * subs,)](q, k, v, do, dq, dk, dv, lse, delta, ch.codes, ch.bwd_items, n_b,
                                            ch.row0, scale, scale * LOG2E, T, H, HKV, _k1p_shift(idx),
                                            BLOCK=block_size, **opts)
        for items, mk in ((ch.own_items, False), (ch.own_items_masked, True)):
            n_o = items.shape[1]
            if n_o:
                _bwd_own_kernel[(n_o * subs, H // HKV)](q, k, v, do, dq, dk, dv, lse, delta, items, bits, idx.words, n_o,
                                               scale, scale * LOG2E, T, H, H // HKV, BLOCK=block_size, MASKED=mk,
                                               **opts)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


PATHS = ("auto", "sparse", "masked")


def dispatch_hardware(device: torch.device):
    """The hardware whose cost model the dispatcher consults: the analytical H100, H200 or H20 named
    by the CUDA device, else the H100 (also on the CPU, where only the interpreter runs the kernel)."""
    import re

    from sparsebalance.simulator.cost.roofline import H100, HARDWARE

    if device.type != "cuda":
        return H100
    m = re.search(r"\bH(100|200|20)\b", torch.cuda.get_device_name(device))
    return HARDWARE[f"h{m.group(1)}"] if m else H100


def plan_paths(cu_seqlens: torch.Tensor, topk: torch.Tensor, block_size: int, q: torch.Tensor, k: torch.Tensor,
               path: str = "auto") -> list[bool]:
    """Per sequence: run it on the masked dense path? ``"auto"``: where the cost model
    (``simulator.cost.kernelcost.choose_path``, the rule the analytical profiles price) says that path is
    cheaper for forward + backward than the sparse key-block-major one; ``"sparse"`` / ``"masked"``
    force one path for every sequence with k < n. Dense sequences (k >= n) are dense either way."""

    from sparsebalance.simulator.cost import kernelcost as kc

    cu = cu_seqlens.cpu().long()
    lengths = (cu[1:] - cu[:-1]).numpy()
    ks = topk.cpu().numpy()
    if path != "auto":
        return [path == "masked"] * len(lengths)
    shape = kc.Shape(heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[2], block=block_size,
                     dtype_bytes=q.element_size())
    return (kc.choose_path(lengths, ks, shape, dispatch_hardware(q.device)) == kc.MASKED).tolist() \
        if len(lengths) else []


class _MobaTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, block_size, topk, block_m, block_n, masked):
        idx = build_index(q.detach(), k.detach(), cu_seqlens, block_size, topk, block_m,
                          bwd_rows=BWD_ROWS, partial_bytes=PARTIAL_BYTES, masked=masked)
        o, lse = moba_forward(q, k, v, idx, block_size, block_m, block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.idx, ctx.block_size, ctx.block_m, ctx.block_n = idx, block_size, block_m, block_n
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = moba_backward(q, k, v, o, lse, do.contiguous(), ctx.idx, ctx.block_size, ctx.block_m,
                                   ctx.block_n)
        return dq, dk, dv, None, None, None, None, None, None


def _validate(q, k, v, cu_seqlens, block_size, topk) -> torch.Tensor:
    """Check the arguments (ConfigError naming the argument); return topk as a LongTensor [N] on the CPU."""
    def need(cond, field, msg):
        if not cond:
            raise ConfigError(f"{field}: {msg}")
    need(q.dim() == 3, "q", f"must be [T, H, D], got shape {tuple(q.shape)}")
    need(k.dim() == 3 and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2], "k",
         f"must be [T, H_kv, D] matching q {tuple(q.shape)}, got {tuple(k.shape)}")
    need(v.shape == k.shape, "v", f"must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    need(q.shape[1] % k.shape[1] == 0, "k", f"H={q.shape[1]} must be divisible by H_kv={k.shape[1]}")
    need(q.dtype == k.dtype == v.dtype, "q", f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    need(q.dtype in (torch.float32, torch.float16, torch.bfloat16), "q",
         f"dtype {q.dtype} is not allowed; choose one of float32, float16, bfloat16")
    D = q.shape[2]
    need(D >= 16 and D & (D - 1) == 0, "q", f"head_dim must be a power of two >= 16, got {D}")
    need(isinstance(block_size, int) and block_size >= 16 and block_size & (block_size - 1) == 0,
         "block_size", f"must be a power of two >= 16 for the Triton kernel, got {block_size!r}")
    need(cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2, "cu_seqlens", "must be a 1-D tensor [N + 1], N >= 1")
    cu = cu_seqlens.cpu().long()
    need(int(cu[0]) == 0 and bool((cu[1:] > cu[:-1]).all()), "cu_seqlens",
         "must start at 0 and be strictly increasing")
    need(int(cu[-1]) == q.shape[0], "cu_seqlens", f"must end at T={q.shape[0]}, got {int(cu[-1])}")
    n = cu.numel() - 1
    topk = torch.as_tensor(topk, dtype=torch.long).cpu()
    topk = topk.expand(n) if topk.dim() == 0 else topk
    need(topk.shape == (n,), "topk", f"must be an int or a tensor [N={n}], got shape {tuple(topk.shape)}")
    need(bool((topk >= 1).all()), "topk", f"must be >= 1, got {topk.tolist()}")
    return topk.contiguous()


def moba_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          block_size: int, topk, *, block_m: int | None = None,
                          block_n: int | None = None, path: str = "auto") -> torch.Tensor:
    """MoBA attention with the Triton kernels; differentiable in q, k, v.

    q: [T, H, D]; k, v: [T, H_kv, D]; cu_seqlens: int [N + 1]; topk: int or LongTensor [N] (budget per
    sequence, own block included). Returns out [T, H, D] in q's dtype. ``block_m`` / ``block_n`` (query
    and key tile rows, powers of two dividing ``block_size``) default to :func:`launch_config`.
    ``path``: per sequence with topk < n_blocks, ``"auto"`` runs the cheaper by the cost model of the
    sparse key-block-major path and the masked dense path (:func:`plan_paths`); ``"sparse"`` or
    ``"masked"`` force one. Every path computes the same MoBA attention.
    """
    topk = _validate(q, k, v, cu_seqlens, block_size, topk)
    cfg = launch_config(block_size, q.shape[2], q.dtype)
    bm = block_m or cfg["BLOCK_M"]
    bn = block_n or cfg["BLOCK_N"]
    low = min_tile(q.device)
    for name, t in (("block_m", bm), ("block_n", bn)):
        if t < 1 or t & (t - 1) or block_size % t:
            raise ConfigError(f"{name}: must be a power of two dividing block_size={block_size}, got {t}")
        if t < low:
            raise ConfigError(f"{name}: must be >= {low} on {q.device.type} (tl.dot needs 16-row tiles "
                              f"when compiled), got {t}")
    if path not in PATHS:
        raise ConfigError(f"path: must be one of {', '.join(PATHS)}, got {path!r}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    masked = plan_paths(cu_seqlens, topk, block_size, q, k, path)
    return _MobaTriton.apply(q, k, v, cu_seqlens, block_size, topk, bm, bn, masked)
