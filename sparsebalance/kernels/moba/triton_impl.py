"""MoBA block-sparse attention in Triton: forward, dq and dk/dv kernels behind a torch.autograd.Function.

Layout (FlashAttention varlen): q [T, H, D], k and v [T, H_kv, D], cu_seqlens int32 [N + 1], topk
LongTensor [N] (one budget per sequence, own block included). Semantics: issue 4 / ``naive.py``.

Forward and dq run one program per (query tile, head). A tile (``BLOCK_M`` rows, a divisor of the
block size B) first attends its own block causally -- every valid row then has a finite running max
-- and then loops over the sorted union of past blocks its rows selected; a row that did not select
a block masks it to -inf. Online softmax in the exp2 domain with fp32 accumulators; the forward
saves LSE (log2 units) [H, T]. dk/dv run one program per (key tile, kv head) and loop over the
(query tile, query head) pairs of the inverse index, so GQA groups reduce inside the program.

Under ``TRITON_INTERPRET=1`` tiles are cast to fp32 before ``tl.dot`` (the interpreter multiplies
bf16 bit patterns); on a GPU bf16/fp16 tiles go to ``tl.dot`` directly (wgmma on Hopper) and fp32
inputs use ``input_precision="ieee"`` so fp32 stays exact rather than TF32.
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


@triton.jit
def _tile_scores(q, k, ONE_DOT: tl.constexpr, PREC: tl.constexpr):
    """q [M, D] @ k[N, D]^T in fp32 (fp32 tiles under the interpreter)."""
    if ONE_DOT:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PREC)
    return tl.dot(q, tl.trans(k), input_precision=PREC)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, SEL, UNION, UCOUNT, QT_START, QT_S0, QT_S1,
                sm_scale_log2, T, H, G, U,
                D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                K1P: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    q0 = tl.load(QT_START + tile)
    s0 = tl.load(QT_S0 + tile)
    s1 = tl.load(QT_S1 + tile)
    rows = q0 + tl.arange(0, BLOCK_M)
    row_ok = rows < s1
    dd = tl.arange(0, D)
    q = tl.load(Q + (rows[:, None] * H + h) * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    sel = tl.load(SEL + (rows[:, None] * H + h) * K1P + tl.arange(0, K1P)[None, :],
                  mask=row_ok[:, None], other=-1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    own = (q0 - s0) // BLOCK
    # own block, causal: key tiles from the block start up to the tile's last row
    for kstart in range(s0 + own * BLOCK, q0 + BLOCK_M, BLOCK_N):
        cols = kstart + tl.arange(0, BLOCK_N)
        col_ok = cols < s1
        k = tl.load(K + (cols[:, None] * (H // G) + kvh) * D + dd[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(V + (cols[:, None] * (H // G) + kvh) * D + dd[None, :], mask=col_ok[:, None], other=0.0)
        s = _tile_scores(q, k, F32_DOT, PREC) * sm_scale_log2
        s = tl.where((cols[None, :] <= rows[:, None]) & col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    # past blocks: the union of the rows' selections; rows that did not pick block j mask it
    base = (tile * H + h) * U
    n = tl.load(UCOUNT + tile * H + h)
    # one flat loop over (union entry, key sub-tile) so the pipeliner sees a single body
    SUBS: tl.constexpr = BLOCK // BLOCK_N
    for i in range(n * SUBS):
        j = tl.load(UNION + base + i // SUBS)
        hit = tl.sum((sel == j).to(tl.int32), 1) > 0
        cols = s0 + j * BLOCK + (i % SUBS) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.load(K + (cols[:, None] * (H // G) + kvh) * D + dd[None, :])
        v = tl.load(V + (cols[:, None] * (H // G) + kvh) * D + dd[None, :])
        s = _tile_scores(q, k, F32_DOT, PREC) * sm_scale_log2
        s = tl.where(hit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + (rows[:, None] * H + h) * D + dd[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h * T + rows, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, SEL, UNION, UCOUNT, QT_START, QT_S0, QT_S1,
                   sm_scale, sm_scale_log2, T, H, G, U,
                   D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   K1P: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    HKV = H // G
    q0 = tl.load(QT_START + tile)
    s0 = tl.load(QT_S0 + tile)
    s1 = tl.load(QT_S1 + tile)
    rows = q0 + tl.arange(0, BLOCK_M)
    row_ok = rows < s1
    dd = tl.arange(0, D)
    q = tl.load(Q + (rows[:, None] * H + h) * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + (rows[:, None] * H + h) * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + h * T + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + h * T + rows, mask=row_ok, other=0.0)
    sel = tl.load(SEL + (rows[:, None] * H + h) * K1P + tl.arange(0, K1P)[None, :],
                  mask=row_ok[:, None], other=-1)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    own = (q0 - s0) // BLOCK
    for kstart in range(s0 + own * BLOCK, q0 + BLOCK_M, BLOCK_N):
        cols = kstart + tl.arange(0, BLOCK_N)
        col_ok = cols < s1
        k = tl.load(K + (cols[:, None] * HKV + kvh) * D + dd[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(V + (cols[:, None] * HKV + kvh) * D + dd[None, :], mask=col_ok[:, None], other=0.0)
        s = _tile_scores(q, k, F32_DOT, PREC) * sm_scale_log2
        keep = (cols[None, :] <= rows[:, None]) & col_ok[None, :]
        p = tl.where(keep, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = _tile_scores(do, v, F32_DOT, PREC)
        ds = p * (dp - delta[:, None])
        if F32_DOT:
            dq += tl.dot(ds, k.to(tl.float32), input_precision=PREC)
        else:
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    base = (tile * H + h) * U
    n = tl.load(UCOUNT + tile * H + h)
    SUBS: tl.constexpr = BLOCK // BLOCK_N
    for i in range(n * SUBS):
        j = tl.load(UNION + base + i // SUBS)
        hit = tl.sum((sel == j).to(tl.int32), 1) > 0
        cols = s0 + j * BLOCK + (i % SUBS) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.load(K + (cols[:, None] * HKV + kvh) * D + dd[None, :])
        v = tl.load(V + (cols[:, None] * HKV + kvh) * D + dd[None, :])
        s = _tile_scores(q, k, F32_DOT, PREC) * sm_scale_log2
        p = tl.where(hit[:, None], tl.math.exp2(s - lse[:, None]), 0.0)
        dp = _tile_scores(do, v, F32_DOT, PREC)
        ds = p * (dp - delta[:, None])
        if F32_DOT:
            dq += tl.dot(ds, k.to(tl.float32), input_precision=PREC)
        else:
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    dq = dq * sm_scale
    tl.store(DQ + (rows[:, None] * H + h) * D + dd[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, SEL, QT_START, QT_S0, QT_S1, QT_GB,
                     KT_START, KT_GB, KT_S1, INV_PTR, INV_TILE, INV_HEAD,
                     sm_scale, sm_scale_log2, T, H, G,
                     D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     K1P: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    kt = tl.program_id(0)
    kvh = tl.program_id(1)
    HKV = H // G
    k0 = tl.load(KT_START + kt)
    gb = tl.load(KT_GB + kt)
    ks1 = tl.load(KT_S1 + kt)
    cols = k0 + tl.arange(0, BLOCK_N)
    col_ok = cols < ks1
    dd = tl.arange(0, D)
    k = tl.load(K + (cols[:, None] * HKV + kvh) * D + dd[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(V + (cols[:, None] * HKV + kvh) * D + dd[None, :], mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    e0 = tl.load(INV_PTR + gb * HKV + kvh)
    e1 = tl.load(INV_PTR + gb * HKV + kvh + 1)
    for e in range(e0, e1):
        tile = tl.load(INV_TILE + e)
        h = tl.load(INV_HEAD + e)
        q0 = tl.load(QT_START + tile)
        s0 = tl.load(QT_S0 + tile)
        s1 = tl.load(QT_S1 + tile)
        is_own = tl.load(QT_GB + tile) == gb
        jloc = (k0 - s0) // BLOCK
        rows = q0 + tl.arange(0, BLOCK_M)
        row_ok = rows < s1
        q = tl.load(Q + (rows[:, None] * H + h) * D + dd[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + (rows[:, None] * H + h) * D + dd[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + h * T + rows, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + h * T + rows, mask=row_ok, other=0.0)
        sel = tl.load(SEL + (rows[:, None] * H + h) * K1P + tl.arange(0, K1P)[None, :],
                      mask=row_ok[:, None], other=-1)
        hit = (tl.sum((sel == jloc).to(tl.int32), 1) > 0) & row_ok
        # transposed tiles [BLOCK_N, BLOCK_M]: keys on rows, queries on columns
        keep = (is_own & (cols[:, None] <= rows[None, :]) & row_ok[None, :]) | (~is_own & hit[None, :])
        keep = keep & col_ok[:, None]
        sT = _tile_scores(k, q, F32_DOT, PREC) * sm_scale_log2
        pT = tl.where(keep, tl.math.exp2(sT - lse[None, :]), 0.0)
        dpT = _tile_scores(v, do, F32_DOT, PREC)
        dsT = pT * (dpT - delta[None, :])
        if F32_DOT:
            dv += tl.dot(pT, do.to(tl.float32), input_precision=PREC)
            dk += tl.dot(dsT, q.to(tl.float32), input_precision=PREC)
        else:
            dv += tl.dot(pT.to(do.dtype), do, input_precision=PREC)
            dk += tl.dot(dsT.to(q.dtype), q, input_precision=PREC)
    dk = dk * sm_scale
    tl.store(DK + (cols[:, None] * HKV + kvh) * D + dd[None, :], dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + (cols[:, None] * HKV + kvh) * D + dd[None, :], dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


def launch_config(block_size: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch options: BLOCK_M/BLOCK_N (divisors of the block), warps, stages.

    Picked with ``benchmarks/inspect_triton_sm90.py`` (sm_90a, bf16, D = 128, block 128): 64 x 64 tiles
    on 8 warps are the only candidate with no spills in all three kernels, and every tl.dot lowers to
    wgmma (table in README.md, "Triton kernel"); not yet tuned by GPU timings.
    """
    if head_dim >= 128:
        return {"BLOCK_M": min(64, block_size), "BLOCK_N": min(64, block_size), "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": min(64, block_size), "BLOCK_N": min(64, block_size), "num_warps": 4, "num_stages": 2}


def _dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(cast tiles to fp32 before tl.dot, input_precision)."""
    if _interpreting():
        return True, "ieee"
    return dtype == torch.float32, "ieee" if dtype == torch.float32 else "tf32"


class _MobaTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, block_size, topk, block_m, block_n):
        T, H, D = q.shape
        G = H // k.shape[1]
        idx: MobaIndex = build_index(q.detach(), k.detach(), cu_seqlens, block_size, topk, block_m, block_n)
        cfg = launch_config(block_size, D, q.dtype)
        f32, prec = _dot_mode(q.dtype)
        o = torch.empty_like(q)
        lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
        nq = idx.qt_start.numel()
        U = idx.union.shape[-1]
        scale = 1.0 / math.sqrt(D)
        _fwd_kernel[(nq, H)](
            q, k, v, o, lse, idx.sel, idx.union, idx.ucount, idx.qt_start, idx.qt_seq_start, idx.qt_seq_end,
            scale * LOG2E, T, H, G, U, D=D, BLOCK=block_size, BLOCK_M=block_m, BLOCK_N=block_n, K1P=idx.k1p,
            F32_DOT=f32, PREC=prec, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.idx, ctx.block_size, ctx.block_m, ctx.block_n = idx, block_size, block_m, block_n
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        idx: MobaIndex = ctx.idx
        B, bm, bn = ctx.block_size, ctx.block_m, ctx.block_n
        T, H, D = q.shape
        HKV = k.shape[1]
        G = H // HKV
        do = do.contiguous()
        cfg = launch_config(B, D, q.dtype)
        f32, prec = _dot_mode(q.dtype)
        delta = (do.float() * o.float()).sum(-1).transpose(0, 1).contiguous()  # [H, T]
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        scale = 1.0 / math.sqrt(D)
        nq = idx.qt_start.numel()
        opts = {"D": D, "BLOCK": B, "BLOCK_M": bm, "BLOCK_N": bn, "K1P": idx.k1p, "F32_DOT": f32, "PREC": prec,
                    "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        _bwd_dq_kernel[(nq, H)](
            q, k, v, do, dq, lse, delta, idx.sel, idx.union, idx.ucount, idx.qt_start, idx.qt_seq_start,
            idx.qt_seq_end, scale, scale * LOG2E, T, H, G, idx.union.shape[-1], **opts)
        _bwd_dkdv_kernel[(idx.kt_start.numel(), HKV)](
            q, k, v, do, dk, dv, lse, delta, idx.sel, idx.qt_start, idx.qt_seq_start, idx.qt_seq_end,
            idx.qt_gblock, idx.kt_start, idx.kt_gblock, idx.kt_seq_end, idx.inv_ptr, idx.inv_tile,
            idx.inv_head, scale, scale * LOG2E, T, H, G, **opts)
        return dq, dk, dv, None, None, None, None, None


def _validate(q, k, v, cu_seqlens, block_size, topk) -> torch.Tensor:
    """Check the arguments (ConfigError naming the argument); return topk as a LongTensor [N] on q's device."""
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
                          block_n: int | None = None) -> torch.Tensor:
    """MoBA attention with the Triton kernels; differentiable in q, k, v.

    q: [T, H, D]; k, v: [T, H_kv, D]; cu_seqlens: int [N + 1]; topk: int or LongTensor [N] (budget per
    sequence, own block included). Returns out [T, H, D] in q's dtype. ``block_m`` / ``block_n`` (query
    and key tile rows, powers of two dividing ``block_size``) default to :func:`launch_config`.
    """
    topk = _validate(q, k, v, cu_seqlens, block_size, topk)
    cfg = launch_config(block_size, q.shape[2], q.dtype)
    bm = block_m or cfg["BLOCK_M"]
    bn = block_n or cfg["BLOCK_N"]
    for name, t in (("block_m", bm), ("block_n", bn)):
        if t < 1 or t & (t - 1) or block_size % t:
            raise ConfigError(f"{name}: must be a power of two dividing block_size={block_size}, got {t}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _MobaTriton.apply(q, k, v, cu_seqlens, block_size, topk, bm, bn)
