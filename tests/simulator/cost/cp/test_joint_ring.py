"""One ring per packed micro-batch (``CPPricing.joint``): what the real run (``kernels/moba/cp_ring.py``)
and Transformer Engine's packed CP run, checked by hand on a profile whose ring-step calls cost
exactly 1 ns per pair."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.simulator.config import ClusterConfig, qwen25_3b, tiny
from sparsebalance.simulator.cost.cp.ring import gate_time
from sparsebalance.simulator.cost.cp.shards import rank_pairs
from sparsebalance.simulator.cost.latency import load_latency_model
from sparsebalance.simulator.cost.link import group_link

# the one-GPU rows of cpu-tiny end at budget 32: a dense 4K sequence reads them beyond (its ring's
# steps are priced by the step rows below, which cover it)
pytestmark = pytest.mark.filterwarnings("ignore:latency.*outside the profiled range")

RATE = 1e-9
"""Seconds per attended pair of every measured ring-step call below."""


def _ns_per_pair(comm: str = "ring", **cluster):
    """tiny (block 32) on a zigzag ring of 2, with attn_*_cp_step rows at 1 and 10^7 pairs costing
    exactly RATE per pair at budgets 4 and 128: every step is its pairs x RATE (no merge bytes or
    launches on top: the measured calls hold them)."""
    import pandas as pd

    from sparsebalance.simulator.cost.catalog import load_profile
    from sparsebalance.simulator.cost.profile import Profile

    base = load_profile("cpu-tiny")
    rows = pd.DataFrame([(op, p, k, p * RATE) for op in ("attn_fwd_cp_step", "attn_bwd_cp_step")
                         for k in (4, 128) for p in (1, 10_000_000)],
                        columns=["op", "seq_len", "budget", "latency_s"])
    prof = Profile(table=pd.concat([base.table, rows], ignore_index=True), meta=replace(base.meta), source="ns")
    c = ClusterConfig(pp=1, dp=1, cp=2, global_batch=2, device="cpu", cp_layout="zigzag", cp_comm=comm, **cluster)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_latency_model(prof, tiny(), c, allow_nonmonotone=True)


def test_one_sequence_is_its_own_ring():
    lm = _ns_per_pair()
    for bw in (False, True):
        for L, k in ((4096, 128), (4096, 4), (3000, 4)):
            one, joint = lm.cp_report(L, k, backward=bw), lm.cp_joint([L], k, backward=bw)
            assert joint.time == one.time
            assert (joint.steps == one.steps).all() and (joint.transfers == one.transfers).all()
            assert lm.cp.joint_delta([L], k, backward=bw) == 0.0


def test_two_sequences_share_every_step_and_hop_by_hand():
    """Two dense 4,096-token sequences (128 blocks of 32) on a zigzag ring of 2: each rank attends
    a = 2,098,176 pairs of each at its own step and c = 2,097,152 at the other. One ring: steps of
    2a and 2c ns, one hop of both sequences' K/V (b = 2 x 2,048 tokens x 2 (K, V) x kv dims x 2
    bytes over the node's link, + one latency): forward = max(2a, lat + b) + 2c. Two rings one after
    another pay the hop's latency twice and a step's start twice."""
    lm = _ns_per_pair()
    m, c = lm.model, lm.cluster
    L, k = 4096, 128
    a, cc = 2_098_176 * RATE, 2_097_152 * RATE
    assert (rank_pairs(L, 32, k, 2, "zigzag") == [[2_098_176, 2_097_152], [2_097_152, 2_098_176]]).all()
    b = 2 * 2048 * 2 * m.kv_heads * m.head_dim * m.dtype_bytes / c.tp_bandwidth
    hop = c.p2p_latency + b
    joint = lm.cp_joint([L, L], k)
    assert joint.steps == pytest.approx(np.array([[2 * a, 2 * cc], [2 * a, 2 * cc]]), rel=1e-12)
    assert joint.transfers[:, 1] == pytest.approx([hop, hop], rel=1e-12)
    assert joint.time == pytest.approx(max(2 * a, hop) + 2 * cc, rel=1e-12)
    alone = lm.cp_report(L, k)
    assert alone.time == pytest.approx(max(a, c.p2p_latency + b / 2) + cc, rel=1e-12)
    delta = lm.cp.joint_delta([L, L], k)
    assert delta == pytest.approx(joint.time - 2 * alone.time, rel=1e-12)
    # backward: dK/dV (fp32: g x K/V's bytes) ride along, and one last hop home of both
    g = max(4, m.dtype_bytes) / m.dtype_bytes
    jb = lm.cp_joint([L, L], k, backward=True)
    assert jb.transfers[:, 1] == pytest.approx([c.p2p_latency + (1 + g) * b] * 2, rel=1e-12)
    assert jb.transfers[:, 2] == pytest.approx([c.p2p_latency + g * b] * 2, rel=1e-12)


def test_a_short_sequence_is_attended_on_its_home_rank_at_step_0():
    """64 tokens are 2 blocks, fewer than zigzag over 2 ranks needs (4): the second sequence of the
    micro-batch stays whole on rank 1 mod 2 = 1 and adds its 64 x 65 / 2 = 2,080 causal pairs to
    that rank's first call, nothing else; its K/V ride rank 1's hop to rank 0."""
    lm = _ns_per_pair()
    m, c = lm.model, lm.cluster
    with_short, alone = lm.cp_joint([4096, 64], 128), lm.cp_joint([4096, 4096], 128)
    ref = lm.cp_report(4096, 128)
    diff = with_short.steps - ref.steps
    assert diff[1, 0] == pytest.approx(2080 * RATE, rel=1e-9)
    assert np.count_nonzero(np.abs(diff) > 1e-15) == 1
    kv_token = 2 * m.kv_heads * m.head_dim * m.dtype_bytes / c.tp_bandwidth
    assert with_short.transfers[0, 1] == pytest.approx(c.p2p_latency + (2048 + 64) * kv_token, rel=1e-12)
    assert with_short.transfers[1, 1] == pytest.approx(c.p2p_latency + 2048 * kv_token, rel=1e-12)
    assert with_short.time < alone.time


def test_the_gate_is_exchanged_once_for_the_micro_batch():
    """At budget 4 the ring gates first: one all-reduce of both sequences' 128 + 128 block sums (fp32,
    kv heads x head dim + a count each) over the 2 ranks, transfer 0 of every rank."""
    lm = _ns_per_pair()
    m = lm.model
    bandwidth, lat = group_link(lm.cluster, 2, "allreduce")
    want = gate_time(256, m.kv_heads, m.head_dim, 2, bandwidth, lat)
    assert lm.cp_joint([4096, 4096], 4).transfers[:, 0] == pytest.approx([want, want], rel=1e-12)
    assert (lm.cp_joint([4096, 4096], 4, backward=True).transfers[:, 0] == 0).all()
    assert (lm.cp_joint([4096, 4096], 128).transfers[:, 0] == 0).all()  # dense: no gate


def test_stage_times_add_the_joint_ring_once_per_micro_batch():
    """On the analytical H200 (qwen2.5-3b, CP 4, zigzag ring): eight 4K sequences in one micro-batch
    run one ring, not eight one after another -- the hops' latencies, the steps' fixed costs and the
    gate are paid once -- so the stage is shorter by layers x the joint delta, and the whole-model
    latency the policies balance is the stages' sum."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = load_latency_model("analytical-h200", qwen25_3b(),
                                ClusterConfig(pp=2, dp=1, tp=1, cp=4, global_batch=2, cp_layout="zigzag"))
    mb, k = (4096,) * 8, 8
    for bw in (False, True):
        delta = lm.cp.joint_delta(mb, k, backward=bw)
        assert delta < 0
        assert delta == pytest.approx(lm.cp_joint(mb, k, backward=bw).time
                                      - 8 * lm.cp_report(4096, k, backward=bw).time, rel=1e-12)
        additive = sum(lm.attention(4096, k, backward=bw) for _ in mb) + lm.call[bw]
        n = len(lm.stage_layers(0))
        dense = lm.stage_time(mb, k, 0, backward=bw) - n * (additive + delta)
        assert dense == pytest.approx(lm.stage_time((8 * 4096,), k, 0, backward=bw)
                                      - n * (lm.attention(8 * 4096, k, backward=bw) + lm.call[bw]), rel=1e-9)
    st = lm.stage_times([mb], [k])
    assert lm.microbatch_latency(mb, k) == pytest.approx(float(st["F"].sum() + st["B"].sum()), rel=1e-11)
    # the per-sequence split keeps its own rings: no joint ring there
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per = load_latency_model("analytical-h200", qwen25_3b(),
                                 ClusterConfig(pp=2, dp=1, tp=1, cp=4, global_batch=2, cp_layout="zigzag",
                                               cp_split="per-sequence"))
    assert per.cp_joint(mb, k) is None


def test_best_layout_picks_one_candidate_for_the_whole_micro_batch():
    """``cp_layout = "best"``: the zigzag ring, the stripe ring or the all-gather, whichever runs
    the whole micro-batch's forward + backward fastest (one layout for every sequence on the ring):
    each candidate priced by a model configured with it alone."""
    def model(**cp):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_latency_model("analytical-h200", qwen25_3b(),
                                      ClusterConfig(pp=2, dp=1, tp=1, cp=4, global_batch=2, **cp))

    mb, k = (65536, 8192, 4096), 8
    best = model(cp_layout="best")
    fb = {(lay, cm): (m.cp_joint(mb, k), m.cp_joint(mb, k, backward=True))
          for lay, cm in (("zigzag", "ring"), ("stripe", "ring"), ("stripe", "allgather"))
          for m in [model(cp_layout=lay, cp_comm=cm)]}
    want = min(fb, key=lambda c: fb[c][0].time + fb[c][1].time)
    got = best.cp_joint(mb, k)
    assert (got.layout, got.comm) == want
    assert got.time == pytest.approx(fb[want][0].time, rel=1e-12)
    assert best.cp_joint(mb, k, backward=True).time == pytest.approx(fb[want][1].time, rel=1e-12)


def test_each_sequence_works_at_its_own_calls_rate_the_fixed_part_once():
    """A packed step is priced as the calls that run: each sequence's work at the rate of a call of
    its own size (what the CPU ring step's per-sequence dense calls and a varlen kernel's
    per-sequence tiles pay), the call's fixed part and the merge's launches once per step, the
    merge's bytes summed. So on the analytical H200 a 64K and a 32K sequence on a zigzag ring of 4
    step exactly as their two rings' steps summed, less one fixed part per step (forward: and one
    set of merge launches after step 0; backward: one set of accumulation launches)."""
    from sparsebalance.simulator.cost.cp.calls import ACCUM_KERNELS, MERGE_KERNELS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = load_latency_model("analytical-h200", qwen25_3b(),
                                ClusterConfig(pp=2, dp=1, tp=1, cp=4, global_batch=2, cp_layout="zigzag"))
    k = 8
    for bw in (False, True):
        a, b = lm.cp_report(65536, k, backward=bw), lm.cp_report(32768, k, backward=bw)
        joint = lm.cp_joint([65536, 32768], k, backward=bw)
        fixed, launch = lm.cp.call[bw], lm.cp.launch
        assert fixed > 0 and launch > 0
        once = np.full(joint.steps.shape, fixed + (ACCUM_KERNELS if bw else MERGE_KERNELS["unfused"]) * launch)
        if not bw:
            once[:, 0] = fixed  # no merge at a rank's first step
        assert joint.steps == pytest.approx(a.steps + b.steps - once, rel=1e-12)


def test_trace_rows_and_figures_of_a_packed_micro_batch_are_its_one_ring():
    """The executor's CP rows and per-iteration CP figures read a packed micro-batch's joint ring (one
    report, its hops' latencies once); a micro-batch of one sequence keeps that sequence's ring."""
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.simulator.cost.cp import trace
    from sparsebalance.simulator.plan import MicroBatch

    lm = _ns_per_pair()
    packed = MicroBatch(sequences=(Sequence(id=0, length=4096), Sequence(id=1, length=2048)), pad=64)
    for bw in (False, True):
        reps = trace.reports(lm, packed, 4.0, backward=bw)
        assert len(reps) == 1 and reps[0] is lm.cp_joint([4096, 2048], 4, backward=bw)
        one = trace.reports(lm, MicroBatch(sequences=(Sequence(id=0, length=4096),)), 4.0, backward=bw)
        assert len(one) == 1 and one[0] is lm.cp_report(4096, 4, backward=bw)
