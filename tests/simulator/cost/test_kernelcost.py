"""Cost model of the shipped MoBA kernel against brute-force enumerations of the kernel's loops and
hand calculations of each new term.

The own-block and dense loops are emulated tile by tile (exactly as ``triton_fwd.py`` /
``triton_bwd.py`` iterate); the gathered rows are summed row by row. Counts from real plan tables
(which need torch) are compared in ``tests/kernels/test_kernelcost_counts.py``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.simulator.config import ModelConfig, qwen25_3b
from sparsebalance.simulator.cost import kernelcost as kc
from sparsebalance.simulator.cost import roofline as rf


def own_fwd_brute(L: int, k: int, B: int, bm: int, bn: int) -> int:
    """Pairs of the query-major own loops per head: tiles of bm rows (aligned to blocks), key tiles of
    bn from the first key (block start, or 0 when dense) up to the tile's last row."""
    n = -(-L // B)
    total = 0
    for b0 in range(0, L, B):
        for t in range(b0, min(L, b0 + B), bm):
            first = 0 if k >= n else b0
            total += bm * bn * len(range(first, t + bm, bn))
    return total


def kv_own_brute(L: int, k: int, B: int, bm: int, bn: int) -> int:
    """Pairs of the kv kernel's own pieces per query head: per key sub-tile of bn keys, row tiles of bm
    from the one holding its first key to the row end (block end, or sequence end when dense)."""
    n = -(-L // B)
    seg = [(0, L)] if k >= n else [(b0, min(L, b0 + B)) for b0 in range(0, L, B)]
    total = 0
    for s0, s1 in seg:
        for sub in range(s0, s1, bn):
            first = s0 + ((sub - s0) // bm) * bm
            total += bm * bn * len(range(first, s1, bm))
    return total


@pytest.mark.parametrize("B", [16, 64, 128, 256])
def test_own_loops_match_the_kernel_loops(B):
    fm, fn = kc._tile(kc.OWN_TILE, B)
    km, kn = kc._tile(kc.KV_TILE, B)
    for L in (1, 15, 16, 17, 100, 257, 640, 1000):
        for k in (1, 2, 3, 100):
            assert int(kc.own_pairs(L, k, B)) == own_fwd_brute(L, k, B, fm, fn), (L, k, B)
            assert int(kc.kv_own_pairs(L, k, B)) == kv_own_brute(L, k, B, km, kn), (L, k, B)


def test_past_attended_is_block_times_row_choices():
    for B in (4, 16):
        for L in range(1, 90, 7):
            n = -(-L // B)
            for k in range(1, n + 2):
                want = 0 if k >= n else B * sum(min(k - 1, t // B) for t in range(L))
                assert int(kc.past_attended(L, k, B)) == want, (L, k, B)


def test_full_budget_is_dense_causal_attention():
    s = kc.Shape(heads=4, kv_heads=2, head_dim=64, block=128)
    L = np.array([1, 500, 4096, 10000])
    n = -(-L // 128)
    for k in (n, n + 5):
        w = kc.work(L, k, s)
        assert (w["attended"] == 4 * L * (L + 1) // 2).all()
        assert (w["fwd"] == w["own"]).all() and (w["entries"] == 0).all() and (w["buckets"] == 0).all()
        assert (w["fwd"] >= w["attended"]).all() and (w["kv"] >= w["attended"]).all()
    big = kc.work(131072, 10**6, s)
    assert float(big["fwd"] / big["attended"]) == pytest.approx(1.0, abs=1e-3)


def test_measured_constants_by_hand():
    """The H100 sweep's device times through the model's counts, recomputed by hand: the past kernel
    ran 8 heads x B x sum_c 256 min(15, c) pairs plus the half-tile padding of 127 buckets in 1.553 ms
    (311 TFLOP/s: 0.79 of the published Triton forward's 395); the masked own loops 8 heads x 64^2 x
    64 x 65 / 2 pairs in 0.184 ms; the merge read (2 x 128 + 8) B per entry in what is left of 0.963 ms."""
    peak = 989e12
    past_pairs = 8 * 256 * sum(256 * min(15, c) for c in range(128)) + 256 * 63 / 2 * 127
    tflops = 4 * 128 * past_pairs / 1.5534896666666682e-3
    assert tflops == pytest.approx(311.4e12, rel=1e-3)
    c = kc.measured()
    assert c["past"] == pytest.approx(tflops / peak / (395 / 989), rel=1e-12)
    own_masked = 8 * 64 * 64 * 64 * 65 // 2
    assert c["own"] == pytest.approx(4 * 128 * own_masked / 0.18382366666666802e-3 / 395e12, rel=1e-12)
    own_32k = 8 * 128 * 64 * 64 * 4 * 5 // 2
    left = 0.9630426666666668e-3 - 4 * 128 * own_32k / (395e12 * c["own"])
    entries = 8 * sum(256 * min(15, c) for c in range(128))
    assert c["merge"] == pytest.approx(entries * 264 / left / 3.35e12, rel=1e-9)


def test_gate_by_hand():
    """L = 1000, k = 3, block 64, 4 heads on 1 kv head, D 32: programs of 16 (row, head) pairs; blocks
    c = 3..15 score ceil(c / 16) = 1 step each (12 full blocks of 16 programs, the last of 40 rows: 10);
    each step is the compile report's loop at kw 16 (interpolated to D 32) x 4 warps x 32 lanes."""
    s = kc.Shape(heads=4, kv_heads=1, head_dim=32, block=64)
    g = kc.gate_counts(1000, 3, s)
    loop = 563 + (772 - 563) * (32 - 64) / 64
    assert float(g["lane_instr"]) == pytest.approx((12 * 16 + 10) * loop * 4 * 32, rel=1e-12)
    scored = 4 * (1000 - 3 * 64)
    entries = 4 * sum(min(2, t // 64) for t in range(1000))
    assert float(g["bytes"]) == 1000 * 32 * 2 + 16 * 32 * 4 + scored * 32 * 2 + entries * 6
    assert int(g["launches"]) == 2
    assert int(kc.gate_counts(1000, 16, s)["launches"]) == 0  # dense: no gate


def test_index_by_hand():
    """4096 tokens, k = 4, block 256, 8 heads on 1 kv head: 16 buckets x 1 chunk fit int16 keys (two
    radix passes of 10 B a key and index, read and written, + histogram and iota), the code gather
    16 B an entry, the (bucket, chunk) tables 24 B a row; launches: 2 passes + 6."""
    s = kc.Shape(heads=8, kv_heads=1, head_dim=128, block=256)
    e = 8 * sum(min(3, t // 256) for t in range(4096))
    ix = kc.index_counts(4096, 4, s, "sparse")
    assert float(ix["bytes"]) == e * (2 * 2 * 10 + 10) + e * 16 + 16 * 24
    assert int(ix["launches"]) == 8
    assert float(kc.index_counts(4096, 4, s, "masked")["bytes"]) == 0


def test_backward_by_hand():
    """Backward FLOPs: 8 D per kv pair (S, dP, dV, dK), 6 D per dq pair (S, dP, dQ); launches: prologue,
    own kv, own dQ, cast, and on the sparse path the gathered kv and dQ kernels."""
    s = kc.Shape(heads=4, kv_heads=2, head_dim=64, block=128)
    L, k = 1000, 3
    b = kc.kernel_counts(L, k, s, backward=True, path="sparse")
    past = 4 * kc.past_attended(L, k, 128)
    kv = 4 * kv_own_brute(L, k, 128, 32, 64) + past + 128 * 31 / 2 * 2 * 7
    dq = 4 * own_fwd_brute(L, k, 128, 64, 32) + past + 128 * 63 / 2 * 2 * 7
    assert float(b["flops_kv"]) == 8 * 64 * kv and float(b["flops_dq"]) == 6 * 64 * dq
    assert int(b["launches"]) == 6
    assert int(kc.kernel_counts(L, 100, s, backward=True)["launches"]) == 4
    assert kc.call_fixed(rf.H100) == rf.H100.launch_overhead and kc.call_fixed(rf.H100, backward=True) == 4 * 4e-6


def ideal(hw: rf.Hardware) -> rf.Hardware:
    """Compute-only: infinite bandwidths, no launch cost, published efficiencies 1."""
    return replace(hw, memory_bandwidth=1e30, tp_bandwidth=1e30, launch_overhead=0.0, gemm_efficiency=1.0,
                   attention_fwd_efficiency=1.0, attention_bwd_efficiency=1.0)


M = ModelConfig(name="m", hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32, ffn=512, vocab=1000,
                block_size=64)


def test_dense_time_is_flops_over_peak_times_measured_share_on_ideal_hardware():
    hw = ideal(rf.H100)
    L, c = 1000, kc.measured()
    fwd = 4 * own_fwd_brute(L, 10**6, 64, 64, 32)   # 8 heads / tp 2 = 4 heads per rank
    kv = 4 * kv_own_brute(L, 10**6, 64, 32, 64)
    assert float(rf.attention_time(L, 10**6, M, 2, 64, hw)) == pytest.approx(4 * 32 * fwd / (989e12 * c["own"]),
                                                                             rel=1e-12)
    assert float(rf.attention_time(L, 10**6, M, 2, 64, hw, backward=True)) == pytest.approx(
        (8 * 32 * kv + 6 * 32 * fwd) / (989e12 * c["past"]), rel=1e-12)


def test_sparse_time_on_ideal_hardware_counts_tiles_padding_and_gate():
    """k < n: past = attended past pairs + (bm - 1) / 2 rows x B per non-empty bucket at the past
    kernel's measured share; own tiles at the own loops'; the gate's loop at half the FP32 peak."""
    hw = ideal(rf.H100)
    L, k, B = 1000, 3, 64
    n = -(-L // B)
    c = kc.measured()
    own = 4 * own_fwd_brute(L, k, B, 64, 32)
    past = 4 * B * sum(min(k - 1, t // B) for t in range(L)) + B * 63 / 2 * (n - 1)
    s = rf.attention_shape(M, 2, B)
    gate = float(kc.gate_counts(L, k, s)["lane_instr"]) / (67e12 / 2)
    want = 4 * 32 * past / (989e12 * c["past"]) + 4 * 32 * own / (989e12 * c["own"]) + gate
    assert float(rf.attention_time(L, k, M, 2, B, hw, path="sparse")) == pytest.approx(want, rel=1e-12)


def test_forward_chunks_bound_the_partial_buffer():
    s = kc.Shape(heads=8, kv_heads=1, head_dim=128, block=256)
    chunks, per, k1p = kc.forward_chunks(131072, 32, s)
    assert int(k1p) == 32 and int(per) * 256 * 8 * 32 * 128 * 2 <= kc.PARTIAL_BYTES
    assert int(chunks) == -(-512 // int(per)) and int(chunks) > 1
    assert int(kc.forward_chunks(131072, 600, s)[0]) == 1  # dense: no partials


def test_attention_time_saturates_at_the_block_count_and_grows_below_it():
    """Below n more budget costs more, up to the gate: rows of blocks c <= k - 1 take every past block
    unscored, so a larger budget scores fewer rows (the masked forward, whose tiles do not depend on
    the budget, gets slightly cheaper: under 0.1 % a step)."""
    m = qwen25_3b()
    for L in (8192, 32768):
        n = L // 256
        for hw in (rf.H100, rf.H200, rf.H20):
            for bwd in (False, True):
                for path in ("sparse", "masked"):
                    t = rf.attention_time(L, np.arange(1, n + 8), m, 2, 256, hw, backward=bwd, path=path)
                    d = np.diff(t[:n - 1])                    # below n: more budget, more time
                    if path == "masked" and bwd:
                        assert (d == 0).all()                 # masked backward: the dense tiles alone
                    else:
                        assert (d >= -1e-3 * t[1:n - 1]).all() and t[n - 2] > t[0] or path == "masked"
                    assert (t[n - 1:] == t[n - 1]).all()     # k >= n: the dense path


def test_h100_has_h200_compute_and_less_bandwidth():
    assert rf.H100.peak_flops == rf.H200.peak_flops and rf.H100.memory_bandwidth < rf.H200.memory_bandwidth
    m = qwen25_3b()
    assert float(rf.attention_time(65536, 32, m, 2, 256, rf.H100)) >= float(rf.attention_time(65536, 32, m, 2, 256, rf.H200))
