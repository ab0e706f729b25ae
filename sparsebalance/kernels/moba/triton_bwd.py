"""MoBA backward in Triton: dK/dV owned per key tile in registers, dQ owned per query tile.

FlashAttention-2's backward matmuls per (key tile, row tile) pair, split the way the Triton
tutorial's Hopper attention splits them (an sm_90a compile of the fused five-matmul pair spilled
0.5-8 KB per thread at every candidate tile: dK, dV and the dQ tile do not fit the registers at
once, README "Hopper compile check"): S, dP, dV, dK in the key-major kernel, S, dP, dQ again in the
query-major ones -- 7 matmuls a pair instead of 5, and no ordered atomic anywhere.

* ``_bwd_kv_kernel`` (own pieces, the masked dense path's own pieces (``MASKED``) and the gathered
  pieces (``GATHERED``) in up to three launches: one variant holding both loops spilled): a
  program owns one key sub-tile (``block_n`` keys of one kv head) and loops over rows that attend
  it, accumulating dK and dV in registers:
  - **own pieces** (host table, ``plan.py``): the sub-tile's own-block rows -- from the row tile
    holding its first key to the block end (sparse) or the sequence end (dense, masked) -- for the
    query heads of its group; long row ranges are split into pieces (``plan.py``: at least
    ``OWN_TILES`` (row tile x head) pairs each, about ``PROGRAMS`` programs in all), so short
    sequences and GQA still fill the GPU while long dense ones add few partial dK/dV;
  - **gathered pieces** (device-sized): at most ``plan.bwd_entries`` gathered entries of one bucket (the
    rows of every head of the group that chose the key block); a popular block (a sink every query
    picks) is split across programs, so none runs much longer than the others.
  dK/dV leave a program once: a plain store when it is the sub-tile's only contributor (one own
  piece, and no entry chose the block), else ``tl.atomic_add(..., sem="relaxed")``
  (``red.global.add.f32``: no ordering, no fence) into the zeroed fp32 buffer -- every contributor
  of such a sub-tile adds, none stores.
* ``_bwd_dq_own_kernel``: per (query tile, head), the forward's own-block loop (own block causally,
  the causal prefix when dense or masked); dQ of the tile stored (it owns those rows first).
* ``_bwd_dq_past_kernel``: per forward item (``block_m`` gathered entries of one bucket), the whole
  key block; the entries' dQ added once per (entry tile, key block) with a relaxed atomic, after
  every own-block store (a later launch on the same stream).

``_bwd_prep_kernel`` computes delta = rowsum(dO * O) and zeroes the dK/dV accumulators;
``_cast_kernel`` writes the input dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparsebalance.kernels.moba.plan import MobaPlan
from sparsebalance.kernels.moba.triton_fwd import LOG2E, _dot, _find, _item, _picked, _query_tile, dot_mode
from sparsebalance.kernels.moba.triton_select import MobaIndex


@triton.jit(do_not_specialize=["T"])
def _bwd_prep_kernel(O, DO, DELTA, DK, DV, T, H, HKV, D: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    ok = rows < T
    rows64 = rows.to(tl.int64)
    dd = tl.arange(0, D)
    off = (rows64[:, None] * H + h) * D + dd[None, :]
    o = tl.load(O + off, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + h * T + rows64, tl.sum(o * do, 1), mask=ok)
    if h < HKV:
        zero = tl.zeros([BR, D], tl.float32)
        kv = (rows64[:, None] * HKV + h) * D + dd[None, :]
        tl.store(DK + kv, zero, mask=ok[:, None])
        tl.store(DV + kv, zero, mask=ok[:, None])


@triton.jit
def _kv_pair(Q, DO, LSE, DELTA, k, v, cols, col_ok, rh, row_ok, dk, dv, sm_scale_log2, T, H, BITS, W, jb, mstart,
             D: tl.constexpr, MASKED: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    """dK/dV of one (key tile, row tile) pair, transposed tiles [BLOCK_N, BLOCK_M]: S, dP, dV, dK.
    ``MASKED``: only the rows that chose local block ``jb``."""
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
    pT = tl.where(keep, tl.math.exp2(_dot(k, tl.trans(q), F32_DOT, PREC) * sm_scale_log2 - lse[None, :]), 0.0)
    dsT = pT * (_dot(v, tl.trans(do), F32_DOT, PREC) - delta[None, :])
    dv += _dot(pT.to(do.dtype), do, F32_DOT, PREC)
    dk += _dot(dsT.to(q.dtype), q, F32_DOT, PREC)
    return dk, dv


@triton.jit(do_not_specialize=["n_own", "NBK", "NC", "shift", "steps", "W", "T", "bwd_rows"])
def _bwd_kv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, OWN, n_own, CODES, PTR, CUM, BSTART, NBK, NC, shift, steps,
                   BITS, W, sm_scale, sm_scale_log2, T, H, HKV, bwd_rows, D: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, GATHERED: tl.constexpr,
                   F32_DOT: tl.constexpr, PREC: tl.constexpr):
    SUBS: tl.constexpr = BLOCK // BLOCK_N
    G = H // HKV
    pid = tl.program_id(0)
    dd = tl.arange(0, D)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    if not GATHERED:  # own-block rows of one key sub-tile, query heads [g0, g1) of its group
        ks = tl.load(OWN + pid)
        klen = tl.load(OWN + n_own + pid)
        kvh = tl.load(OWN + 2 * n_own + pid)
        r0 = tl.load(OWN + 3 * n_own + pid)
        r1 = tl.load(OWN + 4 * n_own + pid)
        g0 = tl.load(OWN + 5 * n_own + pid)
        g1 = tl.load(OWN + 6 * n_own + pid)
        bucket = tl.load(OWN + 7 * n_own + pid)
        pieces = tl.load(OWN + 8 * n_own + pid)
        mstart = tl.load(OWN + 9 * n_own + pid)
        cols = ks + tl.arange(0, BLOCK_N)
        col_ok = tl.arange(0, BLOCK_N) < klen
        kv = (cols.to(tl.int64)[:, None] * HKV + kvh) * D + dd[None, :]
        k = tl.load(K + kv, mask=col_ok[:, None], other=0.0)
        v = tl.load(V + kv, mask=col_ok[:, None], other=0.0)
        jb = (ks - mstart) // BLOCK  # local block of the key tile (masked path)
        for g in range(g0, g1):
            for r in range(r0, r1, BLOCK_M):
                rows = r + tl.arange(0, BLOCK_M)
                rh = rows.to(tl.int64) * H + kvh * G + g
                dk, dv = _kv_pair(Q, DO, LSE, DELTA, k, v, cols, col_ok, rh, rows < r1, dk, dv, sm_scale_log2, T, H,
                                  BITS, W, jb, mstart, D, MASKED, F32_DOT, PREC)
        # did any row choose this block? then gathered pieces add to it too
        has = bucket >= 0
        chosen = tl.load(PTR + (bucket + 1) * NC, mask=has, other=0) - tl.load(PTR + bucket * NC, mask=has, other=0)
        if (pieces == 1) & (chosen == 0):
            tl.store(DK + kv, dk * sm_scale, mask=col_ok[:, None])
            tl.store(DV + kv, dv, mask=col_ok[:, None])
        else:
            tl.atomic_add(DK + kv, dk * sm_scale, mask=col_ok[:, None], sem="relaxed")
            tl.atomic_add(DV + kv, dv, mask=col_ok[:, None], sem="relaxed")
    else:  # gathered rows: piece j of bucket b (<= bwd_rows entries over all chunks), key sub-tile sub
        piece = pid // SUBS
        sub = pid % SUBS
        b = _find(CUM, 1, NBK, piece, steps)
        if b < NBK:
            j = piece - tl.load(CUM + b - 1, mask=b > 0, other=0)
            e0 = tl.load(PTR + b * NC) + j * bwd_rows
            e1 = tl.minimum(e0 + bwd_rows, tl.load(PTR + (b + 1) * NC))
            kvh = b % HKV
            cols = tl.load(BSTART + b // HKV) + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols >= 0  # a chosen past block is full
            kv = (cols.to(tl.int64)[:, None] * HKV + kvh) * D + dd[None, :]
            k = tl.load(K + kv)
            v = tl.load(V + kv)
            for e in range(e0, e1, BLOCK_M):
                ent = e + tl.arange(0, BLOCK_M)
                ok = ent < e1
                rh = tl.load(CODES + ent, mask=ok, other=0).to(tl.int64) >> shift
                dk, dv = _kv_pair(Q, DO, LSE, DELTA, k, v, cols, col_ok, rh, ok, dk, dv, sm_scale_log2, T, H,
                                  BITS, W, 0, -1, D, False, F32_DOT, PREC)
            tl.atomic_add(DK + kv, dk * sm_scale, sem="relaxed")
            tl.atomic_add(DV + kv, dv, sem="relaxed")


@triton.jit
def _dq_tile(q, do, lse, delta, dq, k, v, keep, sm_scale_log2, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    """dQ of one (row tile, key tile) pair, [BLOCK_M, BLOCK_N]: S, dP, dQ."""
    p = tl.where(keep, tl.math.exp2(_dot(q, tl.trans(k), F32_DOT, PREC) * sm_scale_log2 - lse[:, None]), 0.0)
    ds = p * (_dot(do, tl.trans(v), F32_DOT, PREC) - delta[:, None])
    return dq + _dot(ds.to(k.dtype), k, F32_DOT, PREC)


@triton.jit(do_not_specialize=["W", "n_tiles", "T"])
def _bwd_dq_own_kernel(Q, K, V, DO, DQ, LSE, DELTA, TILES, BITS, W, n_tiles, sm_scale, sm_scale_log2, T, H, G,
                       D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       MASKED: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    HKV = H // G
    kvh = h // G
    q0, kfirst, bend, _, mstart = _query_tile(TILES, n_tiles, tile)
    rows = q0 + tl.arange(0, BLOCK_M)
    row_ok = rows < bend
    rows64 = rows.to(tl.int64)
    dd = tl.arange(0, D)
    off = (rows64[:, None] * H + h) * D + dd[None, :]
    q = tl.load(Q + off, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + off, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + h * T + rows64, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + h * T + rows64, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for kstart in range(kfirst, q0 + BLOCK_M, BLOCK_N):
        cols = kstart + tl.arange(0, BLOCK_N)
        col_ok = cols < bend
        kv = (cols.to(tl.int64)[:, None] * HKV + kvh) * D + dd[None, :]
        k = tl.load(K + kv, mask=col_ok[:, None], other=0.0)
        v = tl.load(V + kv, mask=col_ok[:, None], other=0.0)
        keep = (cols[None, :] <= rows[:, None]) & col_ok[None, :] & row_ok[:, None]
        if MASKED:
            keep = keep & _picked(BITS, rows64 * H + h, row_ok, W, (kstart - mstart) // BLOCK, mstart)[:, None]
        dq = _dq_tile(q, do, lse, delta, dq, k, v, keep, sm_scale_log2, F32_DOT, PREC)
    tl.store(DQ + off, dq * sm_scale, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["NBK", "NC", "c", "shift", "steps", "T"])
def _bwd_dq_past_kernel(Q, K, V, DO, DQ, LSE, DELTA, CODES, PTR, CUM, BSTART, NBK, NC, c, shift, steps, sm_scale,
                        sm_scale_log2, T, H, HKV, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    b, e0, e1, kstart, kvh = _item(CUM, PTR, BSTART, NBK, NC, c, tl.program_id(0), steps, HKV, BLOCK_M)
    if b < NBK:
        e = e0 + tl.arange(0, BLOCK_M)
        ok = e < e1
        rh = tl.load(CODES + e, mask=ok, other=0).to(tl.int64) >> shift
        t = rh // H
        h = rh % H
        dd = tl.arange(0, D)
        off = rh[:, None] * D + dd[None, :]
        q = tl.load(Q + off, mask=ok[:, None], other=0.0)
        do = tl.load(DO + off, mask=ok[:, None], other=0.0)
        lse = tl.load(LSE + h * T + t, mask=ok, other=0.0)
        delta = tl.load(DELTA + h * T + t, mask=ok, other=0.0)
        dq = tl.zeros([BLOCK_M, D], tl.float32)
        keep = ok[:, None] & (tl.arange(0, BLOCK_N) >= 0)[None, :]  # a past block precedes every row
        for kk in range(BLOCK // BLOCK_N):
            cols = (kstart + kk * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            k = tl.load(K + (cols[:, None] * HKV + kvh) * D + dd[None, :])
            v = tl.load(V + (cols[:, None] * HKV + kvh) * D + dd[None, :])
            dq = _dq_tile(q, do, lse, delta, dq, k, v, keep, sm_scale_log2, F32_DOT, PREC)
        tl.atomic_add(DQ + off, dq * sm_scale, mask=ok[:, None], sem="relaxed")


@triton.jit(do_not_specialize=["n_q", "n_kv"])
def _cast_kernel(DQ, DK, DV, OQ, OK, OV, n_q, n_kv, BLK: tl.constexpr):
    i = tl.program_id(0) * BLK + tl.arange(0, BLK)
    which = tl.program_id(1)
    if which == 0:
        tl.store(OQ + i, tl.load(DQ + i, mask=i < n_q).to(OQ.dtype.element_ty), mask=i < n_q)
    elif which == 1:
        tl.store(OK + i, tl.load(DK + i, mask=i < n_kv).to(OK.dtype.element_ty), mask=i < n_kv)
    else:
        tl.store(OV + i, tl.load(DV + i, mask=i < n_kv).to(OV.dtype.element_ty), mask=i < n_kv)


def moba_backward(plan: MobaPlan, idx: MobaIndex, q, k, v, o, lse, do, *, interpreting: bool):
    """(dq, dk, dv) in the input dtype (accumulated in fp32)."""
    T, H, D = q.shape
    HKV = k.shape[1]
    dev = q.device
    f32, prec = dot_mode(q.dtype, interpreting)
    scale = 1.0 / math.sqrt(D)
    delta = torch.empty((H, T), dtype=torch.float32, device=dev)
    dq = torch.empty(q.shape, dtype=torch.float32, device=dev)
    dk = torch.empty(k.shape, dtype=torch.float32, device=dev)
    dv = torch.empty(v.shape, dtype=torch.float32, device=dev)
    BR = 32
    _bwd_prep_kernel[(-(-T // BR), H)](o, do, delta, dk, dv, T, H, HKV, D=D, BR=BR, num_warps=4)
    nbk = plan.n_blocks * HKV
    steps = max(1, nbk.bit_length())
    bits = q if idx.bits is None else idx.bits
    kv, own, past = plan.cfg["bwd_kv"], plan.cfg["bwd_dq_own"], plan.cfg["bwd_dq_past"]
    common = {"D": D, "BLOCK": plan.block, "F32_DOT": f32, "PREC": prec}
    # own pieces (unmasked, masked) and gathered pieces: three variants, each spill-free on sm_90a
    for n, tab, mk, gathered in ((plan.n_own, plan.dev["own"], False, False),
                                 (plan.n_own_masked, plan.dev["own_masked"], True, False),
                                 (plan.gathered_grid, plan.dev["own"], False, True)):
        if n:
            _bwd_kv_kernel[(n,)](q, k, v, do, dk, dv, lse, delta, tab, tab.shape[1], idx.codes, idx.ptr, idx.cum_bwd,
                                 plan.dev["bstart"], nbk, plan.nc, plan.shift, steps, bits, plan.words, scale,
                                 scale * LOG2E, T, H, HKV, plan.bwd_entries, BLOCK_M=kv.block_m, BLOCK_N=kv.block_n,
                                 MASKED=mk, GATHERED=gathered, num_warps=kv.warps, num_stages=kv.stages, **common)
    for ch in plan.chunks:  # own-block dQ first: it stores, the gathered parts add after it
        for tiles, mk in ((ch.q_tiles, False), (ch.q_tiles_masked, True)):
            n_t = tiles.shape[1]
            if n_t:
                _bwd_dq_own_kernel[(n_t, H)](q, k, v, do, dq, lse, delta, tiles, bits, plan.words, n_t, scale,
                                             scale * LOG2E, T, H, H // HKV, BLOCK_M=own.block_m, BLOCK_N=own.block_n,
                                             MASKED=mk, num_warps=own.warps, num_stages=own.stages, **common)
    for c, ch in enumerate(plan.chunks):
        if ch.past_grid:
            _bwd_dq_past_kernel[(ch.past_grid,)](q, k, v, do, dq, lse, delta, idx.codes, idx.ptr, idx.cum_fwd,
                                                 plan.dev["bstart"], nbk, plan.nc, c, plan.shift, steps, scale,
                                                 scale * LOG2E, T, H, HKV, BLOCK_M=past.block_m, BLOCK_N=past.block_n,
                                                 num_warps=past.warps, num_stages=past.stages, **common)
    if q.dtype == torch.float32:
        return dq, dk, dv
    oq, ok, ov = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    BLK = 1024
    _cast_kernel[(-(-max(dq.numel(), dk.numel()) // BLK), 3)](dq, dk, dv, oq, ok, ov, dq.numel(), dk.numel(),
                                                                      BLK=BLK, num_warps=4)
    return oq, ok, ov
