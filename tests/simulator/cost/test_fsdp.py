"""FSDP / ZeRO-3 (and ZeRO-2) unit by unit (simulator/cost/fsdp.py), against hand calculations:
one unit's gather and reduce-scatter, the link a group runs on, the forward's exposed gathers, the
backward's prefetch orders, hybrid sharding's all-reduce, memory per device, the optimizer's shard,
the trace's AG / RS rows and the one-line refusals of bad combinations."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ClusterConfig, ModelConfig, tiny
from sparsebalance.simulator.cost.fsdp import FsdpPricing, Units
from sparsebalance.simulator.cost.memory import ADAM_BYTES, MASTER_BYTES, static_bytes
from sparsebalance.simulator.layout import layout_of

MPT_BLOCK = 201_379_840  # one MPT-7B decoder layer's parameters (d 4096, 4h GELU MLP, no biases)


def cluster(**kw) -> ClusterConfig:
    base = {"device": "test", "pp": 1, "dp": 8, "tp": 1, "global_batch": 8, "dp_mode": "zero3",
            "tp_bandwidth": 370e9, "tp_latency": 0.0, "allreduce_bandwidth": 50e9, "allreduce_latency": 0.0}
    return ClusterConfig(**(base | kw))


def pricing(model: ModelConfig | None = None, **kw) -> FsdpPricing:
    model = model or tiny()
    c = cluster(**kw)
    return FsdpPricing(model, c, layout_of(model, c))


def test_one_units_gather_and_reduce_scatter_by_hand():
    """An MPT-7B block over the 8 GPUs of one node (NVLink at 370 GB/s): (7/8) x 201,379,840 x 2 B /
    370 GB/s = 0.9525 ms; its fp32 reduce-scatter twice that."""
    p = pricing(grad_reduce_bytes=4, param_gather_bytes=2)
    assert p.link() == (370e9, 0.0)
    assert p.gather(MPT_BLOCK) == pytest.approx(7 / 8 * MPT_BLOCK * 2 / 370e9, rel=1e-12)
    assert p.gather(MPT_BLOCK) == pytest.approx(0.9525e-3, rel=1e-3)
    assert p.reduce_scatter(MPT_BLOCK) == pytest.approx(1.905e-3, rel=1e-3)
    lat = pricing(tp_latency=5e-6, param_gather_bytes=2)
    assert lat.gather(1000) == pytest.approx(5e-6 + 7 / 8 * 1000 * 2 / 370e9, rel=1e-12)


@pytest.mark.parametrize("kw,want", [
    ({"dp": 8, "tp": 1}, 370e9),  # one node
    ({"dp": 128, "tp": 1, "global_batch": 128}, 370e9),  # 16 nodes, 8 ranks each: 8 x 50 GB/s, capped by NVLink
    ({"dp": 16, "tp": 4, "global_batch": 16}, 100e9),  # 2 ranks per node: 2 rails
    ({"dp": 16, "tp": 8, "global_batch": 16}, 50e9),  # one rank per node: one NIC
    ({"dp": 4, "pp": 2, "tp": 1, "global_batch": 8}, 200e9),  # dp stride 2: 4 ranks in one node
])
def test_the_link_of_a_sharding_group(kw, want):
    """In one node the group runs on NVLink; across nodes one ring per NIC, so the fabric rate x the
    group's ranks per node (capped by NVLink)."""
    p = pricing(**kw)
    bw, _ = p.link()
    if kw.get("pp", 1) == 2:  # dp 4 x pp 2 in 8 GPUs: the group (ranks 0, 2, 4, 6) fits one node
        want = 370e9
    assert bw == want


def _units(p: FsdpPricing, n_layers: int, ag: float) -> FsdpPricing:
    """``p`` with one virtual stage of ``n_layers`` layer units and no root, each gathered in ``ag`` s."""
    per = 1_000_000
    p.units = [Units(root=0, layers=n_layers, per_layer=per)]
    p.bandwidth = (p.n - 1) / p.n * per * p.gather_bytes / ag
    p.latency = 0.0
    return p


@pytest.mark.parametrize("ag,want", [(1.5, 5.5), (0.5, 3.5)])
def test_forward_exposes_what_the_gathers_cannot_hide(ag, want):
    """3 units, 1 s of compute each: gathers of 1.5 s leave 1.5 + 1.5 + 1.5 + 1 = 5.5 s (2.5 s exposed);
    gathers of 0.5 s only expose the first: 0.5 + 3 = 3.5 s."""
    p = _units(pricing(param_gather_bytes=2), 3, ag)
    assert p.action(3.0, 0, backward=False) == pytest.approx(want, abs=1e-12)
    ev = p.events(3.0, 0, backward=False)
    assert [e.op for e in ev] == ["AG"] * 3 and ev[0].start == 0.0


@pytest.mark.parametrize("mode,prefetch,want", [("zero3", "pre", 7.5), ("zero3", "post", 10.5), ("zero2", None, 7.0)])
def test_backward_prefetch_orders(mode, prefetch, want):
    """3 units, 2 s of gradient compute each, gathers 0.5 s, fp32 reduce-scatters 1.0 s. BACKWARD_PRE:
    only the first gather and the last reduce-scatter are exposed (0.5 + 6 + 1.0); BACKWARD_POST: each
    gather waits behind the previous unit's reduce-scatter (0.5 + 2 + 1 + 0.5 + 2 + 1 + 0.5 + 2 + 1 =
    10.5); zero2 gathers nothing in the backward (6 + 1.0)."""
    kw = {"dp_mode": mode, "param_gather_bytes": 2, "grad_reduce_bytes": 4}
    if prefetch:
        kw["fsdp_backward_prefetch"] = prefetch
    p = _units(pricing(**kw), 3, 0.5)
    assert p.reduce_scatter(1_000_000) == pytest.approx(1.0)
    assert p.action(6.0, 0, backward=True) == pytest.approx(want, abs=1e-12)
    ev = p.events(6.0, 0, backward=True)
    assert sum(e.op == "RS" for e in ev) == 3 and sum(e.op == "AG" for e in ev) == (3 if mode == "zero3" else 0)
    link = sorted((e.start, e.end) for e in ev)  # one collective at a time on the link
    assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(link))


def test_actions_are_vectorised_and_a_group_of_one_costs_nothing():
    p = pricing()
    c = np.array([[1e-3, 2e-3, 5e-2]] * len(p.units))
    got = p.actions(c, 3, backward=True)
    assert got.shape == c.shape and (got >= c).all()
    assert [p.action(float(x), 0, backward=True) for x in c[0]] == pytest.approx(got[0].tolist(), rel=1e-12)
    one = pricing(dp=1, global_batch=1)
    assert one.action(0.25, 0, backward=False) == 0.25


def test_once_per_step_gathers_first_and_reduces_last():
    """fsdp_grad_sync = "last" (torch pipelining + FSDP2, Llama 3): of m = 3 micro-batches per replica
    only the first forward gathers and only the last backward reduce-scatters (no gather: the units
    stay gathered); the others run at their compute. Memory keeps every unit and the whole gradient."""
    model = tiny()
    p = pricing(model, fsdp_grad_sync="last", param_gather_bytes=2, grad_reduce_bytes=4)
    c = np.full((len(p.units), 6), 1e-3)  # 2 replicas x 3 micro-batches
    f, b = p.actions(c, 3, backward=False), p.actions(c, 3, backward=True)
    assert (f[:, [1, 2, 4, 5]] == c[:, [1, 2, 4, 5]]).all() and (f[:, [0, 3]] > c[:, [0, 3]]).all()
    assert (b[:, [0, 1, 3, 4]] == c[:, [0, 1, 3, 4]]).all() and (b[:, [2, 5]] > c[:, [2, 5]]).all()
    assert all(e.op == "RS" for e in p.events(1e-3, 0, backward=True))
    every = pricing(model, param_gather_bytes=2, grad_reduce_bytes=4)
    assert any(e.op == "AG" for e in every.events(1e-3, 0, backward=True))
    cl = cluster(fsdp_grad_sync="last", param_gather_bytes=2, grad_reduce_bytes=4)
    total = layout_of(model, cl).device_params(0)
    assert static_bytes(model, cl)[0] == pytest.approx(total / 8 * 16 + total * 2 + total * 4, rel=1e-12)


def test_hybrid_sharding_all_reduces_the_shards_across_replicas():
    """fsdp_shard 4 of dp 8: 2 replicas all-reduce each rank's 1/4 of the gradients on the fabric,
    2 (r-1)/r x P/4 x 4 B / 50 GB/s."""
    model = tiny()
    p = pricing(model, fsdp_shard=4, grad_reduce_bytes=4)
    params = layout_of(model, p.cluster).device_params(0)
    assert p.replica_allreduce(0) == pytest.approx(2 * 1 / 2 * params / 4 * 4 / 50e9, rel=1e-12)
    assert pricing(model).replica_allreduce(0) == 0.0


def test_memory_per_device_by_hand():
    """zero3 on 8 ranks: the fp32 parameter, gradient and Adam shards (16 B / 8 per parameter), the root
    and two layer units gathered in bf16, one layer's fp32 gradient; zero2 keeps every unit gathered.
    For MPT-7B (6,658,859,008 parameters) the states alone are 13.32 GB."""
    model = tiny()
    for mode in ("zero3", "zero2"):
        c = cluster(dp_mode=mode, param_gather_bytes=2, grad_reduce_bytes=4)
        total = layout_of(model, c).device_params(0)
        per_layer, root = model.params_per_layer, total - model.layers * model.params_per_layer
        gathered = (root + 2 * per_layer) * 2 if mode == "zero3" else total * 2
        want = total / 8 * (MASTER_BYTES + 4 + ADAM_BYTES) + gathered + per_layer * 4
        assert static_bytes(model, c)[0] == pytest.approx(want, rel=1e-12)
    assert 6_658_859_008 * 16 / 8 == pytest.approx(13.32e9, rel=1e-3)


def test_optimizer_steps_one_shard(tmp_path):
    from sparsebalance.simulator.cost.latency import load_latency_model

    model = tiny()
    lm_ddp = load_latency_model("analytical-h200", model, ClusterConfig(device="h200", pp=1, dp=8, global_batch=8))
    lm_z3 = load_latency_model("analytical-h200", model, ClusterConfig(device="h200", pp=1, dp=8, global_batch=8,
                                                                        dp_mode="zero3"))
    assert lm_z3.optimizer_time(0) == lm_ddp.comm._optimizer_step(round(lm_ddp.stage_params(0) / 8))
    assert lm_z3.allreduce_time(0) == 0.0  # the units' reduce-scatters run inside the backward


@pytest.mark.parametrize("kw,field", [
    ({"dp_mode": "zero4"}, "dp_mode"),
    ({"dp_mode": "ddp", "fsdp_shard": 2}, "fsdp_shard"),
    ({"fsdp_shard": 3}, "fsdp_shard"),
    ({"dp_mode": "zero2", "fsdp_backward_prefetch": "pre"}, "fsdp_backward_prefetch"),
    ({"dp_mode": "zero1", "fsdp_grad_sync": "last"}, "fsdp_grad_sync"),
    ({"fsdp_grad_sync": "sometimes"}, "fsdp_grad_sync"),
    ({"fsdp_backward_prefetch": "early"}, "fsdp_backward_prefetch"),
    ({"dp_mode": "zero1", "param_gather_bytes": 2}, "param_gather_bytes"),
    ({"dp_mode": "zero3", "zero1": True}, "zero1"),
    ({"pp": 2, "schedule": "zb-h1", "global_batch": 16}, "dp_mode"),
])
def test_bad_combinations_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        cluster(**kw)


def test_older_zero1_switch_reads_as_dp_mode():
    c = ClusterConfig(device="test", dp=2, global_batch=2, zero1=True)
    assert c.dp_mode == "zero1" and c.zero1
    assert ClusterConfig(device="test", dp=2, global_batch=2, dp_mode="zero1").zero1
    assert replace(c, dp_mode="zero1").zero1


def _run(tmp_path, extra: str):
    cfg = tmp_path / "run.toml"
    cfg.write_text('name = "fsdp"\niterations = 1\nprofile = "analytical-h200"\n[model]\npreset = "tiny"\n'
                   '[cluster]\ndevice = "h200"\npp = 2\ndp = 2\nglobal_batch = 8\n' + extra +
                   '[data]\nsource = "distribution"\ndistribution = "fixed"\nlength = 512\nnum_sequences = 64\n'
                   '[policy]\nbatching = "sequential"\ntuning = "fixed"\nk0 = 4\n')
    return subprocess.run([sys.executable, "-m", "sparsebalance", "simulate", "--config", str(cfg), "--out",
                           str(tmp_path / "out"), "--no-progress"], check=False, capture_output=True, text=True,
                          timeout=300)


def test_simulate_prints_the_gathers_in_its_trace(tmp_path):
    import pandas as pd

    r = _run(tmp_path, 'dp_mode = "zero3"\nallreduce_bandwidth = 1e9\n')
    assert r.returncode == 0, r.stderr
    tr = pd.read_csv(next((tmp_path / "out").rglob("trace.csv")))
    work = tr[tr["op"].isin(["F", "B"])]
    ag, rs = tr[tr["op"] == "AG"], tr[tr["op"] == "RS"]
    assert len(ag) and len(rs)
    # every collective lies inside an action of its stage, replica and micro-batch
    for row in pd.concat([ag, rs]).itertuples():
        host = work[(work["stage"] == row.stage) & (work["dp_rank"] == row.dp_rank)
                    & (work["microbatch"] == row.microbatch)]
        assert ((host["start_s"] <= row.start_s + 1e-12) & (row.end_s <= host["end_s"] + 1e-12)).any()
    # zero3: per micro-batch and stage, every layer unit gathered twice (forward, backward) + the root once
    per = ag.groupby(["dp_rank", "stage", "microbatch"]).size()
    assert set(per.tolist()) == {2 * 2 + 1}  # tiny: 4 layers, 2 per stage; the root on each end stage


def test_simulate_refuses_a_bad_fsdp_config_in_one_line(tmp_path):
    r = _run(tmp_path, 'dp_mode = "ddp"\nfsdp_shard = 2\n')
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "fsdp_shard" in r.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("trace.csv"))


@pytest.mark.parametrize("kw,bw", [
    ({"dp": 2, "pp": 4}, 370e9),  # "h200-1x8-dp2pp4": ranks 0 and 4 of one node
    ({"dp": 4, "pp": 4, "tp": 2, "nodes": 4}, 50e9),  # the paper's DP4 x PP4 x TP2: one rank per node
    ({"dp": 16, "tp": 2, "nodes": 4}, 200e9),  # 4 ranks per node: 4 rails
])
def test_ddp_gradient_ring_runs_on_the_groups_link(kw, bw):
    """The DDP all-reduce is the closed form 2 (n-1)/n x bytes / bw on the group's link: NVLink inside
    a node, the fabric x the group's ranks per node across nodes (cost/link.py)."""
    from sparsebalance.simulator.cost.latency import load_latency_model

    model = tiny()
    c = ClusterConfig(device="h200", global_batch=64, tp_bandwidth=370e9, tp_latency=0.0, allreduce_bandwidth=50e9,
                      allreduce_latency=0.0, **kw)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = load_latency_model("analytical-h200", model, c)
    n = c.dp
    nbytes = lm.stage_params(0) / c.tp * model.dtype_bytes
    assert lm.allreduce_time(0) == pytest.approx(2 * (n - 1) / n * nbytes / bw, rel=1e-12)


def test_a_sharding_group_walks_its_units_in_lock_step():
    """Every rank of the group joins each unit's collective, so an action takes the group's slowest
    compute for that micro-batch on every rank: 2 replicas x 2 micro-batches, compute [[1, 4], [3, 2]]
    ms -> both run [3, 4] ms (+ the exposed collectives, here none: an infinitely fast link). With
    hybrid sharding the groups are apart; with fsdp_grad_sync = "last" only the actions that
    communicate wait for each other."""
    p = pricing(dp=2, global_batch=2, tp_bandwidth=1e30)
    c = np.array([[1e-3, 4e-3, 3e-3, 2e-3]] * len(p.units))
    want = np.array([[3e-3, 4e-3, 3e-3, 4e-3]] * len(p.units))
    np.testing.assert_allclose(p.lockstep(c, 2, backward=False), want, rtol=0)
    np.testing.assert_allclose(p.actions(c, 2, backward=False), want, rtol=1e-12)
    hybrid = pricing(dp=4, global_batch=4, fsdp_shard=2, tp_bandwidth=1e30)
    c4 = np.array([[1e-3, 5e-3, 2e-3, 1e-3]])  # m = 1: replicas 0-1 are one group, 2-3 another
    np.testing.assert_allclose(hybrid.lockstep(c4, 1, backward=True), [[5e-3, 5e-3, 2e-3, 2e-3]], rtol=0)
    last = pricing(dp=2, global_batch=4, fsdp_grad_sync="last", tp_bandwidth=1e30)
    np.testing.assert_allclose(last.lockstep(c, 2, backward=True), [[1e-3, 4e-3, 3e-3, 4e-3]] * len(p.units),
                               rtol=0)  # only the last micro-batch's backward reduce-scatters
    np.testing.assert_allclose(last.lockstep(c, 2, backward=False), [[3e-3, 4e-3, 3e-3, 2e-3]] * len(p.units),
                               rtol=0)  # only the first one's forward gathers


@pytest.mark.parametrize("lead,want", [(4.5, 3.0), (2.0, 3.5), (0.0, 5.5), (-1.0, 6.5)])
def test_a_forward_gathered_ahead_by_hand(lead, want):
    """3 units, 1 s of compute each, gathers of 1.5 s issued back to back ``lead`` s before the action:
    4.5 s ahead all are done (3 s of compute); 2 s ahead they end at -0.5, 1.0, 2.5, so units run
    0-1, 1-2, 2.5-3.5; at the action's start 1.5, 3, 4.5: 1.5-2.5, 3-4, 4.5-5.5; 1 s after it
    (behind another stage's gathers) 2.5, 4, 5.5: 6.5 s."""
    p = _units(pricing(param_gather_bytes=2, fsdp_grad_sync="last"), 3, 1.5)
    assert p.action(3.0, 0, backward=False, lead=lead) == pytest.approx(want, abs=1e-12)
    ev = p.events(3.0, 0, backward=False, lead=lead)
    assert [x for e in ev for x in (e.start, e.end)] == pytest.approx(
        [-lead + 1.5 * i + d for i in range(3) for d in (0.0, 1.5)])


def test_which_runs_gather_ahead():
    """torch.distributed.pipelining's multi-stage schedules (and Llama 3's, assumed) unshard a device's
    first 3 virtual stages at the step's start; single-stage schedules, Megatron and ``ideal``, and
    FSDP that gathers every micro-batch gather when the forward starts."""
    base = {"pp": 2, "dp": 4, "global_batch": 8, "fsdp_grad_sync": "last", "dp_mode": "zero2"}
    inter = base | {"schedule": "interleaved", "virtual_stages": 2}
    assert pricing(**inter, pp_impl="torch").ahead and pricing(**inter, pp_impl="meta").ahead
    assert not pricing(**inter).ahead and not pricing(**inter, pp_impl="megatron").ahead
    assert not pricing(**base, pp_impl="torch").ahead
    assert not pricing(**(inter | {"fsdp_grad_sync": "every"}), pp_impl="torch").ahead
    model = replace(tiny(), layers=16)
    p = pricing(model, **(inter | {"virtual_stages": 4, "global_batch": 8}), pp_impl="torch")
    assert p.ahead_vstages() == {0, 1, 2, 3, 4, 5}  # device d holds d, d + 2, d + 4, d + 6: its first 3


def test_leads_follow_the_devices_gather_order():
    """Device 0 holds virtual stages 0 and 2 (pp 2, v 2): its gathers start at 0 for stage 0 and behind
    them for stage 2, so stage 2's first forward at 5 s was gathered 5 - G(0) s ahead; stage 0's at 0."""
    p = pricing(replace(tiny(), layers=8), pp=2, dp=4, global_batch=8, schedule="interleaved", virtual_stages=2,
                fsdp_grad_sync="last", dp_mode="zero2", pp_impl="torch", param_gather_bytes=2)
    start = np.zeros((1, 4, 3))
    start[0, :, 0] = [0.0, 1.0, 5.0, 7.0]
    leads = p.leads(start)
    assert leads.shape == (4, 1)
    assert leads[:, 0] == pytest.approx([0.0, 1.0, 5.0 - p.vstage_gather(0), 7.0 - p.vstage_gather(1)])
    assert p.vstage_gather(0) == pytest.approx(p.gather(p.units[0].root) + 2 * p.gather(p.units[0].per_layer))


def test_gathering_ahead_shortens_an_interleaved_step_and_its_trace_shows_it(tmp_path):
    """The same zero2 run under an interleaved schedule: gathered ahead (pp_impl torch) it is faster
    than gathered at each first forward (ideal) and no faster than with free gathers; the trace puts
    device 1's first gathers before its first forward."""
    import pandas as pd

    def run(impl: str, bw: str = "1e9"):
        sub = tmp_path / impl / bw
        sub.mkdir(parents=True)
        r = _run(sub, f'schedule = "interleaved"\nvirtual_stages = 2\ndp_mode = "zero2"\nfsdp_grad_sync = "last"\n'
                      f'pp_impl = "{impl}"\nallreduce_bandwidth = {bw}\ntp_bandwidth = {bw}\n')
        assert r.returncode == 0, r.stderr
        out = sub / "out"
        return (pd.read_csv(next(out.rglob("metrics.csv")))["iteration_time_s"].iloc[0],
                pd.read_csv(next(out.rglob("trace.csv"))))

    ahead, trace = run("torch")
    late, _ = run("ideal")
    free, _ = run("torch", "1e15")
    assert free <= ahead < late
    first_f = trace[(trace.op == "F") & (trace.stage == 1) & (trace.dp_rank == 0)].start_s.min()
    first_ag = trace[(trace.op == "AG") & (trace.stage == 1) & (trace.dp_rank == 0)].start_s.min()
    assert first_ag == pytest.approx(0.0, abs=1e-12) and first_ag < first_f


@pytest.mark.parametrize("impl,want", [("torch", 9.0), ("ideal", 7.0), ("meta", 7.0)])
def test_torch_pipelining_reduces_after_the_last_backward(impl, want):
    """3 units, 2 s of gradient compute each, fp32 reduce-scatters of 1.0 s, reduced once a step:
    torch.distributed.pipelining reduce-scatters only after the stage's last backward and waits for
    them (6 + 3 x 1.0 = 9.0 s); FSDP's own hooks start each unit's as its gradient is done, so only
    the last is exposed (6 + 1.0 = 7.0 s)."""
    p = _units(pricing(dp_mode="zero2", fsdp_grad_sync="last", pp_impl=impl, param_gather_bytes=2,
                       grad_reduce_bytes=4), 3, 0.5)
    assert p.reduce_after == (impl == "torch")
    assert p.action(6.0, 0, backward=True) == pytest.approx(want, abs=1e-12)
    ev = p.events(6.0, 0, backward=True)
    assert [e.op for e in ev] == ["RS"] * 3 and ev[-1].end == pytest.approx(want)
    if impl == "torch":
        assert [e.start for e in ev] == pytest.approx([6.0, 7.0, 8.0])


def test_once_a_step_reduce_scatters_run_behind_the_pipeline_by_hand():
    """pp 2, zero2, reduced once a step, 2 layer units a stage, fp32 reduce-scatters of 1.0 s: device
    0's last backward runs 10-14 s, its units' gradients done at 12 and 14, reduced 12-13 and 14-15:
    the step's end waits 1.0 s past its finish at 14; device 1's (6-8 s: 7-8, 8-9) are done before it
    finishes at 9.5. With two virtual stages on a device (v 2) their reduce-scatters queue on its
    link: vs 2 at 5-6 (5.5, 6.0), vs 0 at 6.5-7 (6.75, 7.0): 5.5-6.5, 6.5-7.5, 7.5-8.5, 8.5-9.5,
    2.5 s past 7. The backward itself is priced at its compute."""
    def priced(**kw):
        p = pricing(replace(tiny(), layers=4), dp_mode="zero2", fsdp_grad_sync="last", param_gather_bytes=2,
                    grad_reduce_bytes=4, **kw)
        p.units = [Units(root=0, layers=2, per_layer=1_000_000)] * len(p.units)
        p.bandwidth = (p.n - 1) / p.n * 1_000_000 * 4 / 1.0
        p.latency = 0.0
        return p

    p = priced(pp=2, global_batch=8)
    assert p.background and not p.reduce_after
    got = p.tail_exposed(np.array([[10.0, 6.0]]), np.array([[14.0, 8.0]]), np.array([[14.0, 9.5]]))
    assert got == pytest.approx([1.0, 0.0])
    c = np.full((2, 8), 2.0)
    assert (p.actions(c, 4, backward=True) == c).all()  # the step's end pays instead
    v = priced(pp=2, schedule="interleaved", virtual_stages=2, global_batch=8)
    start, end = np.array([[6.5, 0.0, 5.0, 0.0]]), np.array([[7.0, 0.0, 6.0, 0.0]])
    assert v.tail_exposed(start, end, np.array([[7.0, 0.0]]))[0] == pytest.approx(2.5)
    assert not priced(pp=1, global_batch=8).background  # one stage: its last backward ends the step anyway
    assert not priced(pp=2, global_batch=8, pp_impl="torch").background  # torch waits inside (reduce_after)
    # the same queue, unit by unit (the trace's RS rows): vs 0's first waits 0.75 s behind vs 2's
    q = [x for x in v.reduce_queue(start, end) if x[1] in (0, 2)]  # device 0
    assert [(vs, e.unit) for _, vs, e in q] == [(2, 1), (2, 0), (0, 1), (0, 0)]
    assert [t for _, _, e in q for t in (e.start, e.end)] == pytest.approx([5.5, 6.5, 6.5, 7.5, 7.5, 8.5, 8.5, 9.5])


def test_the_trace_shows_reduce_scatters_queued_behind_the_pipeline(tmp_path):
    """zero2 reduced once a step on an interleaved pipeline (2 virtual stages a device, reduced behind
    the pipeline): each device's RS rows run one at a time on its link, none before the last
    backward of its virtual stage starts, in issue order, the last ending where the step's end waits."""
    import pandas as pd

    r = _run(tmp_path, 'dp_mode = "zero2"\nfsdp_grad_sync = "last"\nschedule = "interleaved"\n'
             'virtual_stages = 2\nallreduce_bandwidth = 1e8\n')
    assert r.returncode == 0, r.stderr
    tr = pd.read_csv(next((tmp_path / "out").rglob("trace.csv")))
    rs = tr[tr["op"] == "RS"].sort_values("start_s")
    last_b = tr[(tr["op"] == "B") & (tr["microbatch"] == tr["microbatch"].max())]
    assert len(rs) and rs["microbatch"].nunique() == 1
    for (rank, stage), rows in rs.groupby(["dp_rank", "stage"]):
        assert (rows["start_s"].to_numpy()[1:] >= rows["end_s"].to_numpy()[:-1] - 1e-12).all()  # one link
        mine = last_b[(last_b["dp_rank"] == rank) & (last_b["stage"] == stage)]
        assert rows["start_s"].min() >= mine["start_s"].min() - 1e-12
    # queued past its action: at 1e8 B/s some RS ends after every backward of its device
    ends = last_b.groupby(["dp_rank", "stage"])["end_s"].max()
    assert (rs.groupby(["dp_rank", "stage"])["end_s"].max() > ends).any()
