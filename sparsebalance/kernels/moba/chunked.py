"""Fast PyTorch MoBA (the CPU path): queries grouped by key block, fused attention tiles, LSE merge.

MoBA's gate is per query token, so two queries of one block may attend different past blocks. Rather
than gathering each query's selected key blocks (``n`` copies of ``B`` keys per query row, the
memory traffic that made the first version 2-10x slower than dense SDPA), this module groups the
(query row, head) pairs by the key block they selected, as the original MoBA does, and cuts each
group into **tiles** of ``TILE`` query rows sharing one key block. Every attention then runs in
PyTorch's fused CPU flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``,
which returns the log-sum-exp), batched over all tiles of all packed sequences in one call:

* **causal prefix** (``tiles.layout``): rows of a sequence's first ``topk`` blocks select every past
  block, so they are plain causal attention, one fused call per sequence (the whole sequence when
  ``topk >= n_blocks``); no gate, no merge;
* **own blocks** of the other (sparse) rows: one causal call over all of them (kv heads repeated
  for grouped-query attention, gradients summed back);
* **past blocks**: the gate picks each sparse row's ``n = topk - 1`` blocks (``tiles.choose``); the
  entries, sorted by (kv head, block), are padded to whole tiles (``tiles.group``). One non-causal
  call over all tiles gives ``(o_e, lse_e)`` per entry;
* **merge**: a sparse row has exactly ``n`` entries, so they are *gathered* back as ``[H, R, n]``
  (``pos``, no scatter): ``lse = logsumexp(lse_own, lse_e...)``,
  ``o = e^(lse_own - lse) o_own + sum_e e^(lse_e - lse) o_e``.

**Backward** (custom ``autograd.Function``) calls the fused backward of each part with the *merged*
output and LSE (the ring-attention identity: ``P = exp(S - lse)`` and ``delta = rowsum(dO * O)`` are
then the full softmax's), so each part's ``dq, dk, dv`` is its exact share; a row's ``dq`` is the sum
of its ``n`` tile lanes (gathered by ``pos``), key-block gradients are added per tile. Saved: q, k,
v, out, lse, the tile tables (ints) and, when small, the gathered tile inputs. Layouts (and their
index tensors) are cached: every layer of a step packs the same sequences.

**Memory**: query blocks are processed in chunks whose gate scores and gathered tile rows stay under
``CHUNK_ELEMENTS`` elements; a chunk holds whole query blocks, so every entry of a row is in the
chunk that merges it. Compute is float32 for half-precision inputs (float64 for float64); outputs
keep q's dtype.
"""

from __future__ import annotations

import math
from typing import Any

from sparsebalance.kernels.cpuclock import keep_freed_memory
from sparsebalance.kernels.moba.gate import gate_dtype
from sparsebalance.kernels.moba.tiles import Layout, Tiles, chunk_tiles, layout

#: Elements (gate scores, gathered tile rows) per chunk of query blocks: bounds the working set.
CHUNK_ELEMENTS = 1 << 23
#: Gathered tile queries up to this many elements are kept from forward to backward.
KEEP_ELEMENTS = 1 << 24


def _flash(q: Any, k: Any, v: Any, causal: bool, scale: float) -> tuple[Any, Any]:
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)


def _flash_bwd(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: bool, scale: float):
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, causal, scale=scale)


def _expand(x: Any, g: int) -> Any:
    """kv heads -> query heads (dim 1) for the fused kernel, which has no grouped-query mode."""
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _fold(x: Any, g: int) -> Any:
    """Gradient of :func:`_expand`: sum each group of ``g`` heads (dim 1)."""
    return x if g == 1 else x.unflatten(1, (-1, g)).sum(2)


class _Ctx:
    """Tensors shared by forward and backward, in compute dtype and fused-kernel layouts."""

    def __init__(self, q: Any, k: Any, v: Any, lay: Layout, block_size: int) -> None:
        cdt = gate_dtype(q.dtype)
        self.q, self.k, self.v = (x.detach().to(cdt).contiguous() for x in (q, k, v))
        self.T, self.H, self.D = q.shape
        self.hk = k.shape[1]
        self.g = self.H // self.hk
        self.B = block_size
        self.scale = 1.0 / math.sqrt(self.D)
        self.lay = lay
        if lay.n_own:
            self.qo = self.blocks(self.q)                                    # [NO, H, B, D]
            self.ko = _expand(self.blocks(self.k), self.g).contiguous()      # [NO, H, B, D]
            self.vo = _expand(self.blocks(self.v), self.g).contiguous()
        if lay.n_keys:  # block-major K/V of the past blocks: row = kv head * NK + key block
            shape = (self.hk * lay.n_keys, 1, self.B, self.D)
            self.kb, self.vb = (x.index_select(0, lay.key_idx).view(lay.n_keys, self.B, self.hk, self.D)
                                .permute(2, 0, 1, 3).reshape(shape) for x in (self.k, self.v))

    def blocks(self, x: Any) -> Any:
        """[T, heads, E] -> [NO, heads, B, E] (rows of every own block)."""
        y = x.index_select(0, self.lay.own_idx)
        return y.view(self.lay.n_own, self.B, x.shape[1], x.shape[2]).transpose(1, 2).contiguous()

    def unblocks(self, y: Any) -> Any:
        """Real tokens of [NO, heads, B, E] as [m, heads, E] (rows ``lay.own_rows``)."""
        flat = y.transpose(1, 2).reshape(self.lay.n_own * self.B, y.shape[1], y.shape[3])
        return flat.index_select(0, self.lay.own_src)

    def seq(self, x: Any, a: int, b: int, expand: bool) -> Any:
        """Rows [a, b) of [T, heads, D] as [1, heads', L, D] (kv heads expanded when asked)."""
        y = x[a:b].transpose(0, 1).unsqueeze(0)
        return (_expand(y, self.g) if expand else y).contiguous()

    def tile_kv(self, t: Tiles) -> tuple[Any, Any, Any]:
        """(q, k, v) of the tiles: gathered query rows [nt, 1, TILE, D] and their key block (kept
        from the forward when small; the keys only gathered again after :func:`forward_parts`)."""
        if t.kept is not None and t.kept[1] is not None:
            return t.kept
        nt = t.kv.shape[0]
        qt = (t.kept[0] if t.kept is not None
              else self.q.view(-1, self.D).index_select(0, t.tab).view(nt, 1, -1, self.D))
        return qt, self.kb.index_select(0, t.kv), self.vb.index_select(0, t.kv)


def _forward(c: _Ctx) -> tuple[Any, Any, list[Tiles]]:
    import torch

    # with some query blocks only, a partial block's padding rows (clamped to the batch's last token)
    # may point at rows never computed here: zeros keep the backward's rowsum(dO * O) finite there
    alloc = c.q.new_zeros if c.lay.partial else c.q.new_empty
    out = alloc(c.T, c.H, c.D)
    lse = alloc(c.T, c.H)
    for (a, b), rows in zip(c.lay.dense, c.lay.dense_rows):  # dense sequences and the prefixes: causal
        if rows is not None:  # rows [r0, b) only (a CP rank's): causal on [r0, b), merged with keys [a, r0)
            r0 = rows[0]
            qr = c.seq(c.q, r0, b, False)
            o, l = _flash(qr, c.seq(c.k, r0, b, True), c.seq(c.v, r0, b, True), True, c.scale)
            if r0 > a:
                o2, l2 = _flash(qr, c.seq(c.k, a, r0, True), c.seq(c.v, a, r0, True), False, c.scale)
                m = torch.logaddexp(l, l2)
                o = o * torch.exp(l - m).unsqueeze(-1) + o2 * torch.exp(l2 - m).unsqueeze(-1)
                l = m
            out[r0:b], lse[r0:b] = o[0].transpose(0, 1), l[0].transpose(0, 1)
            continue
        o, l = _flash(c.seq(c.q, a, b, False), c.seq(c.k, a, b, True), c.seq(c.v, a, b, True),
                      True, c.scale)
        out[a:b], lse[a:b] = o[0].transpose(0, 1), l[0].transpose(0, 1)
    tiles: list[Tiles] = []
    if not c.lay.n_own:
        return out, lse, tiles
    oo, lo = _flash(c.qo, c.ko, c.vo, True, c.scale)                       # own blocks
    out.index_copy_(0, c.lay.own_rows, c.unblocks(oo))
    lse.index_copy_(0, c.lay.own_rows, c.unblocks(lo.unsqueeze(-1)).squeeze(-1))
    for pieces in c.lay.chunks:
        t = chunk_tiles(c.q, c.k, pieces, c.B, c.lay.n_keys, c.lay.memo)
        tiles.append(t)
        qt, kt, vt = c.tile_kv(t)
        if qt.numel() <= KEEP_ELEMENTS:  # keep for the backward rather than gather again
            t.kept = (qt, kt, vt)
        ot, lt = _flash(qt, kt, vt, False, c.scale)
        o_f, l_f = ot.view(-1, c.D), lt.view(-1)
        for a, t0, t1, n, e0 in t.pieces:  # merge: each sparse row has exactly n tile entries
            R = t1 - t0
            pp = t.pos[e0:e0 + c.H * R * n]
            le = l_f.index_select(0, pp).view(c.H, R, n)
            lo_ = lse[a + t0:a + t1].t()                                   # [H, R] own block
            m = torch.maximum(le.amax(-1), lo_)
            w_own = torch.exp(lo_ - m)
            w = torch.exp(le - m.unsqueeze(-1))
            total = w_own + w.sum(-1)
            inv = total.reciprocal()
            og = o_f.index_select(0, pp).view(c.H, R, n, c.D)
            w = w * inv.unsqueeze(-1)
            # few entries: one fused multiply-sum; many: bmm, without the [H, R, n, D] product
            o = (w.unsqueeze(-1) * og).sum(2) if n <= 8 else torch.einsum("hrn,hrnd->hrd", w, og)
            o += out[a + t0:a + t1].transpose(0, 1) * (w_own * inv).unsqueeze(-1)
            out[a + t0:a + t1] = o.transpose(0, 1)
            lse[a + t0:a + t1] = (m + torch.log(total)).t()
    return out, lse, tiles


def _backward(c: _Ctx, out: Any, lse: Any, do: Any, tiles: list[Tiles]) -> tuple[Any, Any, Any]:
    import torch

    dq, dk, dv = torch.zeros_like(c.q), torch.zeros_like(c.k), torch.zeros_like(c.v)
    for (a, b), rows in zip(c.lay.dense, c.lay.dense_rows):
        if rows is not None:  # each part with the merged output and LSE: its exact share
            r0 = rows[0]
            parts = [(r0, b, True)] + ([(a, r0, False)] if r0 > a else [])
            dor, qr, outr = c.seq(do, r0, b, False), c.seq(c.q, r0, b, False), c.seq(out, r0, b, False)
            lr = lse[r0:b].t().unsqueeze(0)
            for k0, k1, causal in parts:  # runs of one sequence share keys: gradients add
                gq, gk, gv = _flash_bwd(dor, qr, c.seq(c.k, k0, k1, True), c.seq(c.v, k0, k1, True), outr, lr,
                                        causal, c.scale)
                dq[r0:b] += gq[0].transpose(0, 1)
                dk[k0:k1] += _fold(gk, c.g)[0].transpose(0, 1)
                dv[k0:k1] += _fold(gv, c.g)[0].transpose(0, 1)
            continue
        gq, gk, gv = _flash_bwd(c.seq(do, a, b, False), c.seq(c.q, a, b, False),
                                c.seq(c.k, a, b, True), c.seq(c.v, a, b, True),
                                c.seq(out, a, b, False), lse[a:b].t().unsqueeze(0), True, c.scale)
        dq[a:b] = gq[0].transpose(0, 1)
        dk[a:b], dv[a:b] = _fold(gk, c.g)[0].transpose(0, 1), _fold(gv, c.g)[0].transpose(0, 1)
    lay = c.lay
    if not lay.n_own:
        return dq, dk, dv
    # padded rows of a partial block: lse = +inf gives P = exp(S - lse) = 0 there, hence dS = 0
    # and P^T dO = 0 whatever their (finite, borrowed) dO: they add no gradient anywhere
    if "pad" not in lay.memo:
        real = torch.zeros(lay.n_own * c.B, dtype=torch.bool, device=c.q.device)
        real[lay.own_src] = True
        lay.memo["pad"] = ~real.view(-1, 1, c.B)
    lo = c.blocks(lse.unsqueeze(-1)).squeeze(-1).masked_fill(lay.memo["pad"], float("inf"))
    gq, gk, gv = _flash_bwd(c.blocks(do), c.qo, c.ko, c.vo, c.blocks(out), lo, True, c.scale)
    dq.index_add_(0, lay.own_rows, c.unblocks(gq))
    dk.index_add_(0, lay.own_rows, c.unblocks(_fold(gk, c.g)))
    dv.index_add_(0, lay.own_rows, c.unblocks(_fold(gv, c.g)))
    if not tiles:
        return dq, dk, dv
    dkb, dvb = torch.zeros_like(c.kb), torch.zeros_like(c.vb)
    out_f, lse_f, do_f = out.view(-1, c.D), lse.view(-1), do.view(-1, c.D)
    for t in tiles:
        qt, kt, vt = c.tile_kv(t)
        lt = lse_f.index_select(0, t.tab).view(t.lane.shape).masked_fill(~t.lane, float("inf"))
        gq, gk, gv = _flash_bwd(do_f.index_select(0, t.tab).view(qt.shape), qt, kt, vt,
                                out_f.index_select(0, t.tab).view(qt.shape), lt, False, c.scale)
        dkb.index_add_(0, t.kv, gk)
        dvb.index_add_(0, t.kv, gv)
        g_f = gq.view(-1, c.D)
        for a, t0, t1, n, e0 in t.pieces:  # dq of a sparse row: sum of its n tile lanes
            pp = t.pos[e0:e0 + c.H * (t1 - t0) * n]
            dq[a + t0:a + t1] += g_f.index_select(0, pp).view(c.H, t1 - t0, n, c.D).sum(2).transpose(0, 1)
    nk = lay.n_keys
    dk.index_add_(0, lay.key_idx, dkb.view(c.hk, nk * c.B, c.D).transpose(0, 1))
    dv.index_add_(0, lay.key_idx, dvb.view(c.hk, nk * c.B, c.D).transpose(0, 1))
    return dq, dk, dv


#: Recent layouts: every layer of a training step (and a repeated batch) packs the same sequences.
_LAYOUTS: dict = {}


def _layout(cu: list[int], B: int, topks: list[int], heads: int, kv_heads: int, dim: int,
            device: Any, query_blocks: tuple | None = None) -> Layout:
    # the memo's index tensors depend on the kv heads too (key offsets)
    key = (tuple(cu), B, tuple(topks), heads, kv_heads, dim, str(device), CHUNK_ELEMENTS, query_blocks)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 4:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = layout(cu, B, topks, heads, dim, device, CHUNK_ELEMENTS,
                               None if query_blocks is None else list(query_blocks))
    return _LAYOUTS[key]


def forward_parts(q: Any, k: Any, v: Any, cu: list[int], block_size: int, topks: list[int],
                  query_blocks: tuple | None = None) -> tuple[Any, Any, Any]:
    """The forward outside autograd, for a caller that holds no K/V until the backward (the
    context-parallel all-gather, ``cp.py``: it gathers K/V again there): ``(out, lse, saved)``,
    ``out`` ``[T, H, D]`` and ``lse`` ``[T, H]`` in the compute dtype; ``saved`` the layout and the
    tile tables (ints, and the tiles' query rows when kept; no keys or values). Pass them to
    :func:`backward_parts`."""
    lay = _layout(cu, block_size, topks, q.shape[1], k.shape[1], q.shape[2], q.device, query_blocks)
    out, lse, tiles = _forward(_Ctx(q, k, v, lay, block_size))
    for t in tiles:  # the tiles' keys and values: gathered again in the backward (their queries kept)
        t.kept = None if t.kept is None else (t.kept[0], None, None)
    return out, lse, (lay, tiles)


def backward_parts(saved: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any,
                   block_size: int) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` in the compute dtype, packed order, of :func:`forward_parts`' call with the
    same ``q``, ``k``, ``v``; ``dout`` ``[T, H, D]``."""
    lay, tiles = saved
    c = _Ctx(q, k, v, lay, block_size)
    return _backward(c, out, lse, dout.to(out.dtype).contiguous(), tiles)


def _function() -> Any:
    import torch

    class MobaChunked(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, cu: list[int], block_size: int, topks: list[int],
                    query_blocks: tuple | None = None):
            lay = _layout(cu, block_size, topks, q.shape[1], k.shape[1], q.shape[2], q.device, query_blocks)
            c = _Ctx(q, k, v, lay, block_size)
            out, lse, tiles = _forward(c)
            ctx.c, ctx.tiles, ctx.dtypes = c, tiles, (q.dtype, k.dtype, v.dtype)
            ctx.save_for_backward(out, lse)
            return out.to(q.dtype)

        @staticmethod
        def backward(ctx: Any, dout: Any):
            out, lse = ctx.saved_tensors
            dq, dk, dv = _backward(ctx.c, out, lse, dout.to(out.dtype).contiguous(), ctx.tiles)
            ctx.c = ctx.tiles = None
            qd, kd, vd = ctx.dtypes
            return dq.to(qd), dk.to(kd), dv.to(vd), None, None, None, None

    return MobaChunked


_FN: Any = None


def moba_attention_chunked(q: Any, k: Any, v: Any, cu_seqlens: Any, block_size: int, topk: Any,
                           query_blocks: tuple | None = None) -> Any:
    """MoBA attention, fast PyTorch implementation; ``[T, H, D]`` like ``q``, differentiable.

    Arguments as :func:`sparsebalance.kernels.moba.api.moba_attention` (``topk`` int or integer tensor
    ``[N]``); inputs are assumed valid (the API validates). ``query_blocks``: per sequence a tuple of
    the query blocks whose rows the caller reads (a context-parallel rank's share); the other rows
    of the output are left unset (and get no gradient).
    """
    import torch

    global _FN
    if _FN is None:
        _FN = _function()
    if q.device.type == "cpu":
        keep_freed_memory()
    cu = [int(x) for x in cu_seqlens.tolist()]
    n = len(cu) - 1
    topks = ([int(x) for x in topk.reshape(-1).tolist()] if isinstance(topk, torch.Tensor)
             else [int(topk)] * n)
    return _FN.apply(q, k, v, cu, block_size, topks, query_blocks)
