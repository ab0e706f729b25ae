"""The memory model against a hand calculation on a tiny model, and its errors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ClusterConfig, cluster_from_mapping, tiny
from sparsebalance.simulator.cost.memory import (
    check_fits,
    compare_measured,
    memory_report,
    token_cap_for_memory,
)
from sparsebalance.simulator.schedule.graph import schedule_graph

TOKENS = [[100, 300, 200, 50], [10, 20, 30, 40]]


def hand(schedule: str, zero1: bool = False, recompute: str = "none") -> np.ndarray:
    """Peak bytes per device [dp, pp] of tiny() on PP2 x DP2, worked out by hand from its dims:
    hidden 64, 4 layers, 4 heads of 16 (q = 64), 2 kv heads (kv = 32), ffn 128, vocab 256, untied."""
    per_layer_params = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # 37,120
    params = [2 * per_layer_params + 256 * 64, 2 * per_layer_params + 64 + 256 * 64]
    per_param = 2 + 2 + (4 + 8) / (2 if zero1 else 1)
    act_layer = 2 * (4 * 64 + 2 * 64 + 2 * 32 + 3 * 128) + 4 * 4  # 1,680 bytes per token
    dropped = {"none": 0, "selective": 2 * 64 + 4 * 4, "full": act_layer - 2 * 64}[recompute]
    kept_layer = act_layer - dropped  # full: the layer's input alone; selective: less O and the LSE
    kept = [2 * kept_layer + 2 * 64, 2 * kept_layer]  # stage 0 also keeps the embedding output
    out = np.zeros((2, 2))
    for r, tok in enumerate(TOKENS):
        if schedule == "gpipe":  # every stage runs all four F before any B
            held = [sum(tok), sum(tok)]
        else:  # 1F1B: stage 0 (two warm-up F) peaks at two in flight: F0 F1 B0 F2 B1 F3 B2 B3
            held = [max(tok[0] + tok[1], tok[1] + tok[2], tok[2] + tok[3]), max(tok)]
        for s in range(2):
            rebuilt = act_layer if recompute == "full" else dropped  # one layer re-materialised
            transient = max(tok) * (rebuilt + (2 * 256 if s == 1 else 0))
            out[r, s] = params[s] * per_param + held[s] * kept[s] + transient
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("zero1,recompute", [(False, "none"), (True, "none"), (False, "full"), (True, "full"),
                                             (False, "selective")])
def test_peak_equals_hand_calculation(schedule, zero1, recompute):
    cl = ClusterConfig(pp=2, dp=2, global_batch=8, schedule=schedule, zero1=zero1, recompute=recompute)
    rep = memory_report(tiny(), cl, schedule_graph(schedule, 2, 4), np.array(TOKENS))
    np.testing.assert_allclose(rep.peak, hand(schedule, zero1, recompute), rtol=1e-12)
    assert rep.limit is None and rep.exceeded == 0


@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved", 2, 4, 2)])
def test_in_flight_counts_from_the_orders(schedule, pp, m, v):
    model = replace(tiny(), layers=8)
    cl = ClusterConfig(pp=pp, dp=1, global_batch=m, schedule=schedule, virtual_stages=v)
    rep = memory_report(model, cl, schedule_graph(schedule, pp, m, v), np.ones((1, m)))
    per_mb = rep.activations[0]
    one = memory_report(model, replace(cl), schedule_graph(schedule, pp, m, v),
                        np.eye(1, m)).activations[0]  # a single token-bearing micro-batch
    counts = per_mb / one
    if schedule == "1f1b":
        np.testing.assert_allclose(counts, [min(m, pp - s) for s in range(pp)])
    elif schedule == "gpipe":
        np.testing.assert_allclose(counts, m)
    else:  # interleaved warms up over both chunks: stage 0 holds more than 1F1B's pp
        assert counts[0] > pp


def test_presets_carry_device_memory_and_bad_fields_are_config_errors():
    assert cluster_from_mapping({"preset": "h200-4x8"}).device_memory == 141e9
    assert cluster_from_mapping({"preset": "h20-4x8"}).device_memory == 96e9
    assert cluster_from_mapping({"preset": "h100-4x8"}).device_memory == 80e9
    for field, value in (("device_memory", -5), ("device_memory", "80GB"), ("zero1", "yes"),
                         ("recompute", 1)):
        with pytest.raises(ConfigError, match=field):
            cluster_from_mapping({"preset": "h100-4x8", field: value})


def test_cluster_too_small_for_one_microbatch():
    from sparsebalance.simulator.config import qwen25_7b

    cl = ClusterConfig(pp=1, dp=1, device_memory=80e9)  # 7.6B params x 16 bytes = 122 GB
    with pytest.raises(ConfigError, match="device_memory.*cannot hold one micro-batch"):
        check_fits(qwen25_7b(), cl)
    with pytest.raises(ConfigError, match="device_memory"):
        token_cap_for_memory(qwen25_7b(), cl, schedule_graph("1f1b", 1, 2))
    check_fits(qwen25_7b(), replace(cl, pp=4, global_batch=4))  # four stages fit


def test_token_cap_fills_the_device():
    cl = ClusterConfig(pp=2, dp=2, global_batch=8, device_memory=5e6)
    g = schedule_graph("1f1b", 2, 4)
    cap = token_cap_for_memory(tiny(), cl, g)
    for c, fits in ((cap, True), (cap + 1, False)):
        assert (memory_report(tiny(), cl, g, np.full((2, 4), c)).exceeded == 0) == fits


def test_compare_measured():
    out = compare_measured(90e9, 100e9)
    assert out["relative_error"] == pytest.approx(-0.1) and out["measured_gb"] == pytest.approx(100)
    with pytest.raises(ValueError):
        compare_measured(1.0, 0.0)


def test_memory_aware_sab_packs_under_the_limit():
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.policies.base import PolicyContext
    from sparsebalance.policies.config import PolicyConfig
    from sparsebalance.policies.coverage import make_coverage_model
    from sparsebalance.policies.sab import SparsityAware
    from sparsebalance.simulator.config import qwen25_3b
    from sparsebalance.simulator.cost.latency import load_latency_model

    model = qwen25_3b()
    cl = ClusterConfig(pp=4, dp=2, global_batch=32, device_memory=50e9, recompute="full")
    rng = np.random.default_rng(0)
    seqs = [Sequence(id=i, length=int(x)) for i, x in enumerate(rng.integers(4096, 65536, 32))]
    lm = load_latency_model("analytical-h200", model, cl)
    for aware in (False, True):
        pol = PolicyConfig(batching="sab", token_cap=1 << 20, memory_aware=aware)
        ctx = PolicyContext(model=model, cluster=cl, policy=pol, latency=lm,
                            coverage=make_coverage_model(model, pol))
        plan = SparsityAware(pol).plan(seqs, ctx)
        tokens = [[mb.tokens for mb in r] for r in plan.ranks]
        rep = memory_report(model, cl, schedule_graph("1f1b", 4, plan.num_microbatches), tokens)
        assert (rep.exceeded == 0) == aware  # the 1M-token cap alone overfills stage 0
        assert sorted(s.id for s in plan.sequences()) == list(range(32))
    with pytest.raises(ConfigError, match="does not fit"):  # a 64K sequence on a 25 GB device
        small = replace(cl, device_memory=25e9)
        SparsityAware(pol).plan(seqs, PolicyContext(model=model, cluster=small, policy=pol, latency=lm,
                                                    coverage=make_coverage_model(model, pol)))
