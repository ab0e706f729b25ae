"""Cost model of the MoBA kernel we ship (``kernels/moba/``, README "Triton kernel"), one sequence, one layer.

What a call runs (docs/costmodel.md sections 2-3 have the derivations and every constant's source):

* a sequence whose budget covers all its blocks (k >= n) runs **dense** causal attention in the
  query-major own-block loops; otherwise the dispatcher picks, per sequence, the cheaper by this
  model (:func:`choose_path`) of two exact paths: **sparse** (key-block-major) or **masked** (the
  dense loops under each row's selected-block bits);
* **gate** (Triton: block means, then per (row, head) tile the fp32 scores and an exact bitonic
  top-k of packed keys; rows of blocks c <= k - 1 take every past block without scoring);
* **index** (sparse): one sort of the entries' keys, a gather of their codes, a ``searchsorted``
  and the running item counts (one small kernel) -- no host synchronisation, no per-call planning;
* forward: the **past** kernel (``block_m`` gathered entries x one key block, partials written) and
  the **own + merge** kernel (own block causally, partials merged);
* backward: a prologue (delta, zeroed dK/dV), the **kv** kernel (a program owns a key sub-tile:
  S, dP, dV, dK over every row that attends it), the **dq** kernels (S, dP, dQ: own rows per query
  tile, gathered rows per forward item), a cast -- 7 matmuls a pair, no ordered atomic.

Executed (row, key) pairs -- what the tensor cores multiply -- are counted in ``kernelwork.py`` (its
names are re-exported here). Constants are measurements of this kernel: per-kernel device times of an H100 launch sweep of the forward kernels
(:data:`SWEEP_MS`) turned into efficiencies through this model's own counts, and the gate's
instructions per scoring step from its sm_90a PTX (:data:`GATE_LOOP`); never fitted to a stage check.

All functions broadcast over numpy arrays of lengths and budgets. ``heads``/``kv_heads`` are per
tensor-parallel rank.
"""

from __future__ import annotations

import functools

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.simulator.cost.hardware import FA3_TRITON_FWD_TFLOPS, H100_PEAK_TFLOPS
from sparsebalance.simulator.cost.kernelwork import (  # noqa: F401  (the counts, re-exported for callers)
    DENSE,
    FWD_TILE,
    KV_TILE,
    MASKED,
    OWN_TILE,
    PARTIAL_BYTES,
    PATHS,
    SPARSE,
    Shape,
    _tile,
    forward_chunks,
    kv_own_pairs,
    own_pairs,
    past_attended,
    work,
)

# The kernel's caps and gate configuration at head dim 128 (kernels/moba/launch.py, plan.py; mirrored:
# simulator/ may not import kernels/; tests/kernels/test_kernelcost_counts.py asserts they agree).
GATE_ROWS = 16        # (row, head) pairs per gate program
GATE_MAX_KW = 128     # widest top-k in the kernel; wider budgets take it in PyTorch
BWD_ENTRIES = 2048        # least gathered entries per backward piece ...
BWD_ENTRIES_MAX = 16384   # ... most (plan.py: bwd_entries)
PROGRAMS = 4096           # the backward's split aims at about this many programs
GATE_WARPS = {16: 4, 32: 4, 64: 8, 128: 8}

#: PTX instructions per thread of one iteration of the gate's scoring loop (``GATE_ROWS`` pairs x kw
#: blocks: loads of kw block means, the fp32 products, the bitonic fold), by (head dim, kw), at
#: ``GATE_WARPS[kw]`` warps: the sm_90a compile report (``sm90.inspect(...)["loop"]``, README
#: "Hopper compile check"). Other head dims interpolate linearly.
GATE_LOOP = {(64, 16): 563, (64, 32): 1193, (64, 64): 1496, (64, 128): 3642,
             (128, 16): 772, (128, 32): 1671, (128, 64): 2134, (128, 128): 4718}
#: FP32 (CUDA-core) peak FLOP/s by device, data sheets (H100 / H200 SXM 67 TFLOPS, H20 44, A100 19.5):
#: a lane instruction rate of half of it (an FMA is 2 FLOPs) prices the gate's scoring loop.
FP32_PEAK = {"h100": 67e12, "h200": 67e12, "h20": 44e12, "a100-80gb": 19.5e12, "a100-40gb": 19.5e12}

#: Device time per kernel (ms, mean of 3 calls, torch.profiler) of the forward kernels on an H100 80GB
#: HBM3 at 64x32 tiles, 4 warps, 2 stages: docs/gpu/h100-2026-11-26/tune_launch_before.csv
#: (``benchmarks/tune_launch_gpu.py``): qwen2.5-3b on one TP-2 rank (8 heads, 1 kv head, D 128),
#: block 256, bf16, one sequence of ``tokens`` at budget ``k``. The inner loops timed there are the
#: shipped ones (past: one key block per gathered tile; own: the causal loop, then the merge).
SWEEP_MS = {("past", 32768, 16): 1.5534896666666682, ("own_merge", 32768, 16): 0.9630426666666668,
            ("own_masked", 4096, 4): 0.18382366666666802}
#: Bytes per merged entry the timed own + merge kernel read: partial output (2 D) + LSE + sel slot.
SWEEP_MERGE_BYTES = 2 * 128 + 8
H100_BANDWIDTH = 3.35e12


def gate_width(k1p, head_dim: int = 128):
    """(kw, warps, PTX instructions per thread and scoring step) of the gate at slot width k1p."""
    kw = np.clip(np.asarray(k1p), 16, GATE_MAX_KW)
    w = np.vectorize(lambda x: GATE_WARPS[int(x)])(kw)
    lo, hi = (np.vectorize(lambda x, d=d: GATE_LOOP[(d, int(x))])(kw) for d in (64, 128))
    return kw, w, lo + (hi - lo) * (head_dim - 64) / 64


def _ceil_sum(c0, c1, kw):
    """sum over c in [c0, c1) of ceil(c / kw) (0 when c1 <= c0)."""
    def S(x):  # sum over c = 1..x
        q, r = x // kw, x % kw
        return kw * q * (q + 1) // 2 + r * (q + 1)
    return np.where(c1 > c0, S(np.maximum(c1 - 1, 0)) - S(np.maximum(c0 - 1, 0)), 0)


def gate_counts(L, k, s: Shape, path=None) -> dict:
    """The gate of a sparse or masked sequence: lane instructions of its scoring loop, HBM bytes,
    launches. Rows of blocks c >= k score c past blocks in steps of kw (:func:`gate_width`)."""
    L, k = np.broadcast_arrays(np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64))
    w = work(L, k, s, path)
    B, H, D, G = s.block, s.heads, s.head_dim, s.heads // s.kv_heads
    n, gated = w["n"], w["gated"]
    r = L - (n - 1) * B
    kw, warps, loop = gate_width(w["k1p"], D)
    # programs: ceil(rows x G / GATE_ROWS) per (block, kv head); scoring steps ceil(c / kw) for c >= k
    tiles_full, tiles_last = -(-B * G // GATE_ROWS), -(-r * G // GATE_ROWS)
    steps = tiles_full * _ceil_sum(k, n - 1, kw) + tiles_last * np.where(n - 1 >= k, -(-(n - 1) // kw), 0)
    lane = np.where(gated, s.kv_heads * steps * loop * warps * 32, 0.0)
    scored = np.where(gated, H * (L - np.minimum(L, k * B)), 0)        # rows of blocks c >= k
    torch_topk = gated & (w["k1p"] > GATE_MAX_KW)                      # PyTorch top-k: scores, keys, top-k
    past_scores = H * B * np.maximum(n - 1, 0) * np.maximum(n - 2, 0) // 2
    nbytes = (L * s.kv_heads * D * s.dtype_bytes + n * s.kv_heads * D * 4     # block means
              + scored * D * s.dtype_bytes                                   # q of the scored rows
              + np.where(w["sparse"], w["entries"] * 6, L * H * 4 * -(-n // 32))  # entries or bit words
              + np.where(torch_topk, past_scores * 40, 0))
    return {"lane_instr": lane, "bytes": np.where(gated, nbytes, 0.0), "launches": np.where(gated, 2, 0)}


def sort_passes(L, k, s: Shape, path=None):
    """(radix passes, key bytes) of the index's sort: int16 keys (2 passes of 8 bits) while buckets x
    chunks fit, else int32 (4)."""
    w = work(L, k, s, path)
    wide = w["n"] * s.kv_heads * w["chunks"] >= 2**15
    return np.where(wide, 4, 2), np.where(wide, 4, 2)


def index_counts(L, k, s: Shape, path=None) -> dict:
    """The index of a sparse sequence (no synchronisation): a radix sort of its entry keys (each
    pass reads and writes keys and int64 indices, plus the key histogram and the index iota), the
    gather of the int32 codes (index + code read, code written), ``searchsorted`` and the item
    counts over the (bucket, chunk) table; launches: the sort's passes + 3, then 3."""
    L, k = np.broadcast_arrays(np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64))
    w = work(L, k, s, path)
    passes, kb = sort_passes(L, k, s, path)
    e = w["entries"]
    table = w["n"] * s.kv_heads * w["chunks"]
    nbytes = e * (passes * 2 * (kb + 8) + kb + 8) + e * 16 + table * 24
    gather = w["sparse"] & (k > 1)
    return {"bytes": np.where(gather, nbytes, 0.0), "launches": np.where(gather, passes + 6, 0)}


@functools.cache
def measured() -> dict:
    """This kernel's constants from :data:`SWEEP_MS` through this model's counts: ``past`` and ``own``
    (achieved share of the H100's peak over the published Triton forward's share -- so another GPU's
    published efficiency carries them), ``merge`` (share of HBM bandwidth of the merge's reads)."""
    s = Shape(heads=8, kv_heads=1, head_dim=128, block=256)
    peak, fwd = H100_PEAK_TFLOPS * 1e12, FA3_TRITON_FWD_TFLOPS / H100_PEAK_TFLOPS
    w = work(32768, 16, s, SPARSE)
    past = 4.0 * 128 * float(w["fwd"] - w["own"]) / (SWEEP_MS[("past", 32768, 16)] * 1e-3) / peak / fwd
    m = work(4096, 4, s, MASKED)
    own = 4.0 * 128 * float(m["own"]) / (SWEEP_MS[("own_masked", 4096, 4)] * 1e-3) / peak / fwd
    own_s = 4.0 * 128 * float(w["own"]) / (peak * fwd * own)
    merge = float(w["entries"]) * SWEEP_MERGE_BYTES / (SWEEP_MS[("own_merge", 32768, 16)] * 1e-3 - own_s)
    return {"past": past, "own": own, "merge": merge / H100_BANDWIDTH}


def bwd_piece(entries, subs: int):
    """Gathered entries per backward piece (``plan.bwd_entries``): the power of two making about
    ``PROGRAMS`` programs of ``subs`` key sub-tiles, within [BWD_ENTRIES, BWD_ENTRIES_MAX]."""
    want = np.maximum(1, -(-np.asarray(entries, dtype=np.int64) * subs // PROGRAMS))
    return np.clip(2 ** np.ceil(np.log2(want)).astype(np.int64), BWD_ENTRIES, BWD_ENTRIES_MAX)


def kernel_counts(L, k, s: Shape, *, backward: bool, path=None) -> dict:
    """The Triton attention kernels: FLOPs per kernel family, the HBM bytes beyond a dense FlashAttention
    kernel's own traffic, launches. Forward: past (gathered q read, partials and codes written), own
    (the merge's partial reads, priced on their own: the merge loop follows the causal loop).
    Backward: kv (S, dP, dV, dK: 8 D per pair; dK/dV relaxed adds of split sub-tiles), dq (S, dP, dQ:
    6 D per pair; the gathered dQ's relaxed adds), glue (delta, zeroing, casts)."""
    L = np.asarray(L, dtype=np.int64)
    w = work(L, k, s, path)
    e, D, eb, B, H = w["entries"], s.head_dim, s.dtype_bytes, s.block, s.heads
    sparse = w["sparse"] & (k > 1)
    if not backward:
        return {"flops_past": 4.0 * D * (w["fwd"] - w["own"]), "flops_own": 4.0 * D * w["own"],
                "bytes_past": e * (2 * D * eb + 8), "bytes_merge": e * (D * eb + 4),
                "launches": np.where(sparse, 2 * w["chunks"], 1)}
    bn = _tile(KV_TILE, B)[1]
    kv_pieces = w["buckets_all"] + e / bwd_piece(e, B // bn)
    glue = L * H * D * 2 * eb + L * H * 4 + L * s.kv_heads * D * (8 + 2 * (4 + eb)) + L * H * D * (4 + eb)
    return {"flops_kv": 8.0 * D * w["kv"], "flops_dq": 6.0 * D * w["dq"],
            "bytes_kv": kv_pieces * (B // bn) * 8 * bn * D + e * 4 * (B // bn),
            "bytes_dq": e * (D * 4 + 2 * D * eb + 8) + L * H * D * 4, "bytes_glue": glue,
            "launches": 4 + np.where(sparse, 2 * w["chunks"], 0)}


def phase_times(L, k, s: Shape, hw, *, backward: bool = False, path=None) -> dict:
    """Seconds of each phase of one sequence's attention on ``path`` (default: the dispatcher's
    :func:`choose_path`), priced as a call of its own. A tensor-core kernel costs max(FLOPs / (peak x
    efficiency), extra bytes / (bandwidth x memory efficiency)); the forward's merge its reads at the
    measured merge bandwidth; the gate its scoring loop's lane instructions at half the FP32 peak plus
    its bytes; the index and glue their bytes; every launch ``hw.launch_overhead``. Efficiencies:
    ``hw``'s published attention efficiency x this kernel's measured share of it (:func:`measured`)."""
    L, k = np.broadcast_arrays(np.asarray(L, dtype=np.int64), np.asarray(k, dtype=np.int64))
    if path is None:
        path = choose_path(L, k, s, hw)
    c = measured()
    bw = hw.memory_bandwidth * hw.memory_efficiency
    kern = kernel_counts(L, k, s, backward=backward, path=path)
    if backward:
        eff = hw.peak_flops * hw.attention_bwd_efficiency * c["past"]
        return {"kv": np.maximum(kern["flops_kv"] / eff, kern["bytes_kv"] / bw),
                "dq": np.maximum(kern["flops_dq"] / eff, kern["bytes_dq"] / bw),
                "glue": kern["bytes_glue"] / bw, "launch": kern["launches"] * hw.launch_overhead}
    g = gate_counts(L, k, s, path)
    ix = index_counts(L, k, s, path)
    fwd = hw.peak_flops * hw.attention_fwd_efficiency
    lanes = FP32_PEAK.get(hw.device, hw.peak_flops * 67 / 989) / 2  # unknown device: the H100's FP32 share
    return {"gate": g["lane_instr"] / lanes + g["bytes"] / bw,
            "index": ix["bytes"] / bw,
            "past": np.maximum(kern["flops_past"] / (fwd * c["past"]), kern["bytes_past"] / bw),
            "own": kern["flops_own"] / (fwd * c["own"]) + kern["bytes_merge"] / (hw.memory_bandwidth * c["merge"]),
            "launch": (kern["launches"] + g["launches"] + ix["launches"]) * hw.launch_overhead}


def call_fixed(hw, *, backward: bool = False) -> float:
    """Seconds of one attention call (one layer, one packed micro-batch) that do not repeat per
    sequence: the launches every call makes -- forward the own + merge kernel, backward the prologue,
    the kv and own-dQ kernels and the cast. No host synchronisation and no per-call planning remain
    (a call's host work is tens of microseconds and overlaps the device). :func:`phase_times` prices
    a sequence as a call of its own, so it includes these once; an analytical profile's attention
    rows leave them out and its sidecar carries them (``attention_call_s``), paid once per micro-batch
    (docs/costmodel.md section 3)."""
    return (4 if backward else 1) * hw.launch_overhead


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
