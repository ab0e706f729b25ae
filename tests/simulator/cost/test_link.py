"""The latency of a data-parallel ring collective grows with its steps (simulator/cost/link.py):
NCCL's own count of a ring's steps inside and across nodes, by hand and against a brute-force walk
round the ring, and what reaches FSDP's gathers and the DDP all-reduce."""

from __future__ import annotations

import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import NCCL_RING_STEPS, ClusterConfig, h100_4x8, tiny
from sparsebalance.simulator.cost.fsdp import FsdpPricing
from sparsebalance.simulator.cost.link import group_link, ring_steps
from sparsebalance.simulator.layout import layout_of


def _walk(n: int, per_node: int, collective: str) -> tuple[int, int]:
    """Brute force: ranks in node order round the ring, one hop per step; an all-gather or a
    reduce-scatter walks n - 1 hops from a rank, an all-reduce twice round (2 (n - 1) hops),
    counted inside and across nodes; NCCL charges an all-reduce over N > 1 nodes 2 N crossings
    (its ring closes through the first node again), which the walk reproduces by closing the loop."""
    node = [r // per_node for r in range(n)]
    hops = [(node[i] != node[(i + 1) % n]) for i in range(n)]  # hop i: rank i -> rank i + 1 (mod n)
    if collective == "allreduce":
        inter = 2 * sum(hops) if sum(hops) else 0
        return 2 * (n - 1) - min(inter, 2 * (n - 1)), min(inter, 2 * (n - 1))
    inter = sum(hops[: n - 1])  # the open path from rank 0 to rank n - 1
    return n - 1 - inter, inter


@pytest.mark.parametrize("n,per_node", [(2, 2), (8, 8), (16, 8), (64, 8), (512, 8), (8, 1), (32, 4)])
@pytest.mark.parametrize("collective", ["allgather", "reducescatter", "allreduce"])
def test_steps_match_a_walk_round_the_ring(n, per_node, collective):
    nodes = -(-n // per_node)
    assert ring_steps(n, nodes, collective) == _walk(n, per_node, collective)


def test_steps_by_hand_and_bad_kind():
    assert ring_steps(512, 64, "allgather") == (448, 63)  # NCCL: n - 1 steps, N - 1 across
    assert ring_steps(8, 1, "allreduce") == (14, 0)  # 2 (n - 1), one node
    assert ring_steps(16, 2, "allreduce") == (26, 4)  # 2 (n - 1) = 30, 2 N = 4 across
    assert ring_steps(1, 1, "allreduce") == (0, 0)
    with pytest.raises(ValueError, match="collective: must be one of allgather, reducescatter, allreduce"):
        ring_steps(4, 1, "broadcast")


def test_latency_reaches_fsdp_gathers_by_hand():
    """MPT-1B-like ZeRO-3 over 512 H100s (64 nodes, 8 ranks each): the link's fixed 20 us + 448
    NVLink steps x 3.4 us + 63 network steps x 14 us = 2.4252 ms per gather, against 20 us before."""
    c = ClusterConfig(**{**_h100(), "dp": 512, "global_batch": 512, "dp_mode": "zero3", "nodes": 64})
    bw, lat = group_link(c, 512, "allgather")
    assert lat == pytest.approx(20e-6 + 448 * 3.4e-6 + 63 * 14e-6, rel=1e-12)
    p = FsdpPricing(tiny(), c, layout_of(tiny(), c))
    assert p.gather(1000) == pytest.approx(lat + 511 / 512 * 1000 * p.gather_bytes / bw, rel=1e-12)
    quiet = ClusterConfig(**{**_h100(), "dp": 512, "global_batch": 512, "dp_mode": "zero3", "nodes": 64,
                             "nvlink_step_latency": 0.0, "net_step_latency": 0.0})
    assert group_link(quiet, 512, "allgather")[1] == 20e-6  # the fixed latency alone, as before


def test_ddp_allreduce_in_one_node_pays_its_steps():
    c = ClusterConfig(**{**_h100(), "dp": 8, "pp": 1, "global_batch": 8, "nodes": 1})
    assert group_link(c, 8, "allreduce")[1] == pytest.approx(5e-6 + 14 * 3.4e-6, rel=1e-12)


def test_presets_carry_ncclS_values_and_negative_ones_are_refused():
    assert {k: getattr(h100_4x8(), k) for k in NCCL_RING_STEPS} == NCCL_RING_STEPS
    with pytest.raises(ConfigError, match="net_step_latency"):
        ClusterConfig(net_step_latency=-1e-6)


def _h100() -> dict:
    c = h100_4x8()
    return {"device": "h100", "tp": 1, "pp": 1, "tp_bandwidth": 370e9, "tp_latency": 5e-6,
            "allreduce_bandwidth": c.allreduce_bandwidth, "allreduce_latency": c.allreduce_latency,
            **NCCL_RING_STEPS}
