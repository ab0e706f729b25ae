"""Analytical roofline: MoBA pair counts by brute force, dense-part closed forms, shipped profiles.
(The attention cost model of our kernel is tested in test_kernelcost.py.)"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ModelConfig, qwen25_3b
from sparsebalance.simulator.profile import load_profile
from sparsebalance.simulator.roofline import (
    H20,
    H100,
    H200,
    Hardware,
    attention_time,
    build_table,
    dense_time,
    gate_candidates,
    head_time,
    main,
    moba_pairs,
)


def brute_pairs(L: int, B: int, k: int) -> int:
    """Enumerate (query, key) pairs: own block causally, plus the k-1 most recent earlier blocks
    (which earlier blocks the gate picks does not change the count: earlier blocks are all full)."""
    total = 0
    for q in range(L):
        c = q // B
        chosen = set(range(max(0, c - (k - 1)), c))
        for key in range(q + 1):
            if key // B == c or key // B in chosen:
                total += 1
    return total


@pytest.mark.parametrize("B", [1, 3, 4, 8])
def test_moba_pairs_match_brute_force(B):
    for L in range(1, 41):
        n = math.ceil(L / B)
        for k in range(1, n + 3):
            assert int(moba_pairs(L, B, k)) == brute_pairs(L, B, k), (L, B, k)


def test_moba_pairs_vectorised_and_dense_limit():
    L = np.array([1, 255, 256, 257, 1000, 131072])
    dense = L * (L + 1) // 2
    assert (moba_pairs(L, 256, 10**6) == dense).all()
    assert (moba_pairs(L, 256, np.ceil(L / 256).astype(int)) == dense).all()
    # k = 1: only the own block, causally: full blocks B(B+1)/2 each + the last partial block
    assert int(moba_pairs(1000, 256, 1)) == 3 * 256 * 257 // 2 + 232 * 233 // 2


def test_gate_candidates_brute_force():
    for B in (2, 5):
        for L in range(1, 30):
            assert int(gate_candidates(L, B)) == sum(q // B for q in range(L))


def ideal(hw: Hardware) -> Hardware:
    """Compute-only roofline: infinite memory and TP bandwidth, no launch cost, efficiency 1."""
    return replace(hw, memory_bandwidth=1e30, tp_bandwidth=1e30, launch_overhead=0.0,
                   gemm_efficiency=1.0, attention_fwd_efficiency=1.0, attention_bwd_efficiency=1.0)


M = ModelConfig(name="m", hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32, ffn=512, vocab=1000,
                block_size=64)


def test_dense_and_head_flops_closed_form():
    hw = ideal(H20)
    T, tp = 4096, 2
    P = 256 * 256 + 256 + 2 * (256 * 64 + 64) + 256 * 256 + 3 * 256 * 512 + 2 * 256
    assert float(dense_time(T, M, tp, hw)) == pytest.approx(2 * T * P / tp / 148e12, rel=1e-12)
    assert float(dense_time(T, M, tp, hw, backward=True)) == pytest.approx(4 * T * P / tp / 148e12, rel=1e-12)
    assert float(head_time(T, M, tp, hw)) == pytest.approx(2 * T * 256 * 1000 / tp / 148e12, rel=1e-12)


def test_h20_is_slower_than_h200_when_compute_bound():
    m = qwen25_3b()
    # the dense path is compute-bound (a sparse budget adds memory-bound gate/index/merge phases,
    # which the H20's 4.0 TB/s runs nearly as fast as the H200's 4.8 TB/s)
    assert float(attention_time(65536, 10**6, m, 2, 256, H20)) > 5 * float(attention_time(65536, 10**6, m, 2, 256, H200))
    assert float(dense_time(65536, m, 2, H20)) > 5 * float(dense_time(65536, m, 2, H200))


def test_bad_hardware_parameters():
    with pytest.raises(ConfigError, match="gemm_efficiency: must be <= 1"):
        replace(H200, gemm_efficiency=1.5)
    with pytest.raises(ConfigError, match="peak_flops: must be > 0"):
        replace(H200, peak_flops=0)


@pytest.mark.parametrize("name, hw", [("analytical-h100", H100), ("analytical-h200", H200), ("analytical-h20", H20)])
def test_shipped_profiles_are_labelled_and_current(tmp_path, name, hw):
    shipped = load_profile(name)
    meta = shipped.meta
    assert meta["analytical"] is True and meta["how"].startswith("analytical roofline")
    assert meta["device"] == hw.device and meta["block_size"] == 256 and meta["tp"] == 2
    assert meta["model"]["hidden"] == 2048 and meta["roofline"]["peak_flops"] == hw.peak_flops
    assert meta["command"] == "python -m sparsebalance.simulator.roofline --out sparsebalance/data/profiles"
    main(["--out", str(tmp_path)])
    fresh = load_profile(tmp_path / name)
    k = shipped.rows("attn_fwd")
    for L, b, t in k[["seq_len", "budget", "latency_s"]].sample(40, random_state=0).itertuples(index=False):
        n = -(-int(L) // 256)
        want = min(float(attention_time(L, b, meta_model(meta), 2, 256, hw)),
                   float(attention_time(L, n, meta_model(meta), 2, 256, hw)))
        assert t == pytest.approx(want, rel=1e-12)
    pd.testing.assert_frame_equal(fresh.table, shipped.table, rtol=1e-12)
    sl = sorted(shipped.rows("attn_fwd")["seq_len"].unique())
    assert sl[0] <= 512 and sl[-1] == 131072
    assert max(shipped.rows("attn_fwd")["budget"].unique()) == 128
    tok = shipped.rows("layer_fwd")["seq_len"]
    assert tok.min() <= 256 and tok.max() == 262144


def meta_model(meta: dict) -> ModelConfig:
    return qwen25_3b()


def test_build_table_is_rectilinear_and_complete():
    t = build_table(H200, M, 1, 64, seq_lens=np.array([64, 128]), budgets=np.array([1, 2, 3]),
                    tokens=np.array([32, 64]))
    assert len(t[t.op == "attn_fwd"]) == 6 and len(t[t.op == "head_bwd"]) == 2
    assert (t.latency_s > 0).all()


@pytest.mark.parametrize("name", ["analytical-h100", "analytical-h200", "analytical-h20"])
def test_shipped_tables_are_monotone(name):
    """DST's budget search assumes latency is non-decreasing in budget (and in length). The tables
    clip each budget at the dense path's cost (our kernel can be slower just below the block count:
    docs/costmodel.md, "Budget and the dense path"); budgets at or beyond the block count are dense."""
    prof = load_profile(name)
    for op in ("attn_fwd", "attn_bwd"):
        pv = prof.rows(op).pivot(index="seq_len", columns="budget", values="latency_s")
        grid = pv.to_numpy()
        assert (np.diff(grid, axis=0) >= 0).all() and (np.diff(grid, axis=1) >= 0).all()
        for L, row in zip(pv.index, grid):
            dense = row[pv.columns >= -(-int(L) // 256)]
            assert (dense == row.max()).all(), (op, L)
    for op in ("layer_fwd", "layer_bwd", "embed_fwd", "embed_bwd", "head_fwd", "head_bwd"):
        assert (np.diff(prof.rows(op)["latency_s"].to_numpy()) >= 0).all(), op
