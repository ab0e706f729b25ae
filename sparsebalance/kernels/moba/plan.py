"""The host plan of one MoBA call shape: every table the Triton kernels need that depends on the
sequence lengths, budgets and shapes only, never on q/k/v -- built once per shape key and cached.

Why: a training step calls the kernel once per layer with the same packed micro-batch, and every
count the kernels need follows from the lengths and budgets in closed form: a query of block c of
a sequence with budget k chooses exactly min(k - 1, c) past blocks, so the gathered entries per
tile, their offsets, the forward chunks of the partial buffer and upper bounds of every grid are
known on the host. Only *which* blocks are chosen is data: the gate writes it on the device and
the index sorts it there (``triton_select.py``). Nothing here reads a device tensor, so a call whose
plan is cached issues no host synchronisation and no host-to-device copy.

Tables (uploaded once per plan, from pinned memory without blocking on CUDA):

* ``means_blocks`` int32 [3, n]: (global block, first row, rows) of every block whose mean the gate
  scores (blocks 0 .. n - 2 of each gated sequence);
* ``gate_tiles`` int64 [9, n]: per tile of ``gate`` (row, query head) pairs of one kv head inside
  one block of a gated sequence: the block's first row and rows, local block c, global id of the
  sequence's block 0, choices min(k - 1, c), masked (1) or sparse (0), the block's first entry
  (closed form), forward chunk, first pair;
* per forward chunk (:class:`Chunk`): its query tiles for the own-block + merge kernel
  (first row, first key row, block end, slots to merge, mask start), unmasked and masked apart;
* ``own`` / ``own_masked`` int32 [10, n]: the backward's own-block pieces, longest first: key
  sub-tile (first row, keys), kv head, row range, query heads [g0, g1) of the group, bucket (-1:
  no gathered rows), pieces of the sub-tile, mask start;
* ``bstart`` int32 [n_blocks]: first row of every global block; ``ptr_keys``: the values the index
  searches its sorted keys for.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparsebalance.data.sequence import blocks

DENSE, SPARSE, MASKED = 0, 1, 2
"""Sequence kinds (the codes of ``simulator.cost.kernelcost``)."""
#: Slot width above which the gate's top-k runs in PyTorch (packed keys, ``triton_gate.select_torch``)
#: and the kernel only writes the entries: 128 int64 keys per row are the widest top-k that compiles
#: for sm_90a without spills (16 rows, 8 warps: 180 registers; 256 spills ~1.9 KB at every candidate;
#: README, "Hopper compile check").
GATE_MAX_KW = 128
#: Plans kept (a step reuses one per micro-batch shape across its layers).
CACHE_SIZE = 64
#: Programs the backward's split aims at: enough waves to balance 132 SMs, few enough that the
#: relaxed dK/dV adds of split pieces stay a small share of the traffic.
PROGRAMS = 4096
#: Most gathered entries per backward piece (a bucket larger than this is split in any case).
BWD_ENTRIES_MAX = 16384


def bwd_entries(entries: int, subs: int, least: int) -> int:
    """Gathered entries per backward piece: the power of two that makes about ``PROGRAMS`` programs of
    ``subs`` key sub-tiles each, within [least, BWD_ENTRIES_MAX] (``kernelcost`` mirrors it)."""
    return max(least, min(max(BWD_ENTRIES_MAX, least), next_pow2(-(-entries * subs // PROGRAMS))))


def gate_warps(kw: int, default: int) -> int:
    """Warps of the gate at slot width ``kw`` (``launch.GATE_WARPS``: the compile report's)."""
    from sparsebalance.kernels.moba.launch import GATE_WARPS

    return GATE_WARPS.get(kw, default)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@dataclass(kw_only=True, slots=True)
class Chunk:
    """Forward rows [row0, row1): their partial outputs fit the partial buffer at once."""

    row0: int
    """First row of the chunk."""
    row1: int
    """One past its last row."""
    entries: int
    """Gathered entries of its rows."""
    past_grid: int
    """Programs of the past-block kernel: an upper bound of its items (empty ones exit)."""
    q_tiles: Any
    """int32 [5, n] query tiles of the own-block + merge kernel (unmasked variant)."""
    q_tiles_masked: Any
    """The masked dense path's query tiles (MASKED variant)."""


@dataclass(kw_only=True, slots=True)
class MobaPlan:
    """Everything of one call that follows from its shape key (see the module docstring)."""

    T: int
    """Tokens."""
    H: int
    """Query heads."""
    HKV: int
    """Key/value heads."""
    D: int
    """Head dim."""
    block: int
    """MoBA block size."""
    kinds: list[int]
    """Per sequence: DENSE, SPARSE or MASKED."""
    cfg: dict
    """Launch configuration per kernel (``launch.config``)."""
    k1p: int
    """Slots per (token, head) of the selection: a power of two >= 2 (its log2 is ``shift``)."""
    shift: int
    """log2(k1p)."""
    kw: int
    """Gate slot width (a power of two >= 16, >= k1p)."""
    from_sel: bool
    """Top-k in PyTorch (k1p > GATE_MAX_KW)."""
    words: int
    """Bit words per (token, head) of the masked path (1 when none)."""
    n_blocks: int
    """Global key blocks of the call."""
    nc: int
    """Forward chunks."""
    entries: int
    """Gathered (row, head, choice) entries of the call."""
    key_dtype: Any
    """torch dtype of the index's sort keys (int16 when bucket x chunk fits)."""
    chunks: list[Chunk] = field(default_factory=list)
    """Forward chunks, in row order."""
    bwd_entries: int = 0
    """Gathered entries per backward piece (:func:`bwd_entries`)."""
    partial_rows: int = 0
    """Rows of the largest chunk that gathers (the partial buffer holds rows x H x k1p slots)."""
    gathered_grid: int = 0
    """Programs of the backward's gathered part: an upper bound (empty ones exit)."""
    n_own: int = 0
    """Backward own-block pieces (unmasked)."""
    n_own_masked: int = 0
    """Backward own-block pieces of masked-path sequences."""
    gated: bool = False
    """Some sequence runs the gate (sparse with k >= 2, or masked)."""
    has_masked: bool = False
    """Some sequence runs the masked dense path (the gate writes bit words)."""
    code_dtype: Any = None
    """torch dtype of the entry codes: int32 while T H k1p < 2^31, else int64."""
    gate_launch: dict = field(default_factory=dict)
    """The gate kernel's constexprs and launch options (precomputed: a call only passes tensors)."""
    dev: dict = field(default_factory=dict)
    """Device tables by name (see the module docstring)."""
    sel_seqs: list = field(default_factory=list)
    """(first row, length, block 0's global id, k - 1, kind) of every gated sequence."""


_cache: OrderedDict = OrderedDict()


def upload(a: np.ndarray, device: Any, dtype: Any) -> Any:
    """A host array on ``device``: from pinned memory without blocking on CUDA (no host sync)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
    if getattr(device, "type", device) == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def get_plan(key: tuple, build) -> MobaPlan:
    """The plan of ``key``, built by ``build()`` on a miss (LRU of :data:`CACHE_SIZE`)."""
    p = _cache.get(key)
    if p is None:
        p = build()
        _cache[key] = p
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return p


def _blocks(cu: np.ndarray, block: int, budgets: np.ndarray, kinds: np.ndarray) -> dict:
    """Per global block: sequence, local index, first row, rows, and the flags of its sequence."""
    s0, L = cu[:-1], cu[1:] - cu[:-1]
    n = blocks(L, block)
    seq = np.repeat(np.arange(len(n)), n)
    base = np.cumsum(n) - n
    c = np.arange(int(n.sum())) - base[seq]
    start = s0[seq] + c * block
    kind, k = kinds[seq], budgets[seq]
    gathers = (kind == SPARSE) & (k >= 2)
    return {"seq": seq, "c": c, "start": start, "len": np.minimum(block, cu[1:][seq] - start),
            "base": base[seq], "n": n[seq], "k": k, "kind": kind, "gathers": gathers,
            "gated": gathers | (kind == MASKED), "s0": s0[seq], "s1": cu[1:][seq],
            "nsel": np.where(gathers | (kind == MASKED), np.minimum(k - 1, c), 0)}


def _tiles_of(rows: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split runs of ``rows`` into tiles of ``per``: (run of each tile, first row offset, rows)."""
    nt = -(-rows // per)
    run = np.repeat(np.arange(len(rows)), nt)
    off = (np.arange(int(nt.sum())) - np.repeat(np.cumsum(nt) - nt, nt)) * per
    return run, off, np.minimum(per, rows[run] - off)


def _chunk_ids(part_rows: np.ndarray, cap_rows: int) -> np.ndarray:
    """Greedy runs of blocks whose partial rows stay under ``cap_rows`` (at least one block each)."""
    ids = np.zeros(len(part_rows), dtype=np.int64)
    cur, rows = 0, 0
    for b, r in enumerate(part_rows.tolist()):
        if rows and rows + r > cap_rows:
            cur, rows = cur + 1, 0
        ids[b] = cur
        rows += r
    return ids


def _own_pieces(b: dict, bm: int, bn: int, G: int, HKV: int, cap_tiles: int) -> np.ndarray:
    """The backward's own-block pieces [10, n] (see the module docstring), longest first."""
    subs = -(-b["len"] // bn)
    blk = np.repeat(np.repeat(np.arange(len(subs)), subs), HKV)
    sub = np.repeat(np.arange(int(subs.sum())) - np.repeat(np.cumsum(subs) - subs, subs), HKV)
    kvh = np.tile(np.arange(HKV), int(subs.sum()))
    start = b["start"][blk]
    r0 = start + (sub * bn // bm) * bm                       # row tiles before the key tile see none of it
    r1 = np.where(b["kind"][blk] == SPARSE, start + b["len"][blk], b["s1"][blk])
    tiles = -(-(r1 - r0) // bm)
    single = G * tiles <= cap_tiles
    per_head = np.where(single, 1, -(-tiles // cap_tiles))
    pieces = np.where(single, 1, G * per_head)
    u = np.repeat(np.arange(len(blk)), pieces)
    q = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    P = per_head[u]
    tpp = -(-tiles[u] // P) * bm
    g = np.where(single[u], 0, q // P)
    i = np.where(single[u], 0, q % P)
    pr0 = r0[u] + i * tpp
    pr1 = np.where(single[u], r1[u], np.minimum(pr0 + tpp, r1[u]))
    bb = blk[u]
    choosable = b["gathers"][bb] & (b["c"][bb] < b["n"][bb] - 1)
    out = np.stack([start[u] + sub[u] * bn, np.minimum(bn, b["len"][bb] - sub[u] * bn), kvh[u], pr0, pr1,
                    g, np.where(single[u], G, g + 1), np.where(choosable, bb * HKV + kvh[u], -1), pieces[u],
                    np.where(b["kind"][bb] == MASKED, b["s0"][bb], -1)])
    work = (out[4] - out[3]) * (out[6] - out[5])
    return out[:, np.argsort(-work, kind="stable")]


def build_plan(cu: list[int], budgets: list[int], kinds: list[int], *, H: int, HKV: int, D: int, block: int,
               elem: int, cfg: dict, device: Any, partial_bytes: int, bwd_entries_arg: int,
               own_tiles: int, kw_min: int = 16) -> MobaPlan:
    """The plan of one shape (see the module docstring). ``cfg``: launch configuration per kernel;
    ``partial_bytes``: partial-output buffer cap; ``bwd_entries_arg``: least gathered entries per backward
    piece; ``own_tiles``: least (row tile x query head) pairs an own-block piece may hold -- both grow
    to make about ``PROGRAMS`` backward programs;
    ``kw_min``: least gate slot width (16 compiled, ``tl.dot``'s least N; any interpreted)."""
    import torch

    cu_a = np.asarray(cu, dtype=np.int64)
    ks = np.asarray(budgets, dtype=np.int64)
    kd = np.asarray(kinds, dtype=np.int64)
    b = _blocks(cu_a, block, ks, kd)
    G, nb = H // HKV, len(b["c"])
    gated_seq = ((kd == SPARSE) & (ks >= 2)) | (kd == MASKED)
    k1 = int((ks[gated_seq] - 1).max()) if gated_seq.any() else 0
    k1p = max(2, next_pow2(k1))
    from_sel = k1p > GATE_MAX_KW
    words = max([-(-int(x) // 32) for x in blocks(cu_a[1:] - cu_a[:-1], block)[kd == MASKED]], default=1)
    i32, i64 = torch.int32, torch.int64
    # forward chunks: partial rows x H x k1p slots x D values stay under partial_bytes
    part = np.where(b["gathers"], b["len"], 0)
    chunk = _chunk_ids(part, max(1, partial_bytes // (H * k1p * D * elem)))
    nc = int(chunk[-1]) + 1 if nb else 1
    nbk = nb * HKV
    key_dtype = torch.int16 if nbk * nc < 2**15 else torch.int32
    # gate tiles (sparse: blocks c >= 1; masked: every block, for the own-block bit)
    gmask = b["gated"] & ((b["kind"] == MASKED) | (b["c"] >= 1))
    gb = np.flatnonzero(gmask)
    blk_ent = np.where(b["gathers"][gb], b["len"][gb] * H * b["nsel"][gb], 0)
    run, pair0, _ = _tiles_of(b["len"][gb] * G, cfg["gate"].block_m)  # (row, head) pairs of one kv head
    tb = gb[run]
    eoff = (np.cumsum(blk_ent) - blk_ent)[run]
    gate_tiles = np.stack([b["start"][tb], b["len"][tb], b["c"][tb], b["base"][tb], b["nsel"][tb],
                           (b["kind"][tb] == MASKED).astype(np.int64), eoff, chunk[tb], pair0])
    mb = np.flatnonzero(b["gated"] & (b["c"] < b["n"] - 1))
    means_blocks = np.stack([mb, b["start"][mb], b["len"][mb]])
    entries = int(blk_ent.sum())
    ent_chunk = np.zeros(nc, dtype=np.int64)
    np.add.at(ent_chunk, chunk[gb], blk_ent)
    choosable = int((b["gathers"] & (b["c"] < b["n"] - 1)).sum()) * HKV
    plan = MobaPlan(T=int(cu_a[-1]), H=H, HKV=HKV, D=D, block=block, kinds=[int(x) for x in kd], cfg=cfg, k1p=k1p,
                    shift=k1p.bit_length() - 1, kw=max(kw_min, k1p), from_sel=from_sel, words=words, n_blocks=nb,
                    nc=nc, entries=entries, key_dtype=key_dtype, gated=bool(len(gb)))
    plan.has_masked = bool((kd == MASKED).any())
    plan.code_dtype = torch.int32 if plan.T * H * k1p < 2**31 else torch.int64
    g = cfg["gate"]
    plan.gate_launch = {"D": D, "KW": min(64, k1p) if from_sel else plan.kw, "M": plan.kw.bit_length() - 1,
                        "BM": g.block_m, "FROM_SEL": from_sel, "num_warps": gate_warps(plan.kw, g.warps),
                        "num_stages": g.stages}
    dev = plan.dev
    dev["no_entries"] = torch.empty(0, dtype=key_dtype, device=device), torch.empty(0, dtype=plan.code_dtype,
                                                                                     device=device)
    dev["gate_tiles"] = upload(gate_tiles, device, i64)
    dev["means_blocks"] = upload(means_blocks, device, i32)
    dev["bstart"] = upload(b["start"], device, i32)
    dev["ptr_keys"] = torch.arange(nbk * nc + 1, dtype=key_dtype, device=device)
    dev["none"] = torch.zeros(1, dtype=torch.int64, device=device)  # the index tables of a call without entries
    seq_base = np.cumsum(blocks(cu_a[1:] - cu_a[:-1], block)) - blocks(cu_a[1:] - cu_a[:-1], block)
    plan.sel_seqs = [(int(cu_a[i]), int(cu_a[i + 1] - cu_a[i]), int(seq_base[i]), int(ks[i] - 1), int(kd[i]))
                     for i in np.flatnonzero(gated_seq)]
    # forward: per chunk, the own-block + merge query tiles and the past kernel's grid bound
    bm_o, bm_p = cfg["fwd_own_merge"].block_m, cfg["fwd_past"].block_m
    run, off, _ = _tiles_of(b["len"], bm_o)
    dense_loops = b["kind"][run] != SPARSE
    qt = np.stack([b["start"][run] + off, np.where(dense_loops, b["s0"][run], b["start"][run]),
                   b["start"][run] + b["len"][run], np.where(b["gathers"][run], b["nsel"][run], 0),
                   np.where(b["kind"][run] == MASKED, b["s0"][run], -1)])
    for c in range(nc):
        ids = np.flatnonzero(chunk == c)
        sel = chunk[run] == c
        e_c = int(ent_chunk[c])
        mk = qt[4] >= 0
        plan.chunks.append(Chunk(
            row0=int(b["start"][ids[0]]), row1=int(b["start"][ids[-1]] + b["len"][ids[-1]]), entries=e_c,
            past_grid=-(-e_c // bm_p) + min(e_c, choosable) if e_c else 0,
            q_tiles=upload(qt[:, sel & ~mk], device, i32), q_tiles_masked=upload(qt[:, sel & mk], device, i32)))
        if e_c:
            plan.partial_rows = max(plan.partial_rows, plan.chunks[-1].row1 - plan.chunks[-1].row0)
    # backward: own-block pieces (host) and the gathered part's grid bound (device-sized buckets)
    bk = cfg["bwd_kv"]
    subs = -(-b["len"] // bk.block_n)
    r0 = (np.arange(int(subs.max(initial=0))) * bk.block_n // bk.block_m) * bk.block_m
    units = 0  # (row tile x head) pairs of every own sub-tile: sized so that pieces make ~PROGRAMS programs
    for i in range(len(r0)):
        on = subs > i
        rend = np.where(b["kind"] == SPARSE, b["len"], b["s1"] - b["start"])
        units += int((G * HKV * -(-(rend[on] - r0[i]) // bk.block_m)).sum())
    own = _own_pieces(b, bk.block_m, bk.block_n, G, HKV, max(own_tiles, -(-units // PROGRAMS)))
    mk = own[9] >= 0
    dev["own"] = upload(own[:, ~mk], device, i32)
    dev["own_masked"] = upload(own[:, mk], device, i32)
    plan.n_own, plan.n_own_masked = int((~mk).sum()), int(mk.sum())
    plan.bwd_entries = bwd_entries(entries, block // bk.block_n, bwd_entries_arg)
    if entries:
        plan.gathered_grid = (entries // plan.bwd_entries + choosable) * (block // bk.block_n)
    return plan
