"""Efficient PyTorch MoBA (the CPU path realrun uses): gather selected key blocks per query, merge by LSE.

Per sequence the gate (``gate.py``) picks, for every query row and head, ``n = topk - 1`` past key
blocks. Query blocks are processed in chunks so memory stays bounded (no ``[L, L]`` tensor):

* own block: a batched ``[G*B, D] x [D, B]`` matmul per (block, kv head) with a causal mask, giving
  ``o_own`` and ``lse_own`` per row;
* past blocks: the ``n`` selected blocks of each row are gathered from a block-major copy of K and V
  (``[H_kv * n_blocks, B * D]``), scored by a batched ``[1, D] x [D, n*B]`` product, giving ``o_past`` and
  ``lse_past``;
* merge: ``lse = logaddexp(lse_own, lse_past)``, ``o = e^(lse_own - lse) o_own + e^(lse_past - lse) o_past``.

Backward is a custom ``autograd.Function`` that recomputes the probabilities from the saved ``lse``
(flash-attention style): ``P = exp(S - lse)``, ``dS = P (dP - rowsum(dO * O))``; gradients of gathered
blocks are scattered back with ``index_add_``. Only q, k, v, out, lse and the selection are saved.
Compute is float32 for half-precision inputs (float64 for float64 inputs); outputs keep q's dtype.
"""

from __future__ import annotations

import math
from typing import Any

from sparsebalance.kernels.moba.gate import gate_dtype, select_blocks

#: Elements of gathered K (and of V) per chunk; bounds the working set (~32 MiB each in float32).
CHUNK_ELEMENTS = 1 << 23


class _Seq:
    """Per-sequence tensors in compute dtype, padded to whole blocks, in the layouts the kernels use."""

    def __init__(self, q: Any, k: Any, v: Any, block_size: int, n_sel: int, sel: tuple[Any, Any]):
        import torch.nn.functional as F

        self.L, self.H, self.D = q.shape
        self.hk = k.shape[1]
        self.g = self.H // self.hk
        self.B = block_size
        self.nb = -(-self.L // block_size)
        pad = self.nb * block_size - self.L
        self.qp = F.pad(q, (0, 0, 0, 0, 0, pad))                          # [nb*B, H, D]
        self.kp = F.pad(k, (0, 0, 0, 0, 0, pad))                          # [nb*B, H_kv, D]
        self.vp = F.pad(v, (0, 0, 0, 0, 0, pad))
        self.n = n_sel
        self.idx, self.valid = sel                                        # [L, H, n]
        self.scale = 1.0 / math.sqrt(self.D)

    def blocks_major(self, x: Any) -> Any:
        """``[nb*B, H_kv, D]`` -> ``[H_kv * nb, B * D]`` (row = kv head * nb + block)."""
        return x.view(self.nb, self.B, self.hk, self.D).permute(2, 0, 1, 3).reshape(
            self.hk * self.nb, self.B * self.D)

    def own_q(self, c0: int, c1: int, x: Any) -> Any:
        """Rows of query blocks ``[c0, c1)`` of ``x`` ``[nb*B, H, E]`` -> ``[nc, H_kv, G*B, E]``."""
        e = x.shape[-1]
        return x[c0 * self.B:c1 * self.B].view(c1 - c0, self.B, self.hk, self.g, e).permute(
            0, 2, 3, 1, 4).reshape(c1 - c0, self.hk, self.g * self.B, e)

    def own_kv(self, c0: int, c1: int, x: Any) -> Any:
        return x[c0 * self.B:c1 * self.B].view(c1 - c0, self.B, self.hk, self.D).permute(0, 2, 1, 3)

    def unown(self, x: Any) -> Any:
        """Inverse of :meth:`own_q`: ``[nc, H_kv, G*B, E]`` -> ``[nc*B, H, E]``."""
        nc, e = x.shape[0], x.shape[-1]
        return x.view(nc, self.hk, self.g, self.B, e).permute(0, 3, 1, 2, 4).reshape(
            nc * self.B, self.H, e)

    def causal(self, device: Any) -> Any:
        import torch

        r = torch.arange(self.g * self.B, device=device) % self.B
        return r[:, None] >= torch.arange(self.B, device=device)[None, :]   # [G*B, B]

    def rows_index(self, t0: int, t1: int) -> tuple[Any, Any]:
        """Gather rows into the block-major K/V and the slot-validity mask for rows ``[t0, t1)``."""
        import torch

        kvh = torch.arange(self.H, device=self.idx.device) // self.g
        ridx = kvh[None, :, None] * self.nb + self.idx[t0:t1]             # [R, H, n]
        return ridx, self.valid[t0:t1]

    def chunks(self) -> list[tuple[int, int]]:
        per_row = self.H * max(self.n, 1) * self.B * self.D
        nblk = max(1, CHUNK_ELEMENTS // (per_row * self.B))
        return [(c, min(c + nblk, self.nb)) for c in range(0, self.nb, nblk)]


def _past_scores(s: _Seq, qr: Any, kb: Any, ridx: Any, valid: Any) -> Any:
    """Scores ``[R, H, n*B]`` of rows ``qr`` ``[R, H, D]`` against their gathered blocks (invalid = -inf)."""
    R = qr.shape[0]
    ksel = kb[ridx].view(R, s.H, s.n * s.B, s.D)
    sc = (qr.unsqueeze(2) @ ksel.transpose(-1, -2)).squeeze(2) * s.scale
    mask = valid.repeat_interleave(s.B, dim=-1)
    return sc.masked_fill(~mask, float("-inf")), ksel


def _forward_seq(s: _Seq) -> tuple[Any, Any]:
    import torch

    out = s.qp.new_empty(s.L, s.H, s.D)
    lse = s.qp.new_empty(s.L, s.H)
    causal = s.causal(s.qp.device)
    kb, vb = (s.blocks_major(s.kp), s.blocks_major(s.vp)) if s.n else (None, None)
    for c0, c1 in s.chunks():
        t0, t1 = c0 * s.B, min(c1 * s.B, s.L)
        sc = (s.own_q(c0, c1, s.qp) @ s.own_kv(c0, c1, s.kp).transpose(-1, -2)) * s.scale
        sc = sc.masked_fill(~causal, float("-inf"))
        lse_o = torch.logsumexp(sc, dim=-1, keepdim=True)
        o_own = s.unown(torch.exp(sc - lse_o) @ s.own_kv(c0, c1, s.vp))[:t1 - t0]
        lse_own = s.unown(lse_o)[:t1 - t0, :, 0]
        if not s.n:
            out[t0:t1], lse[t0:t1] = o_own, lse_own
            continue
        ridx, valid = s.rows_index(t0, t1)
        sp, _ = _past_scores(s, s.qp[t0:t1], kb, ridx, valid)
        lse_p = torch.logsumexp(sp, dim=-1)                               # -inf where no past block
        vsel = vb[ridx].view(t1 - t0, s.H, s.n * s.B, s.D)
        tot = torch.logaddexp(lse_own, lse_p)
        p = torch.exp(sp - tot.unsqueeze(-1))
        o_past = (p.unsqueeze(2) @ vsel).squeeze(2)
        out[t0:t1] = torch.exp(lse_own - tot).unsqueeze(-1) * o_own + o_past
        lse[t0:t1] = tot
    return out, lse


def _backward_seq(s: _Seq, out: Any, lse: Any, do: Any) -> tuple[Any, Any, Any]:
    import torch
    import torch.nn.functional as F

    pad = s.nb * s.B - s.L
    dq = torch.zeros_like(s.qp)
    dkp, dvp = torch.zeros_like(s.kp), torch.zeros_like(s.vp)
    delta = (do * out).sum(-1)                                            # [L, H]
    # Padded rows get lse = +inf so their probabilities are exactly 0 (no gradient from padding).
    lse_p = F.pad(lse, (0, 0, 0, pad), value=float("inf"))
    do_p, delta_p = F.pad(do, (0, 0, 0, 0, 0, pad)), F.pad(delta, (0, 0, 0, pad))
    causal = s.causal(s.qp.device)
    if s.n:
        kb, vb = s.blocks_major(s.kp), s.blocks_major(s.vp)
        dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
    for c0, c1 in s.chunks():
        t0, t1 = c0 * s.B, min(c1 * s.B, s.L)
        qo, ko, vo = s.own_q(c0, c1, s.qp), s.own_kv(c0, c1, s.kp), s.own_kv(c0, c1, s.vp)
        sc = (qo @ ko.transpose(-1, -2)) * s.scale
        sc = sc.masked_fill(~causal, float("-inf"))
        p = torch.exp(sc - s.own_q(c0, c1, lse_p[:, :, None]))
        dob = s.own_q(c0, c1, do_p)
        dvp[c0 * s.B:c1 * s.B] = (p.transpose(-1, -2) @ dob).permute(0, 2, 1, 3).reshape(-1, s.hk, s.D)
        ds = p * (dob @ vo.transpose(-1, -2) - s.own_q(c0, c1, delta_p[:, :, None])) * s.scale
        dq[c0 * s.B:c1 * s.B] = s.unown(ds @ ko)
        dkp[c0 * s.B:c1 * s.B] = (ds.transpose(-1, -2) @ qo).permute(0, 2, 1, 3).reshape(-1, s.hk, s.D)
        if not s.n:
            continue
        R = t1 - t0
        ridx, valid = s.rows_index(t0, t1)
        qr, dor = s.qp[t0:t1], do[t0:t1]
        sp, ksel = _past_scores(s, qr, kb, ridx, valid)
        pp = torch.exp(sp - lse[t0:t1].unsqueeze(-1))                     # [R, H, n*B]
        vsel = vb[ridx].view(R, s.H, s.n * s.B, s.D)
        dpp = (dor.unsqueeze(2) @ vsel.transpose(-1, -2)).squeeze(2)
        dsp = pp * (dpp - delta[t0:t1].unsqueeze(-1)) * s.scale
        dq[t0:t1] += (dsp.unsqueeze(2) @ ksel).squeeze(2)
        flat = ridx.reshape(-1)
        dkb.index_add_(0, flat, (dsp.unsqueeze(-1) * qr.unsqueeze(2)).reshape(-1, s.B * s.D))
        dvb.index_add_(0, flat, (pp.unsqueeze(-1) * dor.unsqueeze(2)).reshape(-1, s.B * s.D))
    if s.n:
        def unblock(x: Any) -> Any:
            return x.view(s.hk, s.nb, s.B, s.D).permute(1, 2, 0, 3).reshape(s.nb * s.B, s.hk, s.D)
        dkp += unblock(dkb)
        dvp += unblock(dvb)
    return dq[:s.L], dkp[:s.L], dvp[:s.L]


def _sequences(q: Any, k: Any, v: Any, cu: list[int], block_size: int, topks: list[int], sels: list):
    cdt = gate_dtype(q.dtype)
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        nb = -(-(b - a) // block_size)
        n = max(0, min(topks[i], nb) - 1)
        yield a, b, _Seq(q[a:b].to(cdt), k[a:b].to(cdt), v[a:b].to(cdt), block_size, n, sels[i])


def _function() -> Any:
    import torch

    class MobaChunked(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, cu: list[int], block_size: int, topks: list[int]):
            sels = []
            for i in range(len(cu) - 1):
                a, b = cu[i], cu[i + 1]
                nb = -(-(b - a) // block_size)
                sels.append(select_blocks(q[a:b], k[a:b], block_size, max(1, min(topks[i], nb))))
            out = torch.empty(q.shape, dtype=gate_dtype(q.dtype), device=q.device)
            lse = torch.empty(q.shape[:2], dtype=out.dtype, device=q.device)
            for a, b, s in _sequences(q, k, v, cu, block_size, topks, sels):
                out[a:b], lse[a:b] = _forward_seq(s)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.sels, ctx.cu, ctx.block_size, ctx.topks = sels, cu, block_size, topks
            return out.to(q.dtype)

        @staticmethod
        def backward(ctx: Any, dout: Any):
            q, k, v, out, lse = ctx.saved_tensors
            dq = torch.empty(q.shape, dtype=out.dtype, device=q.device)
            dk = torch.empty(k.shape, dtype=out.dtype, device=q.device)
            dv = torch.empty_like(dk)
            do = dout.to(out.dtype)
            for a, b, s in _sequences(q, k, v, ctx.cu, ctx.block_size, ctx.topks, ctx.sels):
                dq[a:b], dk[a:b], dv[a:b] = _backward_seq(s, out[a:b], lse[a:b], do[a:b])
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None

    return MobaChunked


_FN: Any = None


def moba_attention_chunked(q: Any, k: Any, v: Any, cu_seqlens: Any, block_size: int, topk: Any) -> Any:
    """MoBA attention, chunked PyTorch implementation; ``[T, H, D]`` like ``q``, differentiable.

    Arguments as :func:`sparsebalance.kernels.moba.api.moba_attention` (``topk`` int or integer tensor
    ``[N]``); inputs are assumed valid (the API validates).
    """
    import torch

    global _FN
    if _FN is None:
        _FN = _function()
    cu = [int(x) for x in cu_seqlens.tolist()]
    n = len(cu) - 1
    topks = ([int(x) for x in topk.reshape(-1).tolist()] if isinstance(topk, torch.Tensor)
             else [int(topk)] * n)
    return _FN.apply(q, k, v, cu, block_size, topks)
