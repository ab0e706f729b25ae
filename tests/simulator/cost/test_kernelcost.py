"""Cost model of the shipped MoBA kernel against brute-force enumerations of the kernel's loops.

The own-block and dense loops are emulated tile by tile (exactly as ``triton_impl.py`` iterates);
the gathered rows are summed row by row. Counts from real index tables (which need torch) are
compared in ``tests/kernels/test_kernelcost_counts.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.simulator.config import ModelConfig, qwen25_3b
from sparsebalance.simulator.cost import kernelcost as kc
from sparsebalance.simulator.cost import roofline as rf


def own_fwd_brute(L: int, k: int, B: int, bm: int, bn: int) -> int:
    """Pairs of _fwd_own_merge_kernel per head: tiles of bm rows (aligned to blocks), key tiles of bn
    from the first key (block start, or 0 when dense) up to the tile's last row."""
    n = -(-L // B)
    total = 0
    for b0 in range(0, L, B):
        for t in range(b0, min(L, b0 + B), bm):
            first = 0 if k >= n else b0
            total += bm * bn * len(range(first, t + bm, bn))
    return total


def own_bwd_brute(L: int, k: int, B: int, bm: int, bn: int) -> int:
    """Pairs of _bwd_own_kernel per query head: per key sub-tile, row tiles from the one holding its
    first key to the row end (block end, or sequence end when dense)."""
    n = -(-L // B)
    total = 0
    for b0 in range(0, L, B):
        blen = min(B, L - b0)
        rend = L if k >= n else b0 + blen
        for sub in range(0, blen, bn):
            first = (sub // bm) * bm
            total += bm * bn * len(range(first, rend - b0, bm))
    return total


@pytest.mark.parametrize("B", [16, 64, 128])
def test_own_pairs_match_the_kernel_loops(B):
    bm = min(kc.TILE_M, B)
    for L in (1, 15, 16, 17, 100, 257, 640, 1000):
        for k in (1, 2, 3, 100):
            want = own_fwd_brute(L, k, B, bm, bm)
            assert int(kc.own_pairs(L, k, B)) == want, (L, k, B)
            assert own_bwd_brute(L, k, B, bm, bm) == want, (L, k, B)  # forward and backward execute alike


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
        # executed / attended -> 1: the diagonal tiles waste bm (bm - 1) / 2 pairs per row tile
        assert (w["fwd"] >= w["attended"]).all()
    big = kc.work(131072, 10**6, s)
    assert float(big["fwd"] / big["attended"]) == pytest.approx(1.0, abs=1e-3)


def ideal(hw: rf.Hardware) -> rf.Hardware:
    """Compute-only: infinite bandwidths, no launch cost, efficiencies 1."""
    from dataclasses import replace

    return replace(hw, memory_bandwidth=1e30, tp_bandwidth=1e30, launch_overhead=0.0, gemm_efficiency=1.0,
                   attention_fwd_efficiency=1.0, attention_bwd_efficiency=1.0)


M = ModelConfig(name="m", hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32, ffn=512, vocab=1000,
                block_size=64)


def test_dense_time_is_flops_over_peak_on_ideal_hardware():
    hw = ideal(rf.H100)
    L = 1000
    dense_pairs = 4 * own_fwd_brute(L, 10**6, 64, 64, 64)  # 8 heads / tp 2 = 4 heads per rank
    assert float(rf.attention_time(L, 10**6, M, 2, 64, hw)) == pytest.approx(4 * 32 * dense_pairs / 989e12, rel=1e-12)
    assert float(rf.attention_time(L, 10**6, M, 2, 64, hw, backward=True)) == pytest.approx(
        10 * 32 * dense_pairs / 989e12, rel=1e-12)


def test_sparse_time_on_ideal_hardware_counts_tiles_padding_and_gate():
    """k < n: executed = own tiles + attended past pairs + (bm - 1) / 2 rows x B per non-empty bucket;
    plus the gate's score GEMM against each row chunk's past blocks."""
    hw = ideal(rf.H100)
    L, k, B = 1000, 3, 64
    n = -(-L // B)
    heads, kvh = 4, 1
    own = heads * own_fwd_brute(L, k, B, 64, 64)
    past = heads * B * sum(min(k - 1, t // B) for t in range(L))
    pad = B * 63 / 2 * kvh * (n - 1)
    gate = 2 * 32 * heads * (L - B) * ((L - 1) // B)  # one row chunk: every row scores the chunk's past blocks
    want = (4 * 32 * (own + past + pad) + gate) / 989e12
    assert float(rf.attention_time(L, k, M, 2, B, hw)) == pytest.approx(want, rel=1e-12)


def test_forward_chunks_bound_the_partial_buffer():
    s = kc.Shape(heads=8, kv_heads=1, head_dim=128, block=256)
    chunks, per, k1p = kc.forward_chunks(131072, 32, s)
    assert int(k1p) == 32 and int(per) * 256 * 8 * 32 * 128 * 2 <= kc.PARTIAL_BYTES
    assert int(chunks) == -(-512 // int(per)) and int(chunks) > 1
    assert int(kc.forward_chunks(131072, 600, s)[0]) == 1  # dense: no partials


def test_attention_time_saturates_at_the_block_count_and_grows_below_it():
    m = qwen25_3b()
    for L in (8192, 32768):
        n = L // 256
        for hw in (rf.H100, rf.H200, rf.H20):
            for bwd in (False, True):
                for path in ("sparse", "masked"):
                    t = rf.attention_time(L, np.arange(1, n + 8), m, 2, 256, hw, backward=bwd, path=path)
                    d = np.diff(t[:n - 1])                    # below n: more budget, more time
                    assert (d > 0).all() if path == "sparse" or not bwd else (d == 0).all()  # masked bwd: dense tiles
                    assert (t[n - 1:] == t[n - 1]).all()     # k >= n: the dense path


def test_h100_has_h200_compute_and_less_bandwidth():
    assert rf.H100.peak_flops == rf.H200.peak_flops and rf.H100.memory_bandwidth < rf.H200.memory_bandwidth
    m = qwen25_3b()
    assert float(rf.attention_time(65536, 32, m, 2, 256, rf.H100)) >= float(rf.attention_time(65536, 32, m, 2, 256, rf.H200))
