"""Pipeline costs that grow with depth (cluster.pp_impl, grad_clip): hand calculations and a brute force.

Oracles: the numbers of docs/design/per-call-costs.md section 2, and a rendezvous recurrence written
here from Megatron's 1F1B loop (``forward_backward_pipelining_without_interleaving``: warm-up
recv_forward / F / send_forward, steady F / send_forward_recv_backward / B /
send_backward_recv_forward, cool-down recv_backward / B / send_backward), independent of the
engine's reading of the schedule's orders.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ClusterConfig, ModelConfig, dgx_a100_80gb
from sparsebalance.simulator.cost.comm import (
    Communication,
    embedding_allreduce_time,
    end_stages_share_node,
    grad_norm_time,
    p2p_blocking,
)
from sparsebalance.simulator.engine import PipelineInput, simulate
from sparsebalance.simulator.layout import layout_of

GPT175B = ModelConfig(name="gpt-175b", hidden=12288, layers=96, heads=96, kv_heads=96, head_dim=128,
                      ffn=49152, vocab=51200, tie_embeddings=True)


def solve(progs: list[list[tuple]], F: np.ndarray, B: np.ndarray, hop: np.ndarray) -> float:
    """Run per-stage call lists: ``("F", (vs, j))``, ``("B", (vs, j))`` or ``("call", ops)``, an op
    ``("send" | "recv", (kind, boundary, j))``. A call is posted when its stage gets to it and
    completes when every transfer in it is done, ``max(post by the sender, post by the receiver)
    + hop``; the stage's next action starts then. Returns when the last stage is done."""
    progs = [[x for x in prog if x[0] != "call" or x[1]] for prog in progs]
    p = len(progs)
    posts: dict = {}
    pc, now = [0] * p, [0.0] * p
    posted = [False] * p
    other = {"send": "recv", "recv": "send"}
    while any(pc[s] < len(progs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(progs[s]):
                kind, arg = progs[s][pc[s]]
                if kind in "FB":
                    now[s] += (F if kind == "F" else B)[arg]
                    pc[s] += 1
                    moved = True
                    continue
                if not posted[s]:
                    for side, key in arg:
                        posts[(side, key)] = now[s]
                    posted[s] = moved = True
                if any((other[side], key) not in posts for side, key in arg):
                    break
                now[s] = max(max(posts[("send", key)], posts[("recv", key)]) + hop[key[1], key[2]]
                             for _, key in arg)
                posted[s] = False
                pc[s] += 1
                moved = True
        assert moved, "deadlock"
    return max(now)


def megatron_1f1b(F: np.ndarray, B: np.ndarray, hop: np.ndarray) -> float:
    """Brute force: Megatron's 1F1B call list on each stage, run by :func:`solve`. ``F``, ``B``
    [p, m]; ``hop`` [p - 1, m] (boundary s -> s + 1, micro-batch j; the same both ways)."""
    p, m = F.shape
    progs = []
    for s in range(p):
        warm = min(p - s - 1, m)
        prog, f, b = [], 0, 0

        def recv_f(j, s=s):
            return [("recv", ("a", s - 1, j))] if s > 0 else []

        def send_f(j, s=s):
            return [("send", ("a", s, j))] if s < p - 1 else []

        def recv_b(j, s=s):
            return [("recv", ("g", s, j))] if s < p - 1 else []

        def send_b(j, s=s):
            return [("send", ("g", s - 1, j))] if s > 0 else []

        for _ in range(warm):
            prog += [("call", recv_f(f)), ("F", (s, f)), ("call", send_f(f))]
            f += 1
        rest = m - warm
        if rest:
            prog.append(("call", recv_f(f)))
        for i in range(rest):
            prog += [("F", (s, f)), ("call", send_f(f) + recv_b(b)), ("B", (s, b))]
            f += 1
            b += 1
            prog.append(("call", send_b(b - 1) if i == rest - 1 else send_b(b - 1) + recv_f(f)))
        for _ in range(warm):
            prog += [("call", recv_b(b)), ("B", (s, b)), ("call", send_b(b))]
            b += 1
        progs.append(prog)
    return solve(progs, F, B, hop)


def megatron_interleaved(F: np.ndarray, B: np.ndarray, hop: np.ndarray, p: int) -> float:
    """Brute force: Megatron 2022's interleaved loop (``forward_backward_pipelining_with_interleaving``)
    on each of ``p`` stages, m a multiple of p and > p; ``F``, ``B`` [V, m], ``hop`` [V - 1, m]."""
    nv, m = F.shape
    v, total = nv // p, m * nv // p
    progs = []
    for s in range(p):
        def action(k, forward, s=s):  # get_model_chunk_id, and each chunk's micro-batches in order
            group, chunk = divmod(k, p * v)
            chunk //= p
            j = group * p + k % p
            return ((chunk if forward else v - 1 - chunk) * p + s, j)

        def recv_f(k):
            vs, j = action(k, True)
            return [("recv", ("a", vs - 1, j))] if k < total and vs > 0 else []

        def send_f(k):
            vs, j = action(k, True)
            return [("send", ("a", vs, j))] if vs < nv - 1 else []

        def recv_b(k):
            vs, j = action(k, False)
            return [("recv", ("g", vs, j))] if k < total and vs < nv - 1 else []

        def send_b(k):
            vs, j = action(k, False)
            return [("send", ("g", vs - 1, j))] if vs > 0 else []

        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        prog = [("call", recv_f(0))]
        for k in range(warm):
            last = k == warm - 1 and warm < total
            prog += [("F", action(k, True)), ("call", send_f(k) + recv_f(k + 1) + (recv_b(0) if last else []))]
        for k in range(total - warm):
            prog += [("F", action(k + warm, True)), ("B", action(k, False)),
                     ("call", send_f(k + warm) + send_b(k) + recv_f(k + warm + 1) + recv_b(k + 1))]
        for k in range(total - warm, total):
            prog += [("B", action(k, False)), ("call", send_b(k) + recv_b(k + 1))]
        progs.append(prog)
    return solve(progs, F, B, hop)


def engine(F, B, hop, *, blocking: bool, schedule: str = "1f1b", v: int = 1) -> float:
    nv = F.shape[0]
    inp = PipelineInput(schedule=schedule, pp=nv // v, virtual_stages=v, forward=F[None], backward=B[None],
                        p2p=hop[None], p2p_blocking=blocking)
    return simulate(inp).iteration_time


def uniform(p, m, f=1.0, b=2.0, hop=0.25, last=None):
    F, B = np.full((p, m), f), np.full((p, m), b)
    if last is not None:
        F[-1], B[-1] = last
    return F, B, np.full((p - 1, m), hop)


@pytest.mark.parametrize(("p", "m", "last", "blocking", "receiver_only"), [
    (2, 2, None, 9.75, 9.50), (4, 8, None, 37.75, 37.00), (4, 8, (1.3, 2.6), 43.45, 41.70),
    (4, 4, None, 23.75, 23.50), (8, 8, None, 51.75, 51.50)])
def test_blocking_hand_numbers(p, m, last, blocking, receiver_only):
    F, B, hop = uniform(p, m, last=last)
    assert megatron_1f1b(F, B, hop) == pytest.approx(blocking, abs=1e-9)
    assert engine(F, B, hop, blocking=True) == pytest.approx(blocking, abs=1e-9)
    assert engine(F, B, hop, blocking=False) == pytest.approx(receiver_only, abs=1e-9)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 8), (3, 5)])
def test_blocking_equals_receiver_only_without_hops(p, m):
    F, B, hop = uniform(p, m, hop=0.0)
    assert engine(F, B, hop, blocking=True) == pytest.approx((m + p - 1) * 3.0, abs=1e-12)
    assert engine(F, B, hop, blocking=False) == pytest.approx((m + p - 1) * 3.0, abs=1e-12)


@pytest.mark.parametrize(("p", "m", "seed"), [(2, 3, 0), (3, 3, 1), (4, 9, 2), (5, 7, 3), (6, 12, 4)])
def test_blocking_matches_megatron_call_list_on_random_durations(p, m, seed):
    rng = np.random.default_rng(seed)
    F = rng.uniform(0.5, 2.0, (p, m))
    B = rng.uniform(1.0, 4.0, (p, m))
    hop = rng.uniform(0.01, 0.6, (p - 1, m))
    blocked = engine(F, B, hop, blocking=True)
    assert blocked == pytest.approx(megatron_1f1b(F, B, hop), rel=1e-12)
    assert blocked >= engine(F, B, hop, blocking=False) - 1e-12  # a sender that waits is never faster


@pytest.mark.parametrize(("p", "v", "m", "seed"), [(2, 2, 4, 0), (2, 3, 6, 1), (4, 2, 8, 2), (3, 2, 9, 3),
                                               (4, 3, 12, 4)])
def test_interleaved_blocking_matches_megatron_2022_loop(p, v, m, seed):
    rng = np.random.default_rng(seed)
    F = rng.uniform(0.5, 2.0, (p * v, m))
    B = rng.uniform(1.0, 4.0, (p * v, m))
    hop = rng.uniform(0.01, 0.6, (p * v - 1, m))
    blocked = engine(F, B, hop, blocking=True, schedule="interleaved", v=v)
    assert blocked == pytest.approx(megatron_interleaved(F, B, hop, p), rel=1e-12)
    assert blocked >= engine(F, B, hop, blocking=False, schedule="interleaved", v=v) - 1e-12
    F, B, hop = np.ones((p * v, m)), np.full((p * v, m), 2.0), np.zeros((p * v - 1, m))
    assert engine(F, B, hop, blocking=True, schedule="interleaved", v=v) == pytest.approx(
        engine(F, B, hop, blocking=False, schedule="interleaved", v=v), abs=1e-12)


def test_blocking_trace_rows_end_at_the_receivers_start():
    F, B, hop = uniform(3, 4)
    inp = PipelineInput(schedule="1f1b", pp=3, forward=F[None], backward=B[None], p2p=hop[None], p2p_blocking=True)
    res = simulate(inp)
    rows = res.trace[res.trace.op == "P2P"]
    assert len(rows) == 2 * 2 * 4  # 2 boundaries x (activation + gradient) x 4 micro-batches
    assert np.allclose(rows.end_s - rows.start_s, 0.25)
    starts = set(np.round(res.start.ravel(), 9))
    assert set(np.round(rows.end_s, 9)) <= starts


def test_p2p_split_across_tp_175b():
    """50.3 MB activation (1 x 2,048 x 12,288 x 2 bytes) -> 6.29 MB per TP rank: 0.262 ms at 24 GB/s
    + latency, + the TP all-gather of 50.3 MB without SP under Megatron 2022."""
    act = 2048 * 12288 * 2
    assert act == 50_331_648
    base = replace(dgx_a100_80gb(), pp=16, tp=8, dp=1, global_batch=16)

    def hop(**kw):
        c = replace(base, **kw)
        tables = SimpleNamespace(profile=SimpleNamespace(meta=SimpleNamespace(analytical=True, tp_comm_included=None)))
        return Communication(tables, GPT175B, c, layout_of(GPT175B, c)).p2p_time(2048)

    wire = 10e-6 + act / 8 / 24e9
    assert act / 8 / 24e9 == pytest.approx(0.262e-3, rel=2e-3)
    gather = 5e-6 + 7 / 8 * act / 230e9
    assert hop(pp_impl="megatron-2022", sequence_parallel=True) == pytest.approx(wire, rel=1e-12)
    assert hop(pp_impl="megatron-2022") == pytest.approx(wire + gather, rel=1e-12)
    assert hop(pp_impl="megatron", sequence_parallel=True) == pytest.approx(wire, rel=1e-12)
    whole = 10e-6 + act / 24e9
    assert hop(pp_impl="megatron") == pytest.approx(whole, rel=1e-12)  # Megatron-Core: no scatter/gather
    assert hop() == pytest.approx(whole, rel=1e-12)  # ideal: today's
    assert hop(pp_impl="torch", sequence_parallel=True) == pytest.approx(whole, rel=1e-12)
    # Llama 3's pipeline: a rank sends the sequence shard it holds under SP, the whole without
    assert hop(pp_impl="meta", sequence_parallel=True) == pytest.approx(wire, rel=1e-12)
    assert hop(pp_impl="meta") == pytest.approx(whole, rel=1e-12)


def test_embedding_allreduce_175b():
    """(V / t) x h = 6,400 x 12,288 = 78.6 M parameters, fp32 main_grad: 314.6 MB, 13.1 ms at 24 GB/s;
    the end stages 15 nodes apart (TP 8 fills a node): 20 us + a 2-rank ring's 2 network steps of 14 us."""
    c = replace(dgx_a100_80gb(), pp=16, tp=8, dp=1, global_batch=16, grad_reduce_bytes=4, pp_impl="megatron-2022")
    params = 51200 / 8 * 12288
    assert params == 78_643_200
    assert params * 4 == pytest.approx(314.6e6, rel=1e-3)
    assert not end_stages_share_node(c)
    t = embedding_allreduce_time(GPT175B, c, 0)
    assert t == pytest.approx(20e-6 + 2 * 14e-6 + params * 4 / 24e9, rel=1e-12)
    assert t - 48e-6 == pytest.approx(13.1e-3, rel=1e-3)
    assert embedding_allreduce_time(GPT175B, c, 15) == t
    assert embedding_allreduce_time(GPT175B, c, 7) == 0.0  # only the end stages hold the embedding
    assert embedding_allreduce_time(replace(GPT175B, tie_embeddings=False), c, 0) == 0.0
    assert embedding_allreduce_time(GPT175B, replace(c, pp_impl="ideal"), 0) == 0.0
    assert embedding_allreduce_time(GPT175B, replace(c, pp=1, nodes=None), 0) == 0.0


def test_embedding_allreduce_inside_a_node():
    """TP 2 x PP 4 on 8-GPU nodes: ranks 0-1 (first stage) and 6-7 (last) share a node in every
    replica, so the 175B embedding's (51,200 / 2) x 12,288 fp32 gradients go over NVLink (230 GB/s)
    at 5 us + 2 NVLink steps of 3.4 us. PP 6 x TP 1 x DP 2: replica 1's ranks 6 and 11 straddle two nodes, so the
    all-reduce (every stage waits for it) runs on the network."""
    c = replace(dgx_a100_80gb(), pp=4, tp=2, dp=2, global_batch=16, grad_reduce_bytes=4, pp_impl="megatron")
    assert end_stages_share_node(c)
    nbytes = 51200 / 2 * 12288 * 4
    assert embedding_allreduce_time(GPT175B, c, 3) == pytest.approx(5e-6 + 2 * 3.4e-6 + nbytes / 230e9, rel=1e-12)
    c6 = replace(c, pp=6, tp=1, dp=2)
    assert not end_stages_share_node(c6)
    assert end_stages_share_node(replace(c6, dp=1))  # one replica: ranks 0 and 5 on one node
    nbytes = 51200 * 12288 * 4
    assert embedding_allreduce_time(GPT175B, c6, 0) == pytest.approx(20e-6 + 2 * 14e-6 + nbytes / 24e9, rel=1e-12)


def test_grad_norm_barrier_hand_numbers():
    """Two stages ready at 10 and 9 s, optimizer 1.0 and 1.5 s: 11.0 s without the barrier,
    10 + T_norm + 1.5 with it. GPipe, one micro-batch, F = 0, B = 1: stage 1 is done at 1,
    stage 0 at 2; all-reduces of 8 and 8 s make them ready at 10 and 9."""
    def run(norm):
        inp = PipelineInput(schedule="gpipe", pp=2, forward=np.zeros((1, 2, 1)), backward=np.ones((1, 2, 1)),
                            allreduce=np.array([8.0, 8.0]), optimizer=np.array([1.0, 1.5]), grad_norm=norm)
        return simulate(inp)

    assert run(None).iteration_time == pytest.approx(11.0)
    assert run(0.0).iteration_time == pytest.approx(11.5)
    res = run(0.125)
    assert res.iteration_time == pytest.approx(11.625)
    optim = res.trace[res.trace.op == "OPTIM"].sort_values("stage")
    assert np.allclose(optim.start_s, 10.125) and np.allclose(optim.end_s, [11.125, 11.625])


def test_grad_norm_time_latency_bound():
    c = replace(dgx_a100_80gb(), pp=16, tp=8, dp=1, global_batch=16)
    assert grad_norm_time(c) is None
    assert grad_norm_time(replace(c, grad_clip=True)) == pytest.approx(2 * 127 * 10e-6)


def test_blocking_only_where_the_implementation_blocks():
    c = ClusterConfig(pp=4, global_batch=16)
    assert not p2p_blocking(c)
    assert p2p_blocking(replace(c, pp_impl="megatron-2022"))
    assert p2p_blocking(replace(c, pp_impl="torch", schedule="gpipe"))
    assert not p2p_blocking(replace(c, pp_impl="megatron", schedule="interleaved", virtual_stages=2))
    assert p2p_blocking(replace(c, pp_impl="megatron-2022", schedule="interleaved", virtual_stages=2))
    assert not p2p_blocking(replace(c, pp_impl="megatron-2022", schedule="zb-h1"))
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):  # Llama 3: asynchronous sends
        assert not p2p_blocking(replace(c, pp_impl="meta", schedule=schedule, virtual_stages=v))


def test_bad_fields_one_line():
    with pytest.raises(ConfigError, match=r"^pp_impl: 'deepspeed' is not allowed; choose one of ideal, "
                                          r"megatron-2022, megatron, torch, meta$"):
        ClusterConfig(pp_impl="deepspeed")
    with pytest.raises(ConfigError, match="^grad_clip: must be true or false"):
        ClusterConfig(grad_clip="yes")
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ConfigError, match=r"^end_stage_layers_fewer: must be a whole number of layers >= 0"):
            ClusterConfig(end_stage_layers_fewer=bad)


def test_interleaved_blocking_refuses_what_megatron_2022_cannot_run():
    F = np.ones((1, 4, 1))
    with pytest.raises(ConfigError, match="^p2p_blocking: .*deadlock"):
        simulate(PipelineInput(schedule="interleaved", pp=2, virtual_stages=2, forward=F, backward=2 * F,
                               p2p=0.1, p2p_blocking=True))


def test_executor_wires_the_implementation():
    """The executor hands the engine the implementation's terms: blocking sends, the tied embedding's
    all-reduce on the end stages, the norm's barrier; ``ideal`` keeps today's input."""
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.simulator.config import tiny
    from sparsebalance.simulator.cost.query import ScalarStageLatency
    from sparsebalance.simulator.engine.executor import SimulatorExecutor
    from sparsebalance.simulator.plan import Plan, uniform_budgets

    class LinearLatency(ScalarStageLatency):  # 1e-4 s a token forward, twice that backward
        def __init__(self, cluster):
            self.cluster = cluster

        def stage_time(self, lengths, budget, stage, *, backward, chunk=0):
            return sum(lengths) * 1e-4 * (2.0 if backward else 1.0)

        def p2p_time(self, tokens):
            return 0.003

        def allreduce_time(self, stage):
            return 0.01 * (stage + 1)

        def optimizer_time(self, stage):
            return 0.002

    def _plan(dp, m):
        return Plan.from_lists([[[Sequence(id=r * m + j, length=1000)] for j in range(m)] for r in range(dp)])

    model = replace(tiny(), tie_embeddings=True)
    base = ClusterConfig(pp=3, dp=1, schedule="1f1b", global_batch=6)
    plan = _plan(1, 6)
    budgets = uniform_budgets(plan, 4)
    ideal = SimulatorExecutor(LinearLatency(base), model, base).build_input(0, plan, budgets)
    assert not ideal.p2p_blocking and ideal.grad_norm is None
    meg = replace(base, pp_impl="megatron-2022", grad_clip=True)
    inp = SimulatorExecutor(LinearLatency(meg), model, meg).build_input(0, plan, budgets)
    # vocab x hidden x dtype bytes (tiny: 4) over NVLink: the 3 stages share an 8-GPU node
    emb = 5e-6 + 256 * 64 * 4 / 450e9
    assert inp.p2p_blocking and inp.grad_norm == pytest.approx(2 * 2 * 10e-6)
    assert inp.allreduce == pytest.approx(ideal.allreduce + np.array([emb, 0.0, emb]))
    assert simulate(inp).iteration_time > simulate(ideal).iteration_time
    # Llama 3's pipeline: asynchronous sends and no embedding all-reduce (a Megatron term): the ideal input
    meta = replace(base, pp_impl="meta")
    inp = SimulatorExecutor(LinearLatency(meta), model, meta).build_input(0, plan, budgets)
    assert not inp.p2p_blocking and inp.allreduce == pytest.approx(ideal.allreduce)
    assert simulate(inp).iteration_time == pytest.approx(simulate(ideal).iteration_time, rel=1e-12)
    bad = replace(base, pp_impl="megatron-2022", schedule="interleaved", virtual_stages=2, global_batch=3)
    with pytest.raises(ConfigError, match="^cluster.pp_impl: 'megatron-2022' blocks the interleaved"):
        SimulatorExecutor(LinearLatency(bad), model, bad).build_input(0, _plan(1, 3), uniform_budgets(_plan(1, 3), 4))
