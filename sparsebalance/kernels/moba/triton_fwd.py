"""MoBA forward in Triton, key-block-major: the past-block kernel and the own-block + merge kernel.

* ``_fwd_past_kernel``: one program per ``block_m`` gathered entries of one bucket (key block, kv
  head) of one forward chunk: the rows' attention over the whole key block (a past block is full
  and precedes every gathered row: no mask), stored normalised with its log-sum-exp (log2) in the
  chunk's partial buffer at the entry's code. The grid is a host upper bound of the chunk's items;
  a program finds its item by binary search in the index's running item counts and exits past the
  last.
* ``_fwd_own_merge_kernel``: one program per (query tile, head): the own block causally (the whole
  causal prefix when dense or on the masked path), then the row's min(k - 1, c) partials merged by
  log-sum-exp in registers; writes O and LSE [H, T] (log2). ``MASKED``: every (row, key tile)
  pair is kept only where the row's bit word says it attends the tile's block; no merge.

Under ``TRITON_INTERPRET=1`` tiles are cast to fp32 before ``tl.dot`` (the interpreter multiplies
bf16 bit patterns); on a GPU bf16/fp16 tiles go to ``tl.dot`` directly (wgmma on Hopper) and fp32
inputs use ``input_precision="ieee"``. Per-call integers are ``do_not_specialize`` (no JIT variant
per "is 1" / "divisible by 16" of them).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparsebalance.kernels.moba.plan import MobaPlan
from sparsebalance.kernels.moba.triton_select import MobaIndex

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    """a @ b with fp32 accumulation (fp32 operands under the interpreter or for fp32 inputs)."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a, b.to(a.dtype), input_precision=PREC)


@triton.jit
def _find(CUM, stride, n, i, steps):
    """The first b < n with CUM[b * stride] > i (running counts, non-decreasing), n when none."""
    lo = i * 0
    hi = lo + n
    for _ in range(steps):
        mid = (lo + hi) // 2
        v = tl.load(CUM + mid * stride, mask=mid < n, other=0)
        right = (mid < n) & (v <= i)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _item(CUM, PTR, BSTART, NBK, NC, c, i, steps, HKV, BLOCK_M: tl.constexpr):
    """Forward item ``i`` of chunk ``c`` (``BLOCK_M`` entries of one bucket): (bucket -- NBK past the
    last item --, first entry, end entry, first key row, kv head)."""
    b = _find(CUM + c, NC, NBK, i, steps)
    on = b < NBK
    j = i - tl.load(CUM + (b - 1) * NC + c, mask=on & (b > 0), other=0)
    e0 = tl.load(PTR + b * NC + c, mask=on, other=0) + j * BLOCK_M
    e1 = tl.load(PTR + b * NC + c + 1, mask=on, other=0)
    return b, e0, e1, tl.load(BSTART + b // HKV, mask=on, other=0), b % HKV


@triton.jit
def _query_tile(TILES, n_tiles, tile):
    """A query tile's (first row, first key row, block end, slots to merge, mask start): the first key
    is the own block's start, or the sequence start when dense or masked; the mask start is the
    sequence start on the masked dense path, else -1; every slot below the count holds a partial."""
    return (tl.load(TILES + tile), tl.load(TILES + n_tiles + tile), tl.load(TILES + 2 * n_tiles + tile),
            tl.load(TILES + 3 * n_tiles + tile), tl.load(TILES + 4 * n_tiles + tile))


@triton.jit
def _softmax_step(s, m_i, l_i, acc, v, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    """One key tile of the online softmax: scores ``s`` (log2 units) and values ``v`` into the running
    max, sum and accumulator."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT, PREC)


@triton.jit
def _picked(BITS, rh, row_ok, W, jb, mstart):
    """Per row (t * H + h): does it attend local block ``jb``? All True for an unmasked tile
    (``mstart`` < 0: the masked load returns -1, every bit set)."""
    on = row_ok & (tl.full(row_ok.shape, 0, tl.int32) + mstart >= 0)
    word = tl.load(BITS + rh * W + jb // 32, mask=on, other=-1)
    return ((word >> (jb % 32)) & 1) != 0


@triton.jit(do_not_specialize=["NBK", "NC", "c", "row0", "shift", "steps"])
def _fwd_past_kernel(Q, K, V, PO, PL, CODES, PTR, CUM, BSTART, NBK, NC, c, row0, shift, steps, sm_scale_log2, H,
                     HKV, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     F32_DOT: tl.constexpr, PREC: tl.constexpr):
    b, e0, e1, kstart, kvh = _item(CUM, PTR, BSTART, NBK, NC, c, tl.program_id(0), steps, HKV, BLOCK_M)
    if b < NBK:
        e = e0 + tl.arange(0, BLOCK_M)
        ok = e < e1
        code = tl.load(CODES + e, mask=ok, other=0).to(tl.int64)
        rh = code >> shift  # t * H + h of each gathered row
        dd = tl.arange(0, D)
        q = tl.load(Q + rh[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for kk in range(BLOCK // BLOCK_N):
            cols = (kstart + kk * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            k = tl.load(K + (cols[:, None] * HKV + kvh) * D + dd[None, :])
            v = tl.load(V + (cols[:, None] * HKV + kvh) * D + dd[None, :])
            m_i, l_i, acc = _softmax_step(_dot(q, tl.trans(k), F32_DOT, PREC) * sm_scale_log2, m_i, l_i, acc, v,
                                          F32_DOT, PREC)
        slot = code - ((row0 * H).to(tl.int64) << shift)
        tl.store(PO + slot[:, None] * D + dd[None, :], (acc / l_i[:, None]).to(PO.dtype.element_ty),
                 mask=ok[:, None])
        tl.store(PL + slot, m_i + tl.math.log2(l_i), mask=ok)


@triton.jit(do_not_specialize=["W", "n_tiles", "row0", "T", "shift"])
def _fwd_own_merge_kernel(Q, K, V, O, LSE, PO, PL, TILES, BITS, W, n_tiles, row0, sm_scale_log2, T, H, G, shift,
                          D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          MASKED: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    HKV = H // G
    kvh = h // G
    q0, kfirst, bend, n_slots, mstart = _query_tile(TILES, n_tiles, tile)
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
    # afterwards every valid row has a finite running max (its diagonal), so merging is safe
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
        m_i, l_i, acc = _softmax_step(tl.where(keep, s, float("-inf")), m_i, l_i, acc, v, F32_DOT, PREC)
    if not MASKED:  # merge the partials of the chosen past blocks: (o_p normalised, lse_p) -> 2^(lse_p - m)
        base = ((rows64 - row0) * H + h) << shift
        for s in range(n_slots):
            pl = tl.load(PL + base + s, mask=row_ok, other=float("-inf"))
            po = tl.load(PO + (base + s)[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            m_new = tl.maximum(m_i, pl)
            alpha = tl.math.exp2(m_i - m_new)
            beta = tl.math.exp2(pl - m_new)
            l_i = l_i * alpha + beta
            acc = acc * alpha[:, None] + po * beta[:, None]
            m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + (rows64[:, None] * H + h) * D + dd[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h * T + rows64, m_i + tl.math.log2(l_i), mask=row_ok)


def dot_mode(dtype: torch.dtype, interpreting: bool) -> tuple[bool, str]:
    """(cast tiles to fp32 before tl.dot, input_precision)."""
    if interpreting:
        return True, "ieee"
    return dtype == torch.float32, "ieee" if dtype == torch.float32 else "tf32"


def moba_forward(plan: MobaPlan, idx: MobaIndex, q, k, v, *, interpreting: bool):
    """Output [T, H, D] and LSE [H, T] (log2) of one call."""
    T, H, D = q.shape
    HKV = k.shape[1]
    f32, prec = dot_mode(q.dtype, interpreting)
    scale_log2 = LOG2E / math.sqrt(D)
    o = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    slots = max(1, plan.partial_rows * H * plan.k1p)
    po = torch.empty((slots, D), dtype=q.dtype, device=q.device)  # reused by every chunk, in stream order
    pl = torch.empty(slots, dtype=torch.float32, device=q.device)
    bits = q if idx.bits is None else idx.bits
    nbk = plan.n_blocks * HKV
    steps = max(1, nbk.bit_length())
    cp, cm = plan.cfg["fwd_past"], plan.cfg["fwd_own_merge"]
    for c, ch in enumerate(plan.chunks):
        if ch.past_grid:
            _fwd_past_kernel[(ch.past_grid,)](q, k, v, po, pl, idx.codes, idx.ptr, idx.cum_fwd, plan.dev["bstart"], nbk,
                                              plan.nc, c, ch.row0, plan.shift, steps, scale_log2, H, HKV, D=D,
                                              BLOCK=plan.block, BLOCK_M=cp.block_m, BLOCK_N=cp.block_n, F32_DOT=f32,
                                              PREC=prec, num_warps=cp.warps, num_stages=cp.stages)
        for tiles, mk in ((ch.q_tiles, False), (ch.q_tiles_masked, True)):
            n_t = tiles.shape[1]
            if n_t:
                _fwd_own_merge_kernel[(n_t, H)](q, k, v, o, lse, po, pl, tiles, bits, plan.words, n_t, ch.row0,
                                                scale_log2, T, H, H // HKV, plan.shift, D=D, BLOCK=plan.block,
                                                BLOCK_M=cm.block_m, BLOCK_N=cm.block_n, MASKED=mk, F32_DOT=f32,
                                                PREC=prec, num_warps=cm.warps, num_stages=cm.stages)
    return o, lse
