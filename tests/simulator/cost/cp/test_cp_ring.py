"""Context-parallel attention cost (simulator/cost/cp/) against closed forms: the
pair count, a contiguous causal dense ring's W / (2W - 1), a dense zigzag ring's balanced steps, a
stripe of a local pattern within 2 / n, and the ring's overlap recurrence."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparsebalance.simulator.cost.cp.ring import layer_time, ring_order
from sparsebalance.simulator.cost.cp.shards import (
    min_blocks,
    pair_weights,
    rank_pairs,
    rank_step_pairs,
    shards,
)
from sparsebalance.simulator.cost.roofline import moba_pairs


def share(pairs, seconds):
    """Steps in proportion to their pairs: ``seconds`` of work split over (rank, step)."""
    pairs = np.asarray(pairs, dtype=float)
    return seconds * pairs / pairs.sum() if pairs.sum() > 0 else 0.0 * pairs


FREE = {"kv_bytes": np.zeros(8), "intra": 1e30, "inter": 1e30, "latency": 0.0, "inner": 8, "backward": False}


def ring(L, block, k, cp, layout, selection="uniform", comm="ring", inner=None, **kw):
    w = pair_weights(L, block, k, selection)
    parts = shards(len(w), cp, layout)
    order = ring_order(cp, comm, inner or cp)
    pairs = rank_step_pairs(w, parts, order)
    args = FREE | {"kv_bytes": np.zeros(cp), "inner": inner or cp} | kw
    return pairs, layer_time(share(pairs, 1.0), comm=comm, **args)


@pytest.mark.parametrize("selection", ["uniform", "local"])
@pytest.mark.parametrize("L,block,k", [(1000, 64, 4), (4096, 128, 32), (700, 100, 3), (64, 64, 1)])
def test_pairs_sum_to_the_kernels_count(L, block, k, selection):
    assert pair_weights(L, block, k, selection).sum() == pytest.approx(float(moba_pairs(L, block, k)), rel=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
def test_shards_partition_the_blocks(layout):
    for n, cp in ((16, 4), (37, 3), (10, 5)):
        if n < min_blocks(layout, cp):
            continue
        parts = shards(n, cp, layout)
        assert sorted(np.concatenate(parts).tolist()) == list(range(n))
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 2


@pytest.mark.parametrize("W", [2, 4, 8])
def test_contiguous_causal_dense_ring_reaches_w_over_2w_minus_1(W):
    """Rank W-1 computes half a chunk then W-1 full chunks while the average rank computes W/2:
    efficiency W/(2W-1) (0.533 at W = 8) up to the diagonal's causal half (C (C+1) / 2, not C^2/2)."""
    block, m = 64, 4
    C = m * block
    _, rep = ring(W * C, block, 10**6, W, "contiguous")
    diag, full = C * (C + 1) / 2, C * C
    exact = (diag + (W - 1) * full / 2) / (diag + (W - 1) * full)
    assert rep.efficiency == pytest.approx(exact, rel=1e-12)
    assert rep.efficiency == pytest.approx(W / (2 * W - 1), rel=5e-3)
    assert rep.exposed == 0.0


def test_dense_zigzag_ring_is_balanced_at_every_step():
    pairs, rep = ring(8 * 2 * 64 * 3, 64, 10**6, 8, "zigzag")
    assert np.allclose(pairs, pairs[0:1, :])  # every rank the same pairs at every step
    assert rep.step_imbalance == pytest.approx(1.0, abs=1e-12) and rep.worker_imbalance == pytest.approx(1.0)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_stripe_of_a_local_pattern_is_balanced_within_2_over_n(k):
    """Dealt round-robin, every rank's blocks see k - 1 past blocks except the first row's (c < k - 1):
    the ranks differ by less than one block's work, so the imbalance is below 1 + 1 / (blocks per
    rank), within the issue's 2 / n with n the blocks a rank holds."""
    n, W = 96, 8
    _, rep = ring(n * 64, 64, k, W, "stripe", selection="local")
    assert 1.0 <= rep.worker_imbalance <= 1 + 1 / (n / W) <= 1 + 2 / (n / W)


def test_ring_overlap_recurrence_closed_form():
    """Equal steps t and hop h: (W-1) max(t, h) + t; exposed (W-1) max(0, h - t)."""
    W, t = 4, 1e-3
    pairs = np.ones((W, W))
    for h in (0.5e-3, 2e-3):
        rep = layer_time(share(pairs, W * W * t), comm="ring", kv_bytes=np.full(W, h * 1e9), intra=1e9,
                         inter=1e9, latency=0.0, inner=W, backward=False)
        assert rep.time == pytest.approx((W - 1) * max(t, h) + t, rel=1e-12)
        assert rep.exposed == pytest.approx((W - 1) * max(0.0, h - t), rel=1e-12, abs=1e-15)


def test_hierarchical_ring_hides_one_inter_node_transfer_behind_an_inner_ring():
    """2 nodes x 4 ranks, steps of t: inner hops h_in < t are hidden; the inter-node shard, sent at a
    round's start, arrives h_out later: hidden when h_out <= 4 t, else the next round waits for it."""
    inner, groups, t = 4, 2, 1e-3
    W = inner * groups
    pairs = np.ones((W, W))
    kv = np.full(W, 1e6)  # 1 MB per shard
    for h_out in (2e-3, 6e-3):
        rep = layer_time(share(pairs, W * W * t), comm="hierarchical", kv_bytes=kv, intra=1e6 / 0.5e-3,
                         inter=1e6 / h_out, latency=0.0, inner=inner, backward=False)
        want = max(inner * t, h_out) + inner * t  # round 1 starts when round 0 ends and the shard is in
        assert rep.time == pytest.approx(want, rel=1e-12)
    order = ring_order(W, "hierarchical", inner)
    assert all(sorted(row) == list(range(W)) for row in order.tolist())  # every shard once per rank


def test_allgather_gathers_then_computes():
    pairs, _ = ring(4096, 64, 8, 4, "zigzag")
    per_rank = pairs.sum(axis=1, keepdims=True)
    rep = layer_time(share(per_rank, 1.0), comm="allgather", kv_bytes=np.full(4, 1e6), intra=1e9, inter=1e9,
                     latency=0.0, inner=4, backward=False)
    gather = 3 / 4 * 4e6 / 1e9
    assert rep.time == pytest.approx(gather + float(per_rank.max() / per_rank.sum()), rel=1e-12)
    assert math.isclose(rep.exposed, gather)


def test_transfers_are_the_hops_the_ring_waits_for():
    """Free compute: the layer is the chain of hops, so its time is one rank's transfers summed;
    forward W - 1 hops of K + V, backward with dK + dV (fp32: 2 x the bf16 bytes) and the hop home."""
    W, h, lat = 4, 1e-3, 1e-5
    pairs = np.ones((W, W))
    for backward, per_hop in ((False, h), (True, 3 * h)):
        rep = layer_time(share(pairs, 0.0), comm="ring", kv_bytes=np.full(W, h * 1e9), intra=1e9, inter=1e9,
                         latency=lat, inner=W, backward=backward)
        assert rep.transfers.shape == (W, W + 1)
        assert np.allclose(rep.transfers[:, 0], 0.0) and np.allclose(rep.transfers[:, 1:W], lat + per_hop)
        assert np.allclose(rep.transfers[:, W], lat + 2 * h if backward else 0.0)
        assert rep.time == pytest.approx(float(rep.transfers[0].sum()), rel=1e-12)
    # all-gather: the gather (ring all-gather, (W - 1) / W of the bytes), backward + the reduce-scatter
    rep = layer_time(share(pairs.sum(axis=1, keepdims=True), 0.0), comm="allgather", kv_bytes=np.full(W, 1e6),
                     intra=1e9, inter=1e9, latency=lat, inner=W, backward=True)
    gather, scatter = (W - 1) * lat + 3 / 4 * 4e6 / 1e9, (W - 1) * lat + 3 / 4 * 8e6 / 1e9
    assert np.allclose(rep.transfers, [[gather, scatter]] * W)
    assert rep.time == pytest.approx(gather + scatter, rel=1e-12)


def test_hierarchical_transfers_bring_each_round_over_the_inter_node_link():
    inner, W = 2, 4
    rep = layer_time(share(np.ones((W, W)), 0.0), comm="hierarchical", kv_bytes=np.full(W, 1e6), intra=1e9,
                     inter=1e8, latency=0.0, inner=inner, backward=False)
    assert np.allclose(rep.transfers[:, [1, 3]], 1e-3) and np.allclose(rep.transfers[:, 2], 1e-2)


@pytest.mark.parametrize("selection", ["uniform", "local"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
def test_rank_pairs_equal_the_brute_force_sums(layout, selection):
    for L, block, k, cp in ((2000, 64, 5, 4), (777, 32, 3, 3), (4096, 128, 100, 2)):
        w = pair_weights(L, block, k, selection)
        parts = shards(len(w), cp, layout)
        brute = np.array([[w[np.ix_(parts[q], parts[p])].sum() for p in range(cp)] for q in range(cp)])
        assert np.allclose(rank_pairs(L, block, k, cp, layout, selection), brute, rtol=1e-12, atol=0)


# -- the latency model with CP: every op on 1/cp of the tokens, attention as the group's layer --

def _models(**cp):
    import warnings

    from sparsebalance.simulator.config import ClusterConfig, qwen25_3b
    from sparsebalance.simulator.cost.latency import load_latency_model

    m = qwen25_3b()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = load_latency_model("analytical-h200", m, ClusterConfig(pp=2, dp=1, tp=2, global_batch=2))
        cpm = load_latency_model("analytical-h200", m, ClusterConfig(pp=2, dp=1, tp=2, global_batch=2, **cp))
    return one, cpm


def test_latency_model_prices_the_cp_group():
    one, lm = _models(cp=4, cp_layout="zigzag")
    L, k, T = 65536, 16, 65536  # a profiled point: 65,536 tokens, budget 16
    for bw in (False, True):
        rep = lm.cp_report(L, k, backward=bw)
        assert lm.attention(L, k, backward=bw) == pytest.approx(rep.time, rel=1e-12)  # the folded surface
        # the ring's compute is the one-GPU attention split by the pairs, at least a launch per step
        assert rep.steps.sum() >= one.attention(L, k, backward=bw) * (1 - 1e-12)
        assert rep.time < one.attention(L, k, backward=bw)  # four GPUs are faster than one
    # dense parts, embedding, head: 1/cp of the tokens each
    assert lm.dense(T) == pytest.approx(one.dense(T // 4), rel=1e-12)
    assert lm.head(T, backward=True) == pytest.approx(one.head(T // 4, backward=True), rel=1e-12)
    assert lm.p2p_time(T) == pytest.approx(one.p2p_time(T // 4), rel=1e-12)
    # the gradient reduction spans DP x CP (the CP ranks hold the same weights)
    assert lm.allreduce_time(0) > 0 == one.allreduce_time(0)
    # a sequence with fewer blocks than the layout needs (2 cp = 8 for zigzag) stays whole
    short = 7 * lm.block_size
    assert lm.cp_report(short, 4) is None
    assert lm.attention(short, 4) == pytest.approx(one.attention(short, 4), rel=1e-9)


def test_measured_cp_rows_scale_the_group_work_where_the_group_matches():
    """A profile with attn_*_cp rows (the CP group's work, here 1.5 x one GPU's at every point from
    128 tokens up) prices an all-gather group of its degree and layout at 1.5 x the one-GPU work,
    spread over the ranks by pairs as before (so every rank's compute is 1.5 x, where the launch
    floor does not bind; the transfers the same); below the rows' shortest length the ratio at the nearest point holds; a ring, another
    layout or another degree keeps the one-GPU rows."""
    import warnings
    from dataclasses import replace

    import pandas as pd

    from sparsebalance.simulator.config import ClusterConfig, tiny
    from sparsebalance.simulator.cost.catalog import load_profile
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.cost.profile import Profile

    base = load_profile("cpu-tiny")
    t = base.table
    attn = t[t["op"].isin(["attn_fwd", "attn_bwd"]) & (t["seq_len"] >= 128)]
    rows = attn.assign(op=attn["op"] + "_cp", latency_s=1.5 * attn["latency_s"])
    measured = Profile(table=pd.concat([t, rows], ignore_index=True),
                       meta=replace(base.meta, cp=2, cp_layout="zigzag"), source="cp rows")

    def pair(**cl):
        c = ClusterConfig(pp=1, dp=1, cp=2, global_batch=2, device="cpu", **cl)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [load_latency_model(p, tiny(), c, allow_nonmonotone=True) for p in (base, measured)]

    plain, cp = pair(cp_layout="zigzag", cp_comm="allgather")
    assert "measured CP rows" in cp.cp_attention and "split by pair counts" in plain.cp_attention
    for L, k in [(1024, 8), (2048, 4), (100, 2)]:  # 100 tokens: 4 blocks, split, below the rows' 128
        for bw in (False, True):
            a, b = plain.cp_report(L, k, backward=bw), cp.cp_report(L, k, backward=bw)
            free = a.steps > plain.cp.floor[bw] * (1 + 1e-9)  # a step at the launch floor stays >= it
            assert free.any() and b.steps[free] == pytest.approx(1.5 * a.steps[free], rel=1e-9), (L, k, bw)
            assert (b.steps[~free] >= a.steps[~free]).all()
            assert b.transfers == pytest.approx(a.transfers, rel=1e-12)
    for cl in ({"cp_layout": "zigzag", "cp_comm": "ring"}, {"cp_layout": "stripe", "cp_comm": "allgather"}):
        plain, cp = pair(**cl)
        for bw in (False, True):
            assert cp.cp_report(1024, 8, backward=bw).steps == pytest.approx(
                plain.cp_report(1024, 8, backward=bw).steps, rel=1e-12), cl


def test_cp_memory_keeps_a_share_of_the_tokens_plus_the_ring_buffers():
    from sparsebalance.simulator.config import ClusterConfig, qwen25_3b
    from sparsebalance.simulator.cost.memory import kept_bytes_per_token, transient_bytes_per_token

    m = qwen25_3b()
    base = ClusterConfig(pp=2, dp=1, tp=2, global_batch=2)
    ring = ClusterConfig(pp=2, dp=1, tp=2, cp=4, global_batch=2)
    gather = ClusterConfig(pp=2, dp=1, tp=2, cp=4, global_batch=2, cp_comm="allgather")
    assert np.allclose(kept_bytes_per_token(m, ring), kept_bytes_per_token(m, base) / 4, rtol=1e-12)
    kv = 2 * 1 * 128 * 2  # K and V of one kv head per TP rank (2 kv heads / tp 2), bf16
    assert np.allclose(transient_bytes_per_token(m, ring),
                       (transient_bytes_per_token(m, base) + 2 * kv + 4 * kv) / 4, rtol=1e-12)
    assert np.allclose(transient_bytes_per_token(m, gather),
                       (transient_bytes_per_token(m, base) + 4 * kv + 8 * kv) / 4, rtol=1e-12)


@pytest.mark.parametrize("field,value,fragment", [
    ("cp", 0, "cp: must be > 0"),
    ("cp_layout", "spiral", "cp_layout: 'spiral' is not allowed; choose one of contiguous, zigzag, stripe"),
    ("cp_comm", "mesh", "cp_comm: 'mesh' is not allowed; choose one of ring, hierarchical, allgather"),
    ("cp_selection", "random", "cp_selection: 'random' is not allowed"),
])
def test_bad_cp_fields_are_one_line(field, value, fragment):
    from sparsebalance.errors import ConfigError
    from sparsebalance.simulator.config import ClusterConfig

    with pytest.raises(ConfigError, match=fragment):
        ClusterConfig(**{field: value, "cp": 4} if field != "cp" else {field: value})


def test_cp_cli_errors_exit_2_in_one_line(run_cli, tmp_path):
    example = "examples/qwen25-3b_h200_dp4pp4.toml"
    r = run_cli("simulate", "--config", example, "--out", tmp_path / "a", "--set", "cluster.cp=2")
    assert r.code == 2 and "cluster.cp: pp x dp x cp x tp = 4 x 4 x 2 x 2 = 64 GPUs exceeds" in r.err
    r = run_cli("simulate", "--config", example, "--out", tmp_path / "b", "--set", "cluster.dp=1",
                "--set", "cluster.cp=4", "--set", 'cluster.cp_comm="hierarchical"')
    assert r.code == 2 and "cluster.cp_comm: 'hierarchical' rings over nodes" in r.err
    assert all(len(x.err.strip().splitlines()) == 1 for x in (r,))


def test_cp_run_reports_ring_figures(run_cli, tmp_path):
    import pandas as pd

    r = run_cli("simulate", "--config", "examples/qwen25-3b_h200_dp4pp4.toml", "--iterations", 2, "--out",
                tmp_path / "cp", "--no-trace", "--no-progress", "--set", "cluster.dp=1", "--set", "cluster.cp=4",
                "--set", "cluster.global_batch=4")
    assert r.code == 0, r.err
    m = pd.read_csv(tmp_path / "cp" / "metrics.csv")
    assert (m["cp_worker_imbalance"] >= 1).all() and (m["cp_step_imbalance"] >= 1).all()
    assert ((m["cp_efficiency"] > 0) & (m["cp_efficiency"] <= 1)).all() and (m["cp_exposed_s"] >= 0).all()
    # the summary names the CP group, prints its figures (the metrics' means) and what priced its work
    assert "(DP1 x PP4 x CP4 (zigzag, ring) x TP2," in r.out
    line = next(x for x in r.out.splitlines() if x.strip().startswith("CP ring efficiency"))
    assert float(line.split()[3]) == pytest.approx(m["cp_efficiency"].mean(), abs=1e-4)
    assert "CP attention work priced from the one-GPU attention rows split by pair counts" in r.out


def test_best_layout_is_the_fastest_candidate_per_sequence():
    """cp_layout = "best": per (length, budget) the candidate (zigzag or stripe on the configured comm,
    or all-gather) with the least forward + backward layer time, the same for both passes."""
    _, best = _models(cp=4, cp_layout="best")
    cands = {(lay, comm): _models(cp=4, cp_layout=lay, cp_comm=comm)[1]
             for lay, comm in (("zigzag", "ring"), ("stripe", "ring"), ("stripe", "allgather"))}
    for L, k in ((65536, 16), (131072, 8), (32768, 128)):
        f, b = best.cp_report(L, k), best.cp_report(L, k, backward=True)
        totals = {key: m.cp_report(L, k).time + m.cp_report(L, k, backward=True).time for key, m in cands.items()}
        assert (f.layout, f.comm) == (b.layout, b.comm) == min(totals, key=totals.get)
        assert f.time + b.time == pytest.approx(min(totals.values()), rel=1e-12)


def test_cp_trace_rows_one_per_ring_step_inside_their_action(run_cli, tmp_path):
    import json

    import pandas as pd

    r = run_cli("simulate", "--config", "examples/qwen25-3b_h200_dp4pp4.toml", "--iterations", 1, "--out",
                tmp_path / "t", "--no-progress", "--set", "cluster.dp=1", "--set", "cluster.cp=4",
                "--set", "cluster.global_batch=4", "--set", "data.distribution=\"longctx-512k\"")
    assert r.code == 0, r.err
    tr = pd.read_csv(tmp_path / "t" / "trace.csv")
    cp, fb = tr[tr.op == "CP"], tr[tr.op.isin(["F", "B"])]
    assert len(cp) == 4 * len(fb)  # every sequence split (32K-512K tokens): 4 ring steps per F and B
    for row in fb.itertuples():
        mine = cp[(cp.stage == row.stage) & (cp.microbatch == row.microbatch)
                  & (cp.start_s >= row.start_s - 1e-12) & (cp.end_s <= row.end_s + 1e-12)]
        assert len(mine) >= 4
    # the transfers: the gate's exchange (a sparse budget) and 3 hops per F, 3 + dK/dV's hop home per
    # B, inside their action
    comm = tr[tr.op == "CP_COMM"]
    assert len(comm) == 4 * (fb.op == "F").sum() + 4 * (fb.op == "B").sum()
    for row in fb.itertuples():
        mine = comm[(comm.stage == row.stage) & (comm.microbatch == row.microbatch)
                    & (comm.start_s >= row.start_s - 1e-12) & (comm.end_s <= row.end_s + 1e-12)]
        assert len(mine) >= 4
    events = json.loads((tmp_path / "t" / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"stage 0 CP", "stage 3 CP", "stage 0 CP comm"} <= names


def test_measured_ring_steps_price_each_step_by_its_pairs():
    """A profile with attn_*_cp_step rows prices a ring's steps at the measured call of their pairs,
    merge and launches inside: a dense 4,096-token sequence on a zigzag ring of 2 (chunks of 1,024:
    rank 0 holds 0 and 3, rank 1 holds 1 and 2) attends, per rank, 2 x 1024 x 1025 / 2 + 1024^2 =
    2,098,176 pairs at its own step (two causal chunks, one full) and 2 x 1024^2 = 2,097,152 at the
    other; rows of 1.5 ms and 1.0 ms at exactly those pairs give the steps 1.5 and 1.0 ms. The
    all-gather keeps the one-GPU rows (its measured rows are attn_*_cp), and so does a profile
    without step rows."""
    import warnings
    from dataclasses import replace

    import pandas as pd

    from sparsebalance.simulator.config import ClusterConfig, tiny
    from sparsebalance.simulator.cost.catalog import load_profile
    from sparsebalance.simulator.cost.cp.shards import rank_pairs
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.cost.profile import Profile

    L, k = 4096, 128  # 128 blocks of 32: dense
    assert (rank_pairs(L, 32, k, 2, "zigzag") == [[2_098_176, 2_097_152], [2_097_152, 2_098_176]]).all()
    base = load_profile("cpu-tiny")
    rows = pd.DataFrame([(op, p, k, t) for op in ("attn_fwd_cp_step", "attn_bwd_cp_step")
                         for p, t in ((2_098_176, 1.5e-3), (2_097_152, 1.0e-3))],
                        columns=["op", "seq_len", "budget", "latency_s"])
    steps = Profile(table=pd.concat([base.table, rows], ignore_index=True), meta=replace(base.meta), source="steps")

    def model(p, comm):
        c = ClusterConfig(pp=1, dp=1, cp=2, global_batch=2, device="cpu", cp_layout="zigzag", cp_comm=comm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_latency_model(p, tiny(), c, allow_nonmonotone=True)

    lm = model(steps, "ring")
    assert "measured step calls" in lm.cp_attention
    for bw in (False, True):
        rep = lm.cp_report(L, k, backward=bw)
        assert rep.steps == pytest.approx(np.array([[1.5e-3, 1.0e-3], [1.5e-3, 1.0e-3]]), rel=1e-12)
        plain = model(base, "ring").cp_report(L, k, backward=bw)
        assert rep.transfers == pytest.approx(plain.transfers, rel=1e-12) and (plain.steps != rep.steps).all()
        assert model(steps, "allgather").cp_report(L, k, backward=bw).steps == pytest.approx(
            model(base, "allgather").cp_report(L, k, backward=bw).steps, rel=1e-12)
    # dense: no gate exchange; at a sparse budget the forward's transfer 0 is the gate's all-reduce
    from sparsebalance.simulator.cost.cp.ring import gate_time
    from sparsebalance.simulator.cost.link import group_link

    assert (lm.cp_report(L, k).transfers[:, 0] == 0).all()
    bw_, lat = group_link(lm.cluster, 2, "allreduce")
    want = gate_time(L // 32, tiny().kv_heads, tiny().head_dim, 2, bw_, lat)
    assert lm.cp_report(L, 4).transfers[:, 0] == pytest.approx([want, want], rel=1e-12)
    assert (lm.cp_report(L, 4, backward=True).transfers[:, 0] == 0).all()


def test_a_sparse_ring_first_exchanges_the_gate_by_hand():
    """The gate's exchange: 65,536 tokens in blocks of 128 = 512 blocks, 8 kv heads x 128 dims: 512 x
    (1,024 + 1) fp32 = 2,099,200 bytes all-reduced over 4 ranks at 100 GB/s and 10 us: 10 us +
    1.5 x 2,099,200 / 1e11 = 41.488 us. In a ring it is every rank's transfer 0, and the layer takes
    exactly that much longer (every step starts that much later), all of it exposed."""
    from sparsebalance.simulator.cost.cp.ring import gate_time, layer_time

    assert gate_time(512, 8, 128, 4, 1e11, 1e-5) == pytest.approx(1e-5 + 1.5 * 2_099_200 / 1e11, rel=1e-12)
    t = np.array([[1.0, 2.0, 1.5, 1.0], [2.0, 1.0, 1.0, 1.5], [1.5, 1.5, 2.0, 1.0], [1.0, 1.0, 1.5, 2.0]])
    kw = {"comm": "ring", "kv_bytes": np.full(4, 1e9), "intra": 1e10, "inter": 1e10, "latency": 1e-3, "inner": 4}
    plain = layer_time(t, backward=False, **kw)
    gated = layer_time(t, backward=False, gate=0.25, **kw)
    assert gated.time == pytest.approx(plain.time + 0.25, rel=1e-12)
    assert gated.exposed == pytest.approx(plain.exposed + 0.25, rel=1e-12)
    assert (gated.transfers[:, 0] == 0.25).all() and (plain.transfers[:, 0] == 0).all()
    assert layer_time(t, backward=True, gate=0.25, **kw).time == layer_time(t, backward=True, **kw).time
