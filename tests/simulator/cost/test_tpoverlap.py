"""Transformer Engine's TP comm-GEMM overlap (simulator/cost/tpoverlap.py): each method's exposed
time against a brute-force timeline of its chunks, a layer by hand, and the run's field end to end."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ClusterConfig, ModelConfig, qwen25_3b
from sparsebalance.simulator.cost.roofline import H100, dense_time, gemm_calls, tp_backward_comm
from sparsebalance.simulator.cost.tpoverlap import (
    TE_PIPELINE_SPLITS,
    bulk_exposed,
    pipeline_exposed,
    ring_exchange_exposed,
    te_layer_comm,
)


def _ring_timeline(comm: float, gemm: float, tp: int) -> float:
    """Seconds past the GEMM alone: step i computes chunk i (own chunk first) while the next chunk
    travels; chunk i + 1's GEMM starts when both are done."""
    t, arrived = 0.0, 0.0
    for i in range(tp):
        start = max(t, arrived)
        send_end = start + comm / (tp - 1) if i < tp - 1 else start
        t = start + gemm / tp
        arrived = send_end
    return t - gemm


def _pipeline_timeline(comm: float, gemm: float, n: int) -> float:
    """GEMM chunks back to back; chunk i's reduce-scatter starts when its GEMM ends and the previous
    reduce-scatter is done (one communication stream)."""
    gemm_end, comm_end = 0.0, 0.0
    for _ in range(n):
        gemm_end += gemm / n
        comm_end = max(comm_end, gemm_end) + comm / n
    return max(gemm_end, comm_end) - gemm


@pytest.mark.parametrize("seed", range(5))
def test_methods_equal_their_chunk_timelines(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        comm, gemm = rng.uniform(0.01, 3.0, size=2)
        tp = int(rng.choice([2, 4, 8]))
        assert float(ring_exchange_exposed(comm, gemm, tp)) == pytest.approx(_ring_timeline(comm, gemm, tp), abs=1e-12)
        assert float(pipeline_exposed(comm, gemm)) == pytest.approx(
            _pipeline_timeline(comm, gemm, TE_PIPELINE_SPLITS), abs=1e-12)
        assert float(bulk_exposed(comm, gemm)) == pytest.approx(max(0.0, comm - gemm), abs=1e-15)


def test_methods_by_hand():
    assert float(ring_exchange_exposed(3.0, 4.0, 4)) == 0.0  # 3/4 of a 4 s GEMM covers 3 s
    assert float(ring_exchange_exposed(5.0, 4.0, 4)) == pytest.approx(2.0)
    assert float(pipeline_exposed(4.0, 8.0)) == pytest.approx(1.0)  # only the last quarter shows
    assert float(pipeline_exposed(12.0, 8.0)) == pytest.approx(6.0)  # 12 - 3/4 x 8


M = ModelConfig(name="m", hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32, ffn=512, vocab=1000,
                block_size=64)


@pytest.mark.parametrize("bw", [1e8, 1e11, 1e15])
def test_te_layer_by_hand(bw):
    """A sequence-parallel layer under TE: forward = ring exchange before QKV and up + pipelined
    reduce-scatter after O and down; backward = ring exchange before O's and down's input gradients
    + QKV's and up's re-gather and reduce-scatter in bulk. Never more exposed than Megatron's."""
    hw = replace(H100, launch_overhead=0.0, tp_bandwidth=bw)
    T, tp = 4096, 4
    half = (tp - 1) / tp * T * M.hidden * 2 / bw  # an all-gather or a reduce-scatter
    g = {k: float(v) / (hw.peak_flops * hw.gemm_efficiency) for k, v in gemm_calls(T, M, tp).items()}
    fwd = (max(0, half - 3 / 4 * g["qkv"]) + max(0, half - 3 / 4 * g["up"])
           + max(half / 4, half - 3 / 4 * g["o"]) + max(half / 4, half - 3 / 4 * g["down"]))
    bwd = (max(0, half - 3 / 4 * g["o"]) + max(0, half - 3 / 4 * g["down"])
           + 2 * max(0, half - g["qkv"]) + 2 * max(0, half - g["up"]))
    assert float(te_layer_comm(half, g, tp, backward=False)) == pytest.approx(fwd, rel=1e-12, abs=1e-18)
    assert float(tp_backward_comm(T, M, tp, hw, sp=True, overlap=True, impl="te")) == pytest.approx(bwd, rel=1e-12,
                                                                                                    abs=1e-18)
    megatron_f = dense_time(T, M, tp, hw, sp=True, overlap=True)
    te_f = dense_time(T, M, tp, hw, sp=True, overlap=True, impl="te")
    assert float(megatron_f - te_f) == pytest.approx(4 * half - fwd, rel=1e-9, abs=1e-15)
    assert float(tp_backward_comm(T, M, tp, hw, sp=True, overlap=True, impl="te")) <= float(
        tp_backward_comm(T, M, tp, hw, sp=True, overlap=True)) + 1e-18


def test_the_run_field_reaches_the_profile_and_bad_ones_are_one_line():
    from sparsebalance.simulator.cost.latency import load_latency_model

    base = {"tp": 2, "tp_overlap": True, "sequence_parallel": True, "device": "h100"}
    te = load_latency_model("analytical-h100", qwen25_3b(), ClusterConfig(**base, tp_overlap_impl="te"))
    mg = load_latency_model("analytical-h100", qwen25_3b(), ClusterConfig(**base))
    assert te.profile.meta.tp_overlap_impl == "te" and mg.profile.meta.tp_overlap_impl is None
    assert te.dense(8192) < mg.dense(8192)  # the forward's collectives now hide
    assert te.dense(8192, backward=True) <= mg.dense(8192, backward=True)
    with pytest.raises(ConfigError, match="tp_overlap_impl: 'te'.*sequence_parallel = true"):
        ClusterConfig(tp=2, tp_overlap=True, tp_overlap_impl="te")
    with pytest.raises(ConfigError, match="tp_overlap_impl: 'nccl' is not allowed; choose one of megatron, te"):
        ClusterConfig(tp=2, tp_overlap_impl="nccl")
    assert ClusterConfig(tp=1, tp_overlap_impl="te").tp_overlap_impl == "te"  # no TP: nothing to overlap
