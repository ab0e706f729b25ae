"""Analytical roofline: MoBA pair counts by brute force, dense-part closed forms, shipped profiles.
(The attention cost model of our kernel is tested in test_kernelcost.py.)"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ModelConfig, qwen25_3b
from sparsebalance.simulator.cost import kernelcost as kc
from sparsebalance.simulator.cost.catalog import load_profile
from sparsebalance.simulator.cost.profile import monotone_violations
from sparsebalance.simulator.cost.profilemeta import ProfileMeta
from sparsebalance.simulator.cost.roofline import (
    H20,
    H100,
    H200,
    Hardware,
    attention_shape,
    attention_time,
    build_table,
    dense_split_time,
    dense_time,
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
    # the dense layer's GEMMs (the elementwise kernels after them stream at HBM speed, which the two
    # GPUs nearly share, so they are taken out here)
    fast = {"memory_bandwidth": 1e30, "tp_bandwidth": 1e30}
    assert float(dense_time(65536, m, 2, replace(H20, **fast))) > 5 * float(dense_time(65536, m, 2, replace(H200, **fast)))


def test_bad_hardware_parameters():
    with pytest.raises(ConfigError, match="gemm_efficiency: must be <= 1"):
        replace(H200, gemm_efficiency=1.5)
    with pytest.raises(ConfigError, match="peak_flops: must be > 0"):
        replace(H200, peak_flops=0)


@pytest.mark.parametrize("name, hw", [("analytical-h100", H100), ("analytical-h200", H200), ("analytical-h20", H20)])
def test_shipped_profiles_are_labelled_and_current(tmp_path, name, hw):
    shipped = load_profile(name)
    meta = shipped.meta
    assert meta.analytical is True and meta.how.startswith("analytical roofline")
    assert meta.device == hw.device and meta.block_size == 256 and meta.tp == 2
    assert meta.model["hidden"] == 2048 and meta.roofline["peak_flops"] == hw.peak_flops
    assert meta.command == "python -m sparsebalance.simulator.cost.roofline --out sparsebalance/data/profiles"
    main(["--out", str(tmp_path)])
    fresh = load_profile(tmp_path / name)
    shape = attention_shape(meta_model(meta), 2, 256)
    for op, bwd in (("attn_fwd", False), ("attn_bwd", True)):
        rows = shipped.rows(op)[["seq_len", "budget", "latency_s"]].sample(40, random_state=0)
        for L, b, t in rows.itertuples(index=False):
            path = kc.PATHS[int(kc.choose_path(L, b, shape, hw))]  # the dispatcher's rule
            want = float(attention_time(L, b, meta_model(meta), 2, 256, hw, backward=bwd, path=path))
            call = kc.call_fixed(hw, backward=bwd)  # the rows leave out a call's fixed part: the sidecar has it
            assert meta.attention_call_s["bwd" if bwd else "fwd"] == call
            assert t == pytest.approx(want - call, rel=1e-12)
    pd.testing.assert_frame_equal(fresh.table, shipped.table, rtol=1e-12)
    sl = sorted(shipped.rows("attn_fwd")["seq_len"].unique())
    assert sl[0] <= 512 and sl[-1] == 524288
    assert max(shipped.rows("attn_fwd")["budget"].unique()) == 2048
    tok = shipped.rows("layer_fwd")["seq_len"]
    assert tok.min() <= 256 and tok.max() == 1048576


def meta_model(meta: ProfileMeta) -> ModelConfig:
    return qwen25_3b()


def test_build_table_is_rectilinear_and_complete():
    t = build_table(H200, M, 1, 64, seq_lens=np.array([64, 128]), budgets=np.array([1, 2, 3]),
                    tokens=np.array([32, 64]))
    assert len(t[t.op == "attn_fwd"]) == 6 and len(t[t.op == "head_bwd"]) == 2
    assert (t.latency_s > 0).all()


@pytest.mark.parametrize("name", ["analytical-h100", "analytical-h200", "analytical-h20"])
def test_shipped_tables_follow_the_dispatcher(name):
    """The tables price the path the kernel runs, so forward + backward (what the dispatcher
    minimises) is non-decreasing in length and, below the block count, in the budget (a minimum of
    two increasing costs) up to the gate, whose rows of blocks c <= k - 1 need no scores (a larger
    budget scores fewer rows: under 1 % a step); budgets at or beyond the block count are one dense
    cost. The step onto the full budget may fall (the masked path pays the gate, dense does not): the
    sidecar says so."""
    prof = load_profile(name)
    fb = sum(prof.rows(op).pivot(index="seq_len", columns="budget", values="latency_s") for op in ("attn_fwd", "attn_bwd"))
    grid = fb.to_numpy()
    assert (np.diff(grid, axis=0) >= -1e-15).all()
    for L, row in zip(fb.index, grid):
        below = fb.columns < -(-int(L) // 256)
        assert (np.diff(row[below]) >= -0.01 * row[below][1:]).all(), L
        assert (row[~below] == row[~below].max(initial=0)).all(), L
    assert bool(prof.meta.nonmonotone) == bool(monotone_violations(prof, 256))
    for op in ("layer_fwd", "layer_bwd", "embed_fwd", "embed_bwd", "head_fwd", "head_bwd"):
        assert (np.diff(prof.rows(op)["latency_s"].to_numpy()) >= 0).all(), op


def test_build_table_prices_the_path_the_rule_picks():
    """Each attention row is the cost of the one path ``kernelcost.choose_path`` picks for it (not a
    minimum over paths): at a masked point that is more than the full budget's dense cost."""
    m = qwen25_3b()
    seq, ks = np.array([768, 4096, 8448, 32768]), np.array([1, 2, 4, 14, 15, 16, 31, 32, 40, 127, 128])
    t = build_table(H200, m, 2, 256, seq_lens=seq, budgets=ks, tokens=np.array([1024, 2048]))
    shape = attention_shape(m, 2, 256)
    seen = set()
    for op, bwd in (("attn_fwd", False), ("attn_bwd", True)):
        for L, k, lat in t[t.op == op][["seq_len", "budget", "latency_s"]].itertuples(index=False):
            path = int(kc.choose_path(L, k, shape, H200))
            seen.add(kc.PATHS[path])
            assert lat == float(attention_time(L, k, m, 2, 256, H200, backward=bwd, path=kc.PATHS[path]))
            other = {kc.SPARSE: "masked", kc.MASKED: "sparse"}.get(path)
            if other and not bwd:  # the rule compares forward + backward
                fb = lambda p, L=L, k=k: float(attention_time(L, k, m, 2, 256, H200, path=p)
                                               + attention_time(L, k, m, 2, 256, H200, backward=True, path=p))
                assert fb(kc.PATHS[path]) <= fb(other)
    assert seen == set(kc.PATHS)  # the grid exercises every path
    fb = t[t.op.isin(["attn_fwd", "attn_bwd"])].groupby(["seq_len", "budget"])["latency_s"].sum()
    assert int(kc.choose_path(4096, 15, shape, H200)) == kc.MASKED and fb[(4096, 15)] > fb[(4096, 16)]


def test_dense_layer_is_gemms_then_elementwise_by_hand():
    """The GEMMs at their roofline, then the elementwise kernels (2 norms, 2 residual adds, the MLP
    activation) streamed after them; sequence parallelism splits the norms' and residuals' traffic."""
    hw = replace(H100, launch_overhead=0.0)
    T, tp, h, f = 4096, 2, 256, 512
    P = 256 * 256 + 256 + 2 * (256 * 64 + 64) + 256 * 256 + 3 * 256 * 512 + 2 * 256
    bw = hw.memory_bandwidth * hw.memory_efficiency
    gemm_bytes = 2 * (P / tp + T * (4 * h + (4 + 2 * 1) * 64 / tp + 4 * 64 / tp + 2 * f / tp + f / tp))
    gemm = max(2 * T * P / tp / (hw.peak_flops * hw.gemm_efficiency), gemm_bytes / bw)
    ar = 2 * 2 * (tp - 1) / tp * T * h * 2 / hw.tp_bandwidth  # the layer's two TP all-reduces
    # SP's backward all-gathers the two column-parallel linears' inputs again: (tp - 1) / tp each
    for sp, hn, regather in ((False, h, 0.0), (True, h / tp, 2 * (tp - 1) / tp * T * h * 2 / hw.tp_bandwidth)):
        elementwise = 2 * T * (10 * hn + 3 * f / tp) / bw  # SwiGLU: read gate and up, write the product
        want = gemm + elementwise + ar
        assert float(dense_time(T, M, tp, hw, sp=sp)) == pytest.approx(want, rel=1e-12)
        assert float(dense_time(T, M, tp, hw, backward=True, sp=sp)) == pytest.approx(
            2 * gemm + 2 * elementwise + ar + regather, rel=1e-12)
        parts = [float(dense_split_time(T, M, tp, hw, part, sp=sp)) for part in ("input", "weight")]
        assert sum(parts) == pytest.approx(float(dense_time(T, M, tp, hw, backward=True, sp=sp)), rel=1e-9)
    assert float(dense_time(T, M, 1, hw, backward=True, sp=True)) == pytest.approx(
        float(dense_time(T, M, 1, hw, backward=True)), rel=1e-12)  # no TP: nothing to gather


def test_head_is_gemm_then_the_losss_fp32_passes_by_hand():
    """The LM head's GEMM at its roofline, then the cross-entropy's passes over the fp32 logits
    (forward 3, backward 2) streamed after it: they wait for the GEMM's output, so they add, even
    where they alone would take longer than the GEMM."""
    hw = replace(H100, launch_overhead=0.0)
    bw = hw.memory_bandwidth * hw.memory_efficiency
    T, tp, V, h = 4096, 2, 1000, 256
    gemm = max(2 * T * h * V / tp / (hw.peak_flops * hw.gemm_efficiency), h * V / tp * 2 / bw)
    logits = T * V / tp * 4 / bw  # one pass over this rank's fp32 logits
    assert logits > gemm  # the case a max() would hide
    assert float(head_time(T, M, tp, hw)) == pytest.approx(gemm + 3 * logits, rel=1e-12)
    gemm_b = max(2 * 2 * T * h * V / tp / (hw.peak_flops * hw.gemm_efficiency), 2 * h * V / tp * 2 / bw)
    assert float(head_time(T, M, tp, hw, backward=True)) == pytest.approx(gemm_b + 2 * logits, rel=1e-12)


def test_unfused_attention_by_hand():
    """Megatron's pre-FlashAttention core: two batched GEMMs over the full L x L square, the scores
    streamed 13 bytes per element forward (19 backward), whatever the budget."""
    from sparsebalance.simulator.cost.roofline import A100_80GB

    hw = replace(A100_80GB, launch_overhead=1e-6)
    m = replace(M, attention_kernel="unfused")
    L, tp = 2048, 2
    heads = math.ceil(m.heads / tp)
    bw = hw.memory_bandwidth * hw.memory_efficiency
    # one share of peak at every size (the curve's lookup is tested in test_gemm_and_busbw_curves...)
    hw = replace(hw, gemm_curve=((1.0, 0.61),))
    for backward, mult, score_bytes, kernels in ((False, 1, 13, 4), (True, 2, 19, 6)):
        gemm = max(mult * 4 * L * L * m.head_dim * heads / (hw.peak_flops * 0.61),
                   mult * 4 * L * heads * m.head_dim * 2 / bw)
        want = gemm + score_bytes * L * L * heads / bw + kernels * 1e-6
        for k in (1, 4, 10**6):  # the budget is ignored: dense
            assert float(attention_time(L, k, m, tp, 64, hw, backward=backward)) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ConfigError, match="attention_kernel: 'flash' is not allowed; choose one of moba, unfused"):
        replace(M, attention_kernel="flash")


def test_gemm_and_busbw_curves_interpolate_the_measured_tables():
    """A100's GEMM and NCCL curves are Azure ND A100 v4's tables: at a measured size the value is the
    table's, between two sizes the mean in log size, beyond the ends the end value; JSON lists
    become tuples (hashable), a bad curve is one line naming the field."""
    from sparsebalance.simulator.cost.roofline import A100_80GB

    hw = A100_80GB
    assert float(hw.gemm_share(2 * 8192**3)) == pytest.approx(253.7 / 312)
    assert float(hw.gemm_share(2 * 4096**3)) == pytest.approx(228.0 / 312)
    mid = math.sqrt(2 * 4096**3 * 2 * 8192**3)  # halfway in log FLOPs
    assert float(hw.gemm_share(mid)) == pytest.approx((228.0 + 253.7) / 2 / 312)
    assert float(hw.gemm_share(1e3)) == pytest.approx(119.4 / 312) and float(hw.gemm_share(1e16)) == pytest.approx(256.5 / 312)
    assert float(hw.busbw(2**26)) == pytest.approx(166.63e9) and float(hw.busbw(2**27)) == pytest.approx(174.18e9)
    assert float(hw.busbw(2**26 * math.sqrt(2))) == pytest.approx((166.63e9 + 174.18e9) / 2)
    assert float(hw.busbw(2**40)) == pytest.approx(231.58e9)
    assert float(H100.busbw(1e6)) == H100.tp_bandwidth and float(H100.gemm_share(1e6)) == H100.gemm_efficiency
    again = Hardware(**{**asdict(hw), "gemm_curve": [list(p) for p in hw.gemm_curve]})  # as a sidecar gives it
    assert again == hw and hash(again) == hash(hw)
    with pytest.raises(ConfigError, match="gemm_curve: sizes must ascend"):
        replace(hw, gemm_curve=((2.0, 0.5), (1.0, 0.6)))
    with pytest.raises(ConfigError, match="gemm_curve: sizes and values must be > 0 and shares <= 1"):
        replace(hw, gemm_curve=((1.0, 1.5),))
    with pytest.raises(ConfigError, match="tp_busbw_curve: must be a list of"):
        replace(hw, tp_busbw_curve=(1.0, 2.0))


def test_layer_gemms_each_at_their_size_and_collectives_at_theirs():
    """By hand on A100: each projection's time is its FLOPs at the curve's share for its call; the
    layer's TP all-reduce is 2 (tp-1)/tp x bytes at the bus bandwidth of a message that size."""
    from sparsebalance.simulator.cost.roofline import A100_80GB, gemm_calls

    hw = replace(A100_80GB, launch_overhead=0.0, memory_bandwidth=1e30)  # GEMMs and collectives only
    m = ModelConfig(hidden=6144, layers=2, heads=64, kv_heads=64, head_dim=96, ffn=4 * 6144, vocab=51200,
                    mlp="gelu", bias=True, norm="layernorm", positions="learned", max_positions=2048)
    T, tp = 8192, 8
    calls = {"qkv": 2 * T * 6144 * 3 * 768, "o": 2 * T * 768 * 6144, "up": 2 * T * 6144 * 3072,
             "down": 2 * T * 3072 * 6144}
    assert {k: float(v) for k, v in gemm_calls(T, m, tp).items()} == pytest.approx(calls)
    gemm = sum(f / (312e12 * float(hw.gemm_share(f))) for f in calls.values())
    nbytes = T * 6144 * 2
    ar = 2 * 7 / 8 * nbytes / float(hw.busbw(nbytes))
    assert 166e9 < float(hw.busbw(nbytes)) < 175e9  # 100 MB: well below the 230 GB/s plateau
    extra = 2 * T * (m.params_per_layer - sum(calls.values()) / (2 * T) * tp) / tp  # biases, norms
    share = sum(calls.values()) / sum(f / float(hw.gemm_share(f)) for f in calls.values())
    want = gemm + extra / (312e12 * share) + 2 * ar
    assert float(dense_time(T, m, tp, hw)) == pytest.approx(want, rel=1e-12)


def test_tp_overlap_hides_collectives_under_the_column_parallel_gemms():
    """Megatron's async TP collectives, by hand: without SP each column-parallel linear's input-gradient
    all-reduce runs beside its weight-gradient GEMM (exposed: max(0, AR - GEMM) for QKV and MLP up);
    with SP the row-parallel all-gathers block (one all-reduce's bytes) and each column-parallel
    linear's reduce-scatter and re-gather (half an all-reduce each) hide under its two GEMMs. Without
    overlap: 2 all-reduces' bytes, 3 with SP. A split backward keeps them all exposed."""
    from sparsebalance.simulator.cost.roofline import gemm_calls, tp_backward_comm

    T, tp = 4096, 2
    for bw in (1e9, 1e15):  # slow: nothing hides; fast: everything does
        hw = replace(H100, launch_overhead=0.0, tp_bandwidth=bw)
        one = 2 * (tp - 1) / tp * T * M.hidden * 2 / bw
        g = {k: float(v) / (hw.peak_flops * hw.gemm_efficiency) for k, v in gemm_calls(T, M, tp).items()}
        assert float(tp_backward_comm(T, M, tp, hw)) == pytest.approx(2 * one, rel=1e-12)
        assert float(tp_backward_comm(T, M, tp, hw, sp=True)) == pytest.approx(3 * one, rel=1e-12)
        want = max(0, one - g["qkv"]) + max(0, one - g["up"])
        assert float(tp_backward_comm(T, M, tp, hw, overlap=True)) == pytest.approx(want, rel=1e-12, abs=1e-15)
        want_sp = one + 2 * max(0, one / 2 - g["qkv"]) + 2 * max(0, one / 2 - g["up"])
        assert float(tp_backward_comm(T, M, tp, hw, sp=True, overlap=True)) == pytest.approx(want_sp, rel=1e-12)
        whole = float(dense_time(T, M, tp, hw, backward=True, overlap=True))
        split = sum(float(dense_split_time(T, M, tp, hw, part)) for part in ("input", "weight"))
        assert split - whole == pytest.approx(2 * one - want, rel=1e-9)
    assert float(tp_backward_comm(T, M, 1, H100, sp=True, overlap=True)) == 0.0


def test_tp_overlap_reaches_the_profile_and_a_measured_profile_refuses_it():
    from sparsebalance.simulator.config import ClusterConfig
    from sparsebalance.simulator.cost.latency import load_latency_model

    m = ModelConfig(hidden=2304, layers=4, heads=24, kv_heads=24, head_dim=96, ffn=9216, vocab=51200,
                    mlp="gelu", bias=True, norm="layernorm", positions="learned", max_positions=2048, block_size=128)
    on = load_latency_model("analytical-a100-80gb", m, ClusterConfig(tp=4, device="a100-80gb", tp_overlap=True))
    off = load_latency_model("analytical-a100-80gb", m, ClusterConfig(tp=4, device="a100-80gb"))
    assert on.profile.meta.tp_overlap is True and off.profile.meta.tp_overlap is None
    assert on.dense(8192, backward=True) < off.dense(8192, backward=True)
    assert on.dense(8192) == off.dense(8192)  # the forward's all-reduces block either way
    # re-derived from a shipped analytical sidecar for the run's model, the flag follows the run
    q = load_latency_model("analytical-h100", qwen25_3b(), ClusterConfig(tp=2, tp_overlap=True))
    assert q.profile.meta.tp_overlap is True
    with pytest.raises(ConfigError, match="tp_overlap: must be true or false"):
        ClusterConfig(tp=2, tp_overlap="yes")
    with pytest.raises(ConfigError, match="cluster.tp_overlap: priced by analytical profiles only"):
        load_latency_model("cpu-tiny", qwen25_3b(), ClusterConfig(tp=2, tp_overlap=True))


def test_tp_overlap_with_a_measured_profile_is_refused_before_the_probe(run_cli, tmp_path):
    """One line, exit 2, and no calibration probe run first (it would spend seconds for nothing)."""
    example = Path(__file__).resolve().parents[3] / "examples" / "cpu_pp2_tp2.toml"
    r = run_cli("simulate", "--config", example, "--out", tmp_path / "o",
                "--set", "cluster.tp_overlap=true", "--iterations", 1, "--no-progress")
    assert r.code == 2 and "cluster.tp_overlap: priced by analytical profiles only" in r.err
    assert "calibration: probed" not in r.out + r.err and "Traceback" not in r.err


def test_eager_elementwise_bytes_by_hand():
    """An MPT-1B-like layer (h 2,048, 16 heads, 4h GELU MLP, LayerNorm, biases, bf16, no TP), per
    token, in elements: fused forward 10 h + 2 f = 36,864 and backward twice that; eager backward
    16 h (two kernels per norm, the residual accumulations) + 3 f (GELU's backward reads its input)
    + 3 h + 2 h + f (the four biases' reductions) + 2 x 3 h (the QKV split's backward) = 88,064 with
    9 more kernels; eager-unpad adds 2 x 3 h + 3 h forward (55,296, 5 kernels) and 2 h + 3 x 3 h
    backward (110,592, 16 kernels). The layer's time moves by exactly those bytes at the streaming
    bandwidth and those launches."""
    from sparsebalance.simulator.cost.roofline import H100, dense_time, elementwise

    mpt = ModelConfig(name="mpt-1b-like", hidden=2048, layers=24, heads=16, kv_heads=16, head_dim=128,
                      ffn=8192, vocab=50368, mlp="gelu", qkv_bias=True, bias=True, norm="layernorm",
                      positions="learned", max_positions=2048)
    want = {("fused", False): (36_864, 0), ("fused", True): (73_728, 0), ("eager", False): (36_864, 0),
            ("eager", True): (88_064, 9), ("eager-unpad", False): (55_296, 5), ("eager-unpad", True): (110_592, 16)}
    for (ops, bw), (elems, kernels) in want.items():
        got, extra = elementwise(1000, replace(mpt, layer_ops=ops), 1, backward=bw)
        assert float(got) == 1000 * elems * 2 and extra == kernels, (ops, bw)
    stream = H100.memory_bandwidth * H100.memory_efficiency
    for bw in (False, True):
        base = dense_time(4096, mpt, 1, H100, backward=bw)
        for ops in ("eager", "eager-unpad"):
            (elems, kernels), (e0, _) = want[(ops, bw)], want[("fused", bw)]
            t = dense_time(4096, replace(mpt, layer_ops=ops), 1, H100, backward=bw)
            assert t - base == pytest.approx(4096 * (elems - e0) * 2 / stream + kernels * H100.launch_overhead, rel=1e-9)
    with pytest.raises(ConfigError, match="^layer_ops: 'compiled' is not allowed; choose one of fused, eager, eager-unpad$"):
        replace(mpt, layer_ops="compiled")
