"""A ring step is a kernel call (simulator/cost/cp/calls.py; docs/design/per-call-costs.md section 1):
hand checks of the four tests the design names -- a dense zigzag or stripe ring never at or above its
ideal, the contiguous ring approaching W / (2W - 1) from below, one step's merge bytes and time, and
the step pairs of every layout summing to the causal count."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ClusterConfig, qwen25_3b
from sparsebalance.simulator.cost.cp.calls import CallPrice, accumulate_bytes, merge_bytes, step_times
from sparsebalance.simulator.cost.cp.ring import ring_order
from sparsebalance.simulator.cost.cp.shards import rank_pairs
from sparsebalance.simulator.cost.hardware import H100
from sparsebalance.simulator.cost.tables import ATTENTION

K, M = 1024, 1024 * 1024


@functools.cache
def model_on(W: int, layout: str, merge: str = "unfused"):
    from sparsebalance.simulator.cost.latency import load_latency_model

    c = ClusterConfig(pp=1, dp=1, cp=W, tp=2, global_batch=W, device="h100", cp_layout=layout, cp_merge=merge)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_latency_model("analytical-h100", qwen25_3b(), c)


def one_gpu_call(lm, L: int, k: int, backward: bool) -> float:
    """One layer's attention of ``L`` tokens on one GPU as one call: the row + the call's fixed part."""
    t = lm.tables
    return t.read(lm.cp._one_gpu[backward], ATTENTION[backward], L, min(k, -(-L // t.block_size))) + \
        lm.cp.call[backward]


@pytest.mark.parametrize("layout", ["zigzag", "stripe"])
@pytest.mark.parametrize("W", [2, 4, 8])
def test_a_dense_ring_is_never_above_its_ideal(layout, W):
    """Dense causal (budget = every block): the ring is at least its own calls spread evenly
    (efficiency <= 1) and at least the issue's yardstick, W one-GPU calls of L / W per rank (a step
    pays its own call's fixed and per-length costs plus the merge or accumulation). Before per-call
    pricing a 64K zigzag ring on 8 H100s came out at 101.2 % (forward) and 102.1 % (backward) of it."""
    lm = model_on(W, layout)
    for L in (8 * K, 64 * K, 512 * K):
        k = L // lm.tables.block_size
        for bw in (False, True):
            rep = lm.cp_report(L, k, backward=bw)
            assert rep is not None and rep.layout == layout
            assert rep.time >= rep.steps.sum() / W * (1 - 1e-12) and rep.efficiency <= 1 + 1e-12
            yardstick = W * one_gpu_call(lm, L // W, k, bw)
            assert yardstick / rep.time < 1.0, (L, bw, yardstick / rep.time)


def test_the_contiguous_ring_approaches_its_closed_form_from_below():
    """The last rank runs one causal call and W - 1 full calls of twice its pairs; the others wait:
    efficiency -> W / (2W - 1) as the calls grow and their fixed parts fade, from below."""
    W = 8
    lm = model_on(W, "contiguous")
    bound = W / (2 * W - 1)
    for bw in (False, True):
        eff = [lm.cp_report(L, L // 128, backward=bw).efficiency for L in (8 * K, 64 * K, 512 * K)]
        assert eff[0] < eff[1] < eff[2] < bound, (bw, eff)
        assert eff[2] > 0.99 * bound


def test_merge_of_one_step_by_hand():
    """q_len 8,192, 16 heads, head dim 128: 16,777,216 elements; unfused 38 bytes each = 637.5 MB,
    0.228 ms at the H100's 3.35 TB/s x 0.836; fused 10 bytes = 167.8 MB, 0.060 ms."""
    bw = H100.memory_bandwidth * H100.memory_efficiency
    assert merge_bytes(8192, 16, 128, "unfused") == 38 * 16_777_216 == 637_534_208
    assert merge_bytes(8192, 16, 128, "fused") == 10 * 16_777_216 == 167_772_160
    assert merge_bytes(8192, 16, 128, "unfused") / bw == pytest.approx(0.2277e-3, rel=1e-3)
    assert merge_bytes(8192, 16, 128, "fused") / bw == pytest.approx(0.0599e-3, rel=1e-3)
    # backward: 10 bytes per q element, 20 per k element of H_kv x D (4 kv heads)
    assert accumulate_bytes(8192, 4096, 16, 4, 128) == 10 * 16_777_216 + 20 * 4096 * 4 * 128


def test_step_times_add_the_merge_after_the_first_step_and_accumulate_at_every_call():
    """Two ranks, a call price of 1 ns per pair + 5 us fixed: step 0 the call alone, a later step
    with a call + the merge (its bytes at 1 TB/s + 4 launches of 2 us), a step without pairs nothing;
    the backward adds the accumulation to every call."""
    price = CallPrice.of([1e6, 1e8], [1e-3, 1e-1], fixed=5e-6, floor=0.0)
    pairs = np.array([[1e6, 0.0], [1e6, 2e6]])
    q, kl = np.array([100.0, 100.0]), np.array([[100.0, 100.0], [100.0, 100.0]])
    args = {"allgather": False, "merge": "unfused", "heads": 2, "kv_heads": 1, "head_dim": 8, "bandwidth": 1e12,
            "launch": 2e-6}
    f = step_times(pairs, q, kl, price, backward=False, **args)
    merge = 38 * 100 * 2 * 8 / 1e12 + 4 * 2e-6
    assert f == pytest.approx(np.array([[1e-3 + 5e-6, 0.0], [1e-3 + 5e-6, 2e-3 + 5e-6 + merge]]), rel=1e-12)
    b = step_times(pairs, q, kl, price, backward=True, **args)
    acc = (10 * 100 * 2 * 8 + 20 * 100 * 1 * 8) / 1e12 + 3 * 2e-6
    assert b == pytest.approx(np.array([[1e-3 + 5e-6 + acc, 0.0], [1e-3 + 5e-6 + acc, 2e-3 + 5e-6 + acc]]), rel=1e-12)


def test_fused_merge_is_cheaper_in_the_forward_only():
    un, fu = model_on(4, "zigzag"), model_on(4, "zigzag", "fused")
    L = 64 * K
    assert fu.cp_report(L, L // 128).time < un.cp_report(L, L // 128).time
    assert fu.cp_report(L, L // 128, backward=True).time == pytest.approx(
        un.cp_report(L, L // 128, backward=True).time, rel=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("W", [2, 4, 8])
def test_step_pairs_sum_to_the_causal_count(layout, W):
    """Dense budget: the (rank, step) pairs of every layout sum to L (L + 1) / 2 per head exactly;
    zigzag's step 0 is a causal call of L / W and its later steps full (L / W) x (L / 2W) calls."""
    block = 128
    for L in (16 * K, 10_000):
        n = -(-L // block)
        if n < 2 * W:
            continue
        steps = np.take_along_axis(rank_pairs(L, block, n, W, layout), ring_order(W, "ring", W), axis=1)
        assert steps.sum() == L * (L + 1) // 2
    if layout == "zigzag":
        L = 16 * K
        steps = np.take_along_axis(rank_pairs(L, block, L // block, W, layout), ring_order(W, "ring", W), axis=1)
        q = L // W
        assert (steps[:, 0] == q * (q + 1) // 2).all() and (steps[:, 1:] == q * q // 2).all()


def test_cp_merge_is_validated_in_one_line():
    with pytest.raises(ConfigError, match=r"^cp_merge: 'half' is not allowed; choose one of unfused, fused$"):
        ClusterConfig(cp=2, cp_merge="half")
