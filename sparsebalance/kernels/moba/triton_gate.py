"""The fused MoBA gate in Triton: block means, scores and exact top-k, writing the index's input.

Semantics are ``gate.py``'s (README "Math"): query t of block c scores past blocks j < c by
q_t . mean_j in float32 and chooses the k - 1 best (all of them when c <= k - 1); **among equal
scores the lower block index wins**. Exactness without a data-dependent shape: each score and its
block index are packed into one int64 key, (score as an order-preserving int32) x 2^32 +
(2^31 - 1 - j), so keys are distinct, a larger key is a better block and an equal score goes to the
lower index; the k - 1 largest keys are then unique. Per program (a tile of ``gate`` rows inside
one block, one query head) the keys of ``kw`` past blocks at a time are joined with the running
best ``kw`` and cut back by a bitonic top-k in registers: no score matrix beyond one [rows, kw]
tile is ever written. -0.0 scores are made +0.0 first (float comparison ties them).

Outputs, all fixed-size (counts in closed form, ``plan.py``):

* sparse sequences: every (row, head, choice) as an entry at its closed-form position: the sort key
  (bucket = (global block, kv head)) x chunks + forward chunk, and the code (t H + h) k1p + slot;
* masked-path sequences: the row's bit words (chosen blocks and its own block);
* optionally (tests, the PyTorch top-k) ``sel`` [T, H, k1p]: chosen local blocks ascending, -1 padded.

Scores use fp32 operands with ``input_precision="ieee"`` (CUDA cores on Hopper, not tf32), as
PyTorch's float32 gate does. Budgets whose slots exceed ``plan.GATE_MAX_KW`` take the top-k in
PyTorch (:func:`select_torch`, the same packed keys, ``torch.topk``: no synchronisation) and the
kernel's ``FROM_SEL`` variant only emits the entries and bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsebalance.kernels.moba.bitonic import merge_rows, sort_rows
from sparsebalance.kernels.moba.plan import MobaPlan

INT64_MIN = -(2**63)
_KEY_NONE = tl.constexpr(INT64_MIN)  # the key of a block that is not past: below every real key
MAXJ = 2**31 - 1
#: Block id of an unused slot in the ascending sort (sums of two stay inside int32: see bitonic.py).
PAD = 2**30


@triton.jit
def _block_means_kernel(K, MEANS, BLOCKS, n, HKV, D: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.load(BLOCKS + i)
    start = tl.load(BLOCKS + n + i)
    length = tl.load(BLOCKS + 2 * n + i)
    dd = tl.arange(0, D)
    acc = tl.zeros([BR, D], tl.float32)
    for r0 in range(0, BLOCK, BR):
        r = r0 + tl.arange(0, BR)
        rows = (start + r).to(tl.int64)
        acc += tl.load(K + (rows[:, None] * HKV + kvh) * D + dd[None, :], mask=(r < length)[:, None],
                       other=0.0).to(tl.float32)
    tl.store(MEANS + (g.to(tl.int64) * HKV + kvh) * D + dd, tl.sum(acc, 0) / length)


@triton.jit
def _pack(s, j):
    """Distinct int64 keys: larger score first, then lower block index ``j``."""
    s = tl.where(s == 0.0, 0.0, s)
    b = s.to(tl.int32, bitcast=True)
    o = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return o.to(tl.int64) * 4294967296 + (2147483647 - j).to(tl.int64)[None, :]


@triton.jit
def _emit_entries(KEYS, CODES, ids, p, ok, t, h, H, HKV, kvh, gbase, nsel, pos0, chunk, NC, shift):
    pos = pos0[:, None] + p[None, :]
    key = ((gbase + ids) * HKV + kvh) * NC + chunk
    tl.store(KEYS + pos, key.to(KEYS.dtype.element_ty), mask=ok)
    code = ((t * H + h) << shift)[:, None] + p[None, :]
    tl.store(CODES + pos, code.to(CODES.dtype.element_ty), mask=ok)


@triton.jit
def _word(ids, ok, w):
    """Bit word ``w`` of the chosen blocks (distinct bits: their sum is their OR)."""
    bit = tl.full(ids.shape, 1, tl.int64) << (ids % 32).to(tl.int64)
    return tl.sum(tl.where(ok & (ids // 32 == w), bit, 0), axis=1)


@triton.jit(do_not_specialize=["n_tiles", "NC", "shift", "W", "write_sel"])
def _gate_kernel(Q, MEANS, SEL, KEYS, CODES, BITS, TILES, n_tiles, H, HKV, NC, shift, W, write_sel,
                 D: tl.constexpr, KW: tl.constexpr, M: tl.constexpr, BM: tl.constexpr, FROM_SEL: tl.constexpr):
    # a program: BM (row, query head) pairs of one block and kv head -- the group's heads share the
    # block means it loads; pair m of the block is row m // G, head kvh * G + m % G
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    G = H // HKV
    row0 = tl.load(TILES + tile)
    nrows = tl.load(TILES + n_tiles + tile)
    c = tl.load(TILES + 2 * n_tiles + tile)
    gbase = tl.load(TILES + 3 * n_tiles + tile)
    nsel = tl.load(TILES + 4 * n_tiles + tile)
    masked = tl.load(TILES + 5 * n_tiles + tile)
    eoff = tl.load(TILES + 6 * n_tiles + tile)
    chunk = tl.load(TILES + 7 * n_tiles + tile)
    m = tl.load(TILES + 8 * n_tiles + tile) + tl.arange(0, BM)
    r = m // G
    h = kvh * G + m % G
    row_ok = r < nrows
    t = row0 + r
    slots = (t * H + h) << shift
    pos0 = eoff + (r * H + h) * nsel                     # first entry of each pair (code order)
    own = (c * 0 + 1) << (c % 32)                       # the own block's bit, in word c // 32
    if FROM_SEL:  # the top-k ran in PyTorch: emit from sel in slot chunks of KW
        if masked == 0:
            for p0 in range(0, 1 << shift, KW):
                p = p0 + tl.arange(0, KW)
                ok = row_ok[:, None] & (p[None, :] < nsel)
                ids = tl.load(SEL + slots[:, None] + p[None, :], mask=ok, other=0)
                _emit_entries(KEYS, CODES, ids, p, ok, t, h, H, HKV, kvh, gbase, nsel, pos0, chunk, NC, shift)
        else:
            for w in range(W):
                acc = tl.zeros([BM], tl.int64) + tl.where(c // 32 == w, own, 0)
                for p0 in range(0, 1 << shift, KW):
                    p = p0 + tl.arange(0, KW)
                    ok = row_ok[:, None] & (p[None, :] < nsel)
                    acc += _word(tl.load(SEL + slots[:, None] + p[None, :], mask=ok, other=0), ok, w)
                tl.store(BITS + (t * H + h) * W + w, acc.to(tl.int32), mask=row_ok)
    else:
        p = tl.arange(0, KW)
        if c <= nsel:  # c <= k - 1: every past block, no scores
            ids = tl.zeros([BM, KW], tl.int32) + p[None, :]
        else:
            dd = tl.arange(0, D)
            q = tl.load(Q + (t * H + h)[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
            q = q.to(tl.float32)
            best = tl.full([BM, KW], _KEY_NONE, tl.int64)
            for j0 in range(0, c, KW):
                j = j0 + p
                mj = tl.load(MEANS + ((gbase + j).to(tl.int64)[:, None] * HKV + kvh) * D + dd[None, :],
                             mask=(j < c)[:, None], other=0.0)
                key = tl.where((j < c)[None, :], _pack(tl.dot(q, tl.trans(mj), input_precision="ieee"), j), _KEY_NONE)
                best = merge_rows(tl.maximum(best, sort_rows(key, 0, M)), 1, M)  # the KW best, descending
            got = (2147483647 - (best & 0xFFFFFFFF)).to(tl.int32)
            ids = sort_rows(tl.where(p[None, :] < nsel, got, 1073741824), 0, M)  # chosen ids ascending, PAD last
        ok = row_ok[:, None] & (p[None, :] < nsel)
        if write_sel:
            tl.store(SEL + slots[:, None] + p[None, :], tl.where(ok, ids, -1),
                     mask=row_ok[:, None] & (p[None, :] < (1 << shift)))
        if masked == 0:
            _emit_entries(KEYS, CODES, ids, p, ok, t, h, H, HKV, kvh, gbase, nsel, pos0, chunk, NC, shift)
        else:
            for w in range(W):
                word = _word(ids, ok, w) + tl.where(c // 32 == w, own, 0)
                tl.store(BITS + (t * H + h) * W + w, word.to(tl.int32), mask=row_ok)


def pack_keys(scores: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The kernel's packed keys in PyTorch: fp32 ``scores`` [..., n], block ids ``j`` [n]."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores).contiguous()
    b = s.view(torch.int32)
    o = torch.where(b < 0, b ^ 0x7FFFFFFF, b).long()
    return o * 2**32 + (MAXJ - j.long())


def select_torch(plan: MobaPlan, q: torch.Tensor, means: torch.Tensor, sel: torch.Tensor, *,
                 chunk_elems: int = 1 << 24) -> None:
    """The gate's top-k in PyTorch (wide budgets): ``sel`` of every gated sequence's rows, with the
    kernel's packed keys and ``torch.topk`` (distinct keys: exact, fixed-size, no sync)."""
    from sparsebalance.kernels.moba.gate import gate_scores

    B, H, k1p = plan.block, plan.H, plan.k1p
    dev = q.device
    for s0, L, base, kk, _ in plan.sel_seqs:
        n = -(-L // B)
        sel[s0:s0 + min(B, L)] = -1
        rows = max(B, chunk_elems // max(1, H * n))
        for r0 in range(s0 + B, s0 + L, rows):
            r1 = min(s0 + L, r0 + rows)
            npast = (r1 - 1 - s0) // B
            j = torch.arange(npast, device=dev)
            c = (torch.arange(r0, r1, device=dev) - s0) // B
            keys = pack_keys(gate_scores(q[r0:r1], means[base:base + npast]), j)
            keys = keys.masked_fill((j[None, :] >= c[:, None])[:, None, :], INT64_MIN)
            w = min(k1p, npast)
            top = torch.topk(keys, w, dim=-1).values
            ids = (MAXJ - (top & 0xFFFFFFFF)).int()
            take = torch.arange(w, device=dev)[None, :] < torch.clamp(c, max=kk)[:, None]
            ids = torch.where(take[:, None, :], ids, PAD).sort(dim=-1).values
            sel[r0:r1, :, :w] = torch.where(ids < PAD, ids, -1)
            sel[r0:r1, :, w:] = -1


def run_gate(plan: MobaPlan, q: torch.Tensor, k: torch.Tensor, *, write_sel: bool = False):
    """Launch the gate for ``plan``: (sel or None, keys, codes, bits or None)."""
    if not plan.gated and not write_sel:
        return (None, *plan.dev["no_entries"], None)
    T, H, D = q.shape
    HKV = k.shape[1]
    dev = q.device
    E = plan.entries
    means = torch.empty((plan.n_blocks, HKV, D), dtype=torch.float32, device=dev)
    blocks_tab, tiles = plan.dev["means_blocks"], plan.dev["gate_tiles"]
    nm, n_t = blocks_tab.shape[1], tiles.shape[1]
    if nm:
        _block_means_kernel[(nm, HKV)](k, means, blocks_tab, nm, HKV, D=D, BLOCK=plan.block, BR=min(64, plan.block),
                                       num_warps=4)
    need_sel = write_sel or plan.from_sel
    sel = torch.full((T, H, plan.k1p), -1, dtype=torch.int32, device=dev) if need_sel else None
    keys, codes = (torch.empty(E, dtype=plan.key_dtype, device=dev), torch.empty(E, dtype=plan.code_dtype, device=dev)) \
        if E else plan.dev["no_entries"]
    bits = torch.empty((T, H, plan.words), dtype=torch.int32, device=dev) if plan.has_masked else None
    if plan.from_sel:
        select_torch(plan, q, means, sel)
    if n_t:
        dummy = means  # the pointer of an output the launch does not write
        _gate_kernel[(n_t, HKV)](q, means, sel if need_sel else dummy, keys if E else dummy, codes if E else dummy,
                                 dummy if bits is None else bits, tiles, n_t, H, HKV, plan.nc, plan.shift, plan.words,
                                 int(write_sel), **plan.gate_launch)
    return sel, keys, codes, bits
