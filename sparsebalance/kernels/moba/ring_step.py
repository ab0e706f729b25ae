"""One rank's ring step of MoBA context parallelism on the CPU path: the call a P2P ring runs.

A rank of a CP ring holds its query blocks for the whole layer and, at step ``s``, the key blocks of
rank ``src = (rank - s) mod W`` (layouts deal whole blocks: ``cp.cp_token_index``). Its step is one
attention call of its queries against those keys under MoBA's mask, built from ``chunked.py``'s
parts:

* **gate, once before the ring** (:func:`plan`): every sparse query row's ``topk - 1`` past blocks,
  chosen from the mean key of every block of the sequence (in a ring, the all-reduced pooled means;
  here computed from the packed K, the same numbers), with ``tiles.choose``'s rule;
* **dense parts** (whole dense sequences and the causal prefix of sparse ones, ``tiles.layout``):
  a run of the rank's query rows against each held run of keys before it (a full call) or against
  itself (a causal call, only at the step that holds it);
* **own blocks**: the causal call of every sparse row's own block, at the step that holds them;
* **past blocks**: the gate's entries whose block is held at this step, grouped into tiles of
  (row, head) pairs sharing one key block (``tiles.group``), one non-causal call over all tiles.

:func:`step_forward` returns the step's partial output and log-sum-exp (``-inf`` where a row attends
nothing at this step), merged across steps by :func:`merge` (what a ring's forward does after every
step). :func:`step_backward` runs the step's part of the backward with the layer's merged output and
LSE (the ring-attention identity, as ``chunked.py``'s backward): its ``dq`` adds to the rank's, its
``dk``/``dv`` are the held keys' share, which travel back to their rank.

Checked against the single-process float64 reference (tests/kernels/test_moba_ring_step.py): every
rank's merged steps give the reference output of its rows, and the steps' gradients summed over
ranks give every reference gradient. What ``profile --cp`` times for the ``attn_*_cp_step`` rows
(``kernels/profiler.py``). Shapes: packed ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, H_kv, D]`` (rows of
blocks neither wanted nor held are never read), ``cu`` the packed bounds (ints).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from sparsebalance.data.sequence import blocks
from sparsebalance.kernels.moba.chunked import CHUNK_ELEMENTS, _expand, _flash, _flash_bwd, _fold
from sparsebalance.kernels.moba.gate import block_means, gate_dtype
from sparsebalance.kernels.moba.tiles import Layout, _piece_consts, _runs, choose, group, layout

__all__ = ["RankPlan", "StepSaved", "merge", "plan", "step_backward", "step_forward"]


@dataclass(slots=True)
class RankPlan:
    """A rank's queries for the whole ring: the layout of its query blocks and the gate's choice."""

    cu: list[int]
    """Packed sequence bounds."""
    block_size: int
    lay: Layout
    """``tiles.layout`` of the rank's query blocks."""
    chosen: list[list[tuple[int, int, int, Any, Any]]]
    """Per chunk of ``lay``, per piece: (sequence index, rows start, rows end, selected blocks
    ``[H, R, n]`` (block index within the sequence), packed row-heads ``[H * R * n]``)."""
    heads: int
    kv_heads: int
    dim: int


@dataclass(slots=True)
class StepSaved:
    """What a step's forward leaves for its backward."""

    dense: list[tuple[int, int, int, int, bool]]
    """(q0, q1, k0, k1, causal) of every dense call."""
    own: bool
    """Whether the own blocks' causal call ran (the step holds them)."""
    tiles: list[tuple[Any, Any, Any]] = field(default_factory=list)
    """Per chunk with held entries: (tab, lane, kv) of its tiles (``tiles.Tiles``' meaning)."""
    key_idx: Any = None
    """int64 [NKh * B]: packed rows of the held past blocks, block-major (the tiles' K/V rows)."""
    pairs: float = 0.0
    """(query, key) pairs the call attends, per head."""


def _seq_of(cu: list[int], a: int) -> int:
    """The sequence of packed row ``a`` (empty sequences skipped)."""
    return bisect.bisect_right(cu, a) - 1


def plan(q: Any, k: Any | None, cu: list[int], block_size: int, topks: list[int], query_blocks: list[tuple[int, ...]],
         means: list[Any] | None = None) -> RankPlan:
    """Gate a rank's query rows once for the whole ring (module docstring); ``q`` packed, any float
    dtype (the gate runs in ``gate_dtype``). The block means come from ``means`` (per sequence
    ``[n_blocks, H_kv, D]``, the ring's all-reduced pooled means) or else from the packed ``k``."""
    import torch

    if means is None and k is None:
        raise ValueError("plan: pass the packed k or the block means")
    H, D = q.shape[1], q.shape[2]
    hk = k.shape[1] if k is not None else means[0].shape[1] if means else q.shape[1]  # no means: no gate
    g = H // hk
    lay = layout(cu, block_size, topks, H, D, q.device, CHUNK_ELEMENTS, list(query_blocks))
    qg = q.detach().to(gate_dtype(q.dtype))
    kg = None if k is None else k.detach().to(gate_dtype(k.dtype))
    chosen = []
    for pieces in lay.chunks:
        out = []
        for a, k0, n, t0, t1 in pieces:
            R, nbp = t1 - t0, (t1 - 1) // block_size
            future, _, rowheads = _piece_consts(lay.memo, a, k0, n, t0, t1, block_size, H, g, lay.n_keys, q.device)
            i = _seq_of(cu, a)
            mu = (block_means(kg[a:a + nbp * block_size], block_size) if means is None
                  else means[i][:nbp].to(qg.dtype))
            qh = qg[a + t0:a + t1].view(R, hk, g, D).permute(1, 2, 0, 3).reshape(hk, g * R, D)
            s = torch.bmm(qh, mu.permute(1, 2, 0)).view(H, R, nbp).masked_fill_(future, float("-inf"))
            sel = choose(s.view(H * R, nbp), n).view(-1, nbp).nonzero()[:, 1].view(H, R, n)
            out.append((i, t0, t1, sel, rowheads))
        chosen.append(out)
    return RankPlan(cu=list(cu), block_size=block_size, lay=lay, chosen=chosen, heads=H, kv_heads=hk, dim=D)


def merge(out: Any, lse: Any, o: Any, lo: Any) -> tuple[Any, Any]:
    """Fold a partial ``(o [T, H, D], lo [T, H])`` into the accumulator ``(out, lse)`` by log-sum-exp
    (``-inf``: nothing attended yet / at this step); returns the new pair."""
    import torch

    new = torch.logaddexp(lse, lo)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    return (out * torch.exp(lse - safe).unsqueeze(-1) + o * torch.exp(lo - safe).unsqueeze(-1)), new


def _merge_rows(out: Any, lse: Any, rows: slice, o: Any, lo: Any) -> None:
    """Fold a dense call's ``o [Lq, H, D]``, ``lo [Lq, H]`` into rows ``rows`` of the step's partial."""
    out[rows], lse[rows] = merge(out[rows], lse[rows], o, lo)


def _merge_entries(out_f: Any, lse_f: Any, rh: Any, o: Any, lo: Any) -> None:
    """Fold entries (packed row-head ``rh [E]``, ``o [E, D]``, ``lo [E]``; several per row-head) into the
    flat ``out_f [T * H, D]``, ``lse_f [T * H]`` in place, by log-sum-exp."""
    import torch

    m = lse_f.clone().scatter_reduce_(0, rh, lo, "amax", include_self=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_old = torch.exp(lse_f - m)
    w = torch.exp(lo - m.index_select(0, rh))
    total = w_old.clone().index_add_(0, rh, w)
    acc = (out_f * w_old.unsqueeze(-1)).index_add_(0, rh, o * w.unsqueeze(-1))
    hit = total > 0
    out_f.copy_(torch.where(hit.unsqueeze(-1), acc / torch.where(hit, total, 1.0).unsqueeze(-1), out_f))
    lse_f.copy_(torch.where(hit, m + torch.log(torch.where(hit, total, 1.0)), lse_f))


def _dense_calls(p: RankPlan, key_blocks: list[set[int]]) -> list[tuple[int, int, int, int, bool]]:
    """(q0, q1, k0, k1, causal) of the step's dense calls (module docstring)."""
    B, out = p.block_size, []
    runs = [_runs(sorted(kb)) for kb in key_blocks]
    for (a, b), rows in zip(p.lay.dense, p.lay.dense_rows):
        r0 = a if rows is None else rows[0]
        i = _seq_of(p.cu, a)
        for run in runs[i]:
            k0, k1 = a + run[0] * B, min(a + (run[-1] + 1) * B, b)
            if k0 >= b:  # keys after the rows: causally masked
                continue
            if k0 < r0:  # keys before the query run: every query sees them
                out.append((r0, b, k0, min(k1, r0), False))
            if k1 > r0:  # keys inside the query run: only the run itself (a block has one holder)
                if max(k0, r0) != r0 or k1 != b:
                    raise ValueError(f"held keys [{k0}, {k1}) cut query rows [{r0}, {b}): not a block layout")
                out.append((r0, b, r0, b, True))
    return out


def _seq(x: Any, a: int, b: int, g: int) -> Any:
    """Rows [a, b) of ``[T, heads, D]`` as ``[1, heads x g, L, D]`` (kv heads repeated ``g`` times)."""
    return _expand(x[a:b].transpose(0, 1).unsqueeze(0), g).contiguous()


def _blk(lay: Layout, x: Any) -> Any:
    """``[T, heads, E]`` -> ``[NO, heads, B, E]``: the rows of every own block of ``lay``."""
    y = x.index_select(0, lay.own_idx)
    return y.view(lay.n_own, -1, x.shape[1], x.shape[2]).transpose(1, 2).contiguous()


def _pairs_dense(q0: int, q1: int, k0: int, k1: int, causal: bool) -> float:
    n = q1 - q0
    return n * (n + 1) / 2 if causal else float(n * (k1 - k0))


def step_forward(p: RankPlan, q: Any, k: Any, v: Any, key_blocks: list[tuple[int, ...]]) -> tuple[Any, Any, StepSaved]:
    """The step's partial ``(out [T, H, D], lse [T, H])`` of the rank's query rows against the keys of
    ``key_blocks`` (per sequence, the blocks held at this step), in the compute dtype of ``q``; rows
    it does not touch hold 0 and ``-inf``. ``q``, ``k``, ``v`` in the compute dtype, contiguous."""
    import torch

    B, H, hk, D = p.block_size, p.heads, p.kv_heads, p.dim
    g, scale = H // hk, 1.0 / math.sqrt(D)
    T = q.shape[0]
    held_sets = [set(kb) for kb in key_blocks]
    out = q.new_zeros(T, H, D)
    lse = q.new_full((T, H), float("-inf"))
    saved = StepSaved(dense=_dense_calls(p, held_sets), own=False)

    for q0, q1, k0, k1, causal in saved.dense:
        o, lo = _flash(_seq(q, q0, q1, 1), _seq(k, k0, k1, g), _seq(v, k0, k1, g), causal, scale)
        _merge_rows(out, lse, slice(q0, q1), o[0].transpose(0, 1), lo[0].transpose(0, 1))
        saved.pairs += _pairs_dense(q0, q1, k0, k1, causal)
    lay = p.lay
    if lay.n_own:  # own blocks: held all together (the rank's own step) or not at all
        starts = lay.own_idx.view(lay.n_own, B)[:, 0].tolist()
        held = [((a - p.cu[i]) // B) in held_sets[i] for a in starts for i in [_seq_of(p.cu, a)]]
        if any(held) and not all(held):
            raise ValueError("own blocks held in part at one step: not a block layout")
        saved.own = all(held)
    if saved.own:
        oo, lo = _flash(_blk(lay, q), _expand(_blk(lay, k), g).contiguous(), _expand(_blk(lay, v), g).contiguous(),
                        True, scale)
        o = oo.transpose(1, 2).reshape(lay.n_own * B, H, D).index_select(0, lay.own_src)
        l_ = lo.transpose(1, 2).reshape(lay.n_own * B, H).index_select(0, lay.own_src)
        out.index_copy_(0, lay.own_rows, o)  # no dense call touches a sparse row: nothing to merge
        lse.index_copy_(0, lay.own_rows, l_)
        real = torch.zeros(lay.n_own * B, dtype=torch.bool).index_fill_(0, lay.own_src, True).view(lay.n_own, B)
        c = real.sum(1).to(torch.float64)
        saved.pairs += float((c * (c + 1) / 2).sum())
    # past blocks held at this step: their entries, tiled by (kv head, held block)
    slot: dict[tuple[int, int], int] = {}
    for i, kb in enumerate(key_blocks):
        for j in sorted(kb):
            if j < blocks(p.cu[i + 1] - p.cu[i], B) - 1:  # the last block is never a past block
                slot[(i, j)] = len(slot)
    if not slot or not p.chosen:
        return out, lse, saved
    nk = len(slot)
    starts = sorted(slot, key=slot.__getitem__)
    saved.key_idx = (torch.tensor([p.cu[i] + j * B for i, j in starts], dtype=torch.int64)[:, None]
                     + torch.arange(B)).reshape(-1)
    kb_, vb_ = (x.index_select(0, saved.key_idx).view(nk, B, hk, D).permute(2, 0, 1, 3).reshape(hk * nk, 1, B, D)
                for x in (k, v))
    lookup: dict[int, Any] = {}  # per sequence: the held slot of each block, -1 where not held here
    for (i, j), sl in slot.items():
        if i not in lookup:
            lookup[i] = torch.full((blocks(p.cu[i + 1] - p.cu[i], B),), -1, dtype=torch.int64)
        lookup[i][j] = sl
    out_f, lse_f, q_f = out.view(-1, D), lse.view(-1), q.view(-1, D)
    for pieces in p.chosen:
        keys_l, rh_l = [], []
        for i, _, _, sel, rowheads in pieces:
            if i not in lookup:
                continue
            at = lookup[i][sel]  # [H, R, n] held slot of each entry
            keep = (at >= 0).reshape(-1)
            kvh = (torch.arange(H) // g)[:, None, None].expand_as(at)
            keys_l.append((kvh * nk + at).reshape(-1)[keep])
            rh_l.append(rowheads[keep])
        if not keys_l or not sum(x.numel() for x in keys_l):
            continue
        keys, rh = torch.cat(keys_l), torch.cat(rh_l)
        tab, lane, kv, pos = group(keys, rh, hk * nk)
        nt = kv.shape[0]
        ot, lt = _flash(q_f.index_select(0, tab).view(nt, 1, -1, D), kb_.index_select(0, kv),
                        vb_.index_select(0, kv), False, scale)
        _merge_entries(out_f, lse_f, rh, ot.reshape(-1, D).index_select(0, pos), lt.reshape(-1).index_select(0, pos))
        saved.tiles.append((tab, lane, kv))
        saved.pairs += keys.numel() * B / H
    return out, lse, saved


def step_backward(p: RankPlan, saved: StepSaved, q: Any, k: Any, v: Any, out: Any, lse: Any,
                  dout: Any) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` packed, compute dtype: the step's share of the gradients, from the layer's
    merged ``out`` and ``lse`` (after every step) and its output gradient ``dout``."""
    import torch

    B, H, hk, D = p.block_size, p.heads, p.kv_heads, p.dim
    g, scale = H // hk, 1.0 / math.sqrt(D)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    for q0, q1, k0, k1, causal in saved.dense:
        gq, gk, gv = _flash_bwd(_seq(dout, q0, q1, 1), _seq(q, q0, q1, 1), _seq(k, k0, k1, g), _seq(v, k0, k1, g),
                                _seq(out, q0, q1, 1), lse[q0:q1].t().unsqueeze(0), causal, scale)
        dq[q0:q1] += gq[0].transpose(0, 1)
        dk[k0:k1] += _fold(gk, g)[0].transpose(0, 1)
        dv[k0:k1] += _fold(gv, g)[0].transpose(0, 1)
    lay = p.lay
    if saved.own:
        def unblk(y):
            return y.transpose(1, 2).reshape(lay.n_own * B, y.shape[1], y.shape[3]).index_select(0, lay.own_src)

        real = torch.zeros(lay.n_own * B, dtype=torch.bool).index_fill_(0, lay.own_src, True)
        # padding rows of a partial block: lse = +inf gives P = 0 there, so they add no gradient
        lo = _blk(lay, lse.unsqueeze(-1)).squeeze(-1).masked_fill(~real.view(-1, 1, B), float("inf"))
        gq, gk, gv = _flash_bwd(_blk(lay, dout), _blk(lay, q), _expand(_blk(lay, k), g).contiguous(),
                                _expand(_blk(lay, v), g).contiguous(), _blk(lay, out), lo, True, scale)
        dq.index_add_(0, lay.own_rows, unblk(gq))
        dk.index_add_(0, lay.own_rows, unblk(_fold(gk, g)))
        dv.index_add_(0, lay.own_rows, unblk(_fold(gv, g)))
    if not saved.tiles:
        return dq, dk, dv
    nk = saved.key_idx.numel() // B
    kb_, vb_ = (x.index_select(0, saved.key_idx).view(nk, B, hk, D).permute(2, 0, 1, 3).reshape(hk * nk, 1, B, D)
                for x in (k, v))
    dkb, dvb = torch.zeros_like(kb_), torch.zeros_like(vb_)
    dq_f, out_f, lse_f, do_f, q_f = dq.view(-1, D), out.view(-1, D), lse.view(-1), dout.view(-1, D), q.view(-1, D)
    for tab, lane, kv in saved.tiles:
        shape = (kv.shape[0], 1, -1, D)
        lt = lse_f.index_select(0, tab).view(lane.shape).masked_fill(~lane, float("inf"))
        gq, gk, gv = _flash_bwd(do_f.index_select(0, tab).view(shape), q_f.index_select(0, tab).view(shape),
                                kb_.index_select(0, kv), vb_.index_select(0, kv),
                                out_f.index_select(0, tab).view(shape), lt, False, scale)
        dkb.index_add_(0, kv, gk)
        dvb.index_add_(0, kv, gv)
        real = lane.reshape(-1)
        dq_f.index_add_(0, tab[real], gq.reshape(-1, D)[real])
    dk.index_add_(0, saved.key_idx, dkb.view(hk, nk * B, D).transpose(0, 1))
    dv.index_add_(0, saved.key_idx, dvb.view(hk, nk * B, D).transpose(0, 1))
    return dq, dk, dv
