"""realrun beyond 1F1B: interleaved 1F1B (virtual stages), ZB-H1 (split backward, I then W) and
tensor parallelism (DTensor), each against the single-process reference (CPU, gloo, torchrun)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from weightcheck import assert_weights_match, merged_state, reference_check, torchrun_realrun

CONFIG = """
name = "t"
iterations = 2
seed = 3
profile = "analytical-h200"
output_dir = "{out}"
[model]
preset = "tiny"
[cluster]
pp = {pp}
dp = {dp}
tp = {tp}
schedule = "{schedule}"
virtual_stages = {v}
global_batch = {gb}
replicate_kv_heads = {replicate}
[data]
source = "text_dir"
path = "stdlib"
num_sequences = 32
seed = 0
min_length = 40
max_length = 240
[policy]
batching = "sequential"
tuning = "dst"
k0 = 3
k_min = 1
k_max = 8
[realrun]
timeout_s = 60
lr = 0.003
"""


def _launch(tmp: Path, *, pp: int, dp: int, tp: int = 1, schedule: str, v: int = 1,
            replicate: bool = False, timeout: float = 240) -> subprocess.CompletedProcess:
    cfg = tmp / "run.toml"
    cfg.write_text(CONFIG.format(out=tmp / "results", pp=pp, dp=dp, tp=tp, schedule=schedule, v=v,
                                 gb=4 * dp, replicate=str(replicate).lower()))
    return torchrun_realrun(cfg, pp * dp * tp, tmp / "state", timeout=timeout)


def _check(tmp: Path, *, pp: int, dp: int, tp: int, ops: tuple[str, ...]) -> pd.DataFrame:
    """Losses equal the single-process reference (fp32 tolerance), post-step weights too (DP
    replicas and TP ranks hold the same whole tensors), a trace row per action of every device."""
    from sparsebalance.simulator.engine.trace import check_trace

    out = tmp / "results" / "t"
    cfg, _, plans, budgets, tokens, ref_state = reference_check(tmp / "run.toml", out)
    merged = merged_state(tmp / "state", pp * dp * tp)
    # A key bias's exact gradient is zero (it shifts every score of a query, and every MoBA gate
    # score, alike), so only AdamW's bound applies to it. Pipelining keeps every other tensor
    # tight; TP changes the order inside each layer's matmuls and DP the order of the gradient sum,
    # so there a few near-zero gradients (7 of ~150,000 in one TP run; 1 of 8,192 in one tensor of a
    # DP 2 run) move by more than float tolerance (weightcheck.py).
    assert_weights_match(merged, ref_state, lr=cfg.realrun["lr"], steps=len(plans),
                         noise_only=lambda k: k.endswith("self_attn.k_proj.bias"),
                         tight=lambda k: tp == 1 and dp == 1, max_off=1e-2 if dp > 1 else 1e-3)
    _check_coverage(cfg, out, plans, budgets, tokens)
    tr = pd.read_csv(out / "measured_trace.csv")
    m = plans[0].num_microbatches
    v = cfg.cluster.virtual_stages
    for it in range(len(plans)):
        for d in range(dp):
            for s in range(pp):
                rows = tr[(tr.iteration == it) & (tr.dp_rank == d) & (tr.stage == s)]
                for op in ops:  # every chunk of the device: v actions per micro-batch
                    assert sorted(rows[rows.op == op].microbatch) == sorted(list(range(m)) * v), (op, s)
    assert set(tr.op) == {*ops, "ALLREDUCE", "OPTIM"} | ({"P2P"} if pp > 1 else set())
    assert (tr.end_s >= tr.start_s).all()
    check_trace(tr)  # the simulator's schema
    work = tr[tr.op.isin(ops)]
    assert work.cpu_s.notna().all() and (work.cpu_s >= 0).all()  # a tiny W may read 0 ticks  # CPU columns on every compute row
    return tr


def test_replicated_kv_heads_give_each_rank_its_query_heads_kv_head():
    """replicate_kv widens k/v to tp heads so that column shard t is KV head t // r, the head that
    HF's grouped-query attention pairs with query heads t * heads/tp ...; collapse_kv inverts it."""
    from sparsebalance.kernels.qwen2 import build_qwen2
    from sparsebalance.realrun.tp import collapse_kv, replicate_kv
    from sparsebalance.simulator.config import tiny

    m = tiny()  # 4 heads, 2 KV heads, head_dim 16
    tp, hd = 4, m.head_dim
    layer = build_qwen2(m, seed=1).model.layers[0]
    x = torch.randn(7, m.hidden, generator=torch.Generator().manual_seed(0))
    before = {n: layer.get_submodule(f"self_attn.{n}")(x).detach() for n in ("k_proj", "v_proj")}
    orig = {k: v.clone() for k, v in layer.state_dict().items()}
    replicate_kv([layer], m.kv_heads, hd, tp)
    group = m.heads // m.kv_heads  # query heads per KV head
    for n, y in before.items():
        wide = layer.get_submodule(f"self_attn.{n}")(x).detach().view(7, tp, hd)
        for t in range(tp):
            kv_of_rank = (t * m.heads // tp) // group  # HF: query head i uses KV head i // group
            torch.testing.assert_close(wide[:, t], y.view(7, m.kv_heads, hd)[:, kv_of_rank], rtol=0, atol=0)
    for k, v in layer.state_dict().items():
        torch.testing.assert_close(collapse_kv(k, v, m.kv_heads, hd, tp), orig[k], rtol=0, atol=0)


def _check_coverage(cfg, out: Path, plans: list, budgets: list, tokens: dict) -> None:
    """The first iteration's measured coverage curves (from whichever chunk holds the coverage layer;
    with TP, the mean over the TP ranks' heads) equal those of the whole model in one process at the
    initial weights, for the sequences no later iteration measured again."""
    import json

    from sparsebalance.kernels.qwen2 import MobaArgs, build_qwen2, full_forward_loss, pack
    from sparsebalance.realrun.config import realrun_config

    measured = {int(k): np.asarray(v) for k, v in
                json.loads((out / "measured_coverage.json").read_text())["curves"].items()}
    later = {s.id for p in plans[1:] for s in p.sequences()}
    net = build_qwen2(cfg.model, seed=cfg.seed)
    layer = realrun_config(cfg).coverage_layer
    checked = 0
    with torch.no_grad():
        for r, j, mb in plans[0].microbatches():
            batch = pack([tokens[s.id] for s in mb.sequences])
            moba = MobaArgs(cu_seqlens=batch.cu_seqlens, budget=budgets[0][r][j],
                            block_size=cfg.model.block_size, coverage_layer=layer)
            full_forward_loss(net, batch, moba)
            for seq, curve in zip(mb.sequences, moba.coverage_curves()):
                if seq.id not in later:
                    np.testing.assert_allclose(measured[seq.id], curve, rtol=1e-5, atol=1e-6)
                    checked += 1
    assert checked > 0


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_interleaved_pp2(tmp_path, dp):
    res = _launch(tmp_path, pp=2, dp=dp, schedule="interleaved", v=2)
    assert res.returncode == 0, res.stderr[-3000:]
    _check(tmp_path, pp=2, dp=dp, tp=1, ops=("F", "B"))


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_zb_h1_pp2_splits_the_backward(tmp_path, dp):
    res = _launch(tmp_path, pp=2, dp=dp, schedule="zb-h1")
    assert res.returncode == 0, res.stderr[-3000:]
    tr = _check(tmp_path, pp=2, dp=dp, tp=1, ops=("F", "I", "W"))
    # the measured order is the schedule's: stage 0 defers no W, stage 1 defers its first W
    from sparsebalance.simulator.schedule.schedules import stage_orders

    for s in range(2):
        rows = tr[(tr.iteration == 0) & (tr.dp_rank == 0) & (tr.stage == s) & tr.op.isin(["F", "I", "W"])]
        got = list(zip(rows.sort_values("start_s").op, rows.sort_values("start_s").microbatch))
        assert got == [(k, j) for k, _, j in stage_orders("zb-h1", 2, 4)[s]]


def test_pp2_tp2(tmp_path):
    res = _launch(tmp_path, pp=2, dp=1, tp=2, schedule="1f1b")
    assert res.returncode == 0, res.stderr[-3000:]
    _check(tmp_path, pp=2, dp=1, tp=2, ops=("F", "B"))


@pytest.mark.slow
def test_tp4_replicates_the_two_kv_heads(tmp_path):
    """tp = 4 > kv_heads = 2: each KV head on 2 TP ranks (Megatron's replication), 4 processes."""
    res = _launch(tmp_path, pp=1, dp=1, tp=4, schedule="1f1b", replicate=True)
    assert res.returncode == 0, res.stderr[-3000:]
    _check(tmp_path, pp=1, dp=1, tp=4, ops=("F", "B"))
