"""Profiler: the measurement instrument, the written profile, and agreement with the shipped one."""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsebalance.commands import profile as profile_cmd
from sparsebalance.errors import ConfigError
from sparsebalance.kernels.profiler import Bench, ProfileGrid
from sparsebalance.simulator.config import tiny
from sparsebalance.simulator.cost.catalog import load_profile

SMALL = {"seq_lens": (64, 160), "budgets": (1, 3), "tokens": (32, 96), "params": (500, 5000), "repeats": 2,
         "warmup": 1}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    profile_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_concurrent_copies_write_one_profile(tmp_path):
    """Two copies measured in step: one row per grid point (median over copies), sidecar says so."""
    args = _parse("--out", str(tmp_path / "c"), "--seq-lens", "64,160", "--budgets", "1,3",
                  "--tokens", "32,96", "--params", "500,5000", "--repeats", "1", "--warmup", "1",
                  "--concurrency", "2", "--no-progress")
    assert profile_cmd.run(args) == 0
    prof = load_profile(str(tmp_path / "c"))
    assert len(prof.table) == 2 * 2 * 2 + (3 * 2 + 2 * 2) * 2 + 2  # attn; dense ops + split; optim
    assert prof.meta.concurrency == 2 and "2 concurrent copies" in prof.meta.how and "mean of 1 after 1" in prof.meta.how
    assert (prof.table.latency_s > 0).all()


def test_null_core_layer_is_the_decoder_layer_without_attention():
    """With a zero attention core, a Qwen2 layer is x + MLP(post_norm(x)) (o_proj has no bias)."""
    bench = Bench(tiny(), ProfileGrid(**SMALL))
    layer = bench.layer
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40)[None]
    pe = bench.net.model.rotary_emb(x, pos)
    out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
    out = out[0] if isinstance(out, tuple) else out
    expect = x + layer.mlp(layer.post_attention_layernorm(x))
    assert torch.allclose(out, expect, atol=1e-6)
    out.sum().backward()  # zero gradients flow through q/k/v projections: they receive a grad tensor
    assert layer.self_attn.k_proj.weight.grad is not None and layer.mlp.up_proj.weight.grad.abs().sum() > 0


def test_command_writes_a_loadable_profile(tmp_path):
    args = _parse("--out", str(tmp_path / "p"), "--seq-lens", "64,160", "--budgets", "1,3",
                  "--tokens", "32,96", "--params", "500,5000", "--repeats", "2", "--warmup", "1",
                  "--no-progress")
    assert profile_cmd.run(args) == 0
    prof = load_profile(str(tmp_path / "p"))
    assert set(prof.ops) == {"attn_fwd", "attn_bwd", "layer_fwd", "layer_bwd", "embed_fwd", "embed_bwd",
                             "head_fwd", "head_bwd", "optim", "layer_bwd_input", "layer_bwd_weight",
                             "head_bwd_input", "head_bwd_weight"}
    assert prof.meta.format_version == 2
    attn = prof.rows("attn_fwd")
    assert sorted(zip(attn.seq_len, attn.budget)) == [(64, 1), (64, 3), (160, 1), (160, 3)]
    assert (prof.table.latency_s > 0).all()
    assert prof.meta.block_size == 32 and prof.meta.model["heads"] == 4 and not prof.meta.analytical


@pytest.mark.parametrize("field,value", [("repeats", 0), ("warmup", -1), ("device", "tpu"),
                                         ("budgets", ()), ("dtype", "int8"), ("layer_impl", "fused")])
def test_bad_grid_names_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}:"):
        ProfileGrid(**{field: value})


def test_compiled_layer_with_the_tp_plan_is_refused():
    with pytest.raises(ConfigError, match=r"^layer_impl: compiled runs with tp = 1 only"):
        ProfileGrid(tp_plan=True, layer_impl="compiled")
    assert ProfileGrid(tp_plan=True, device="cpu").resolved_layer_impl() == "eager"


def test_tp_profile_measures_one_shard(tmp_path):
    """--tp 2 times one rank's shard of the layer (half the heads and MLP width), records tp 2 and
    that the TP all-reduces are not in it; a tp that does not divide the heads is refused."""
    from sparsebalance.kernels.measure import tp_shard

    shard = tp_shard(tiny(), 2)
    assert (shard.heads, shard.kv_heads, shard.ffn, shard.hidden, shard.head_dim) == (2, 1, 64, 64, 16)
    args = _parse("--out", str(tmp_path / "t"), "--tp", "2", "--seq-lens", "64,160", "--budgets", "1,3",
                  "--tokens", "32,96", "--params", "500,5000", "--repeats", "1", "--warmup", "1",
                  "--no-progress")
    assert profile_cmd.run(args) == 0
    prof = load_profile(str(tmp_path / "t"))
    assert prof.meta.tp == 2 and prof.meta.tp_comm_included is False
    assert prof.meta.model["heads"] == 4 and "one rank's shard" in prof.meta.how
    assert "(tp_plan)" in prof.meta.how  # what the calibration probe reads to time it alike
    assert not torch.distributed.is_initialized()  # its one-rank group is gone again
    with pytest.raises(ConfigError, match="^--tp: must divide model.kv_heads"):
        profile_cmd.run(argparse.Namespace(model="tiny", tp=4, block_size=None, config=None))



def test_tp_plan_times_the_layer_realrun_runs():
    """With tp_plan the profiled layer is the DTensor-parallelised one (realrun's plan on a one-rank
    mesh): its projections hold DTensors, and its forward equals the plain layer's."""
    from torch.distributed.tensor import DTensor

    from sparsebalance.kernels.tp_plan import LAYER_PLAN

    plain, planned = Bench(tiny(), ProfileGrid(**SMALL)), Bench(tiny(), ProfileGrid(**SMALL, tp_plan=True))
    try:
        for name in LAYER_PLAN:
            assert isinstance(planned.layer.get_submodule(name).weight, DTensor), name
            assert not isinstance(plain.layer.get_submodule(name).weight, DTensor), name
        (fwd_a, _), *_ = plain._layer(40, 0)
        (fwd_b, _), *_ = planned._layer(40, 0)
        torch.testing.assert_close(fwd_b(), fwd_a(), rtol=1e-5, atol=1e-6)
    finally:
        if planned.own_group:
            torch.distributed.destroy_process_group()


def test_cp_profile_measures_the_group_work(tmp_path):
    """--cp 2 adds attn_fwd_cp / attn_bwd_cp at the lengths the layout splits (>= 4 blocks under zigzag
    at cp 2: 160 tokens, not 64), records cp and cp_layout in the sidecar, and loads; a grid with no
    split length is one line."""
    args = _parse("--out", str(tmp_path / "c"), "--cp", "2", "--seq-lens", "64,160,256", "--budgets", "1,3",
                  "--tokens", "32,96", "--params", "500,5000", "--repeats", "1", "--warmup", "1",
                  "--no-progress")
    assert profile_cmd.run(args) == 0
    prof = load_profile(str(tmp_path / "c"))
    assert (prof.meta.cp, prof.meta.cp_layout) == (2, "zigzag") and "attn_*_cp" in prof.meta.how
    for op in ("attn_fwd_cp", "attn_bwd_cp"):
        rows = prof.rows(op)
        assert sorted(zip(rows.seq_len, rows.budget)) == [(160, 1), (160, 3), (256, 1), (256, 3)]
        assert (rows.latency_s > 0).all()
    # rank 0's ring steps, keyed by their pairs: at budget 1 (own block only) its own step attends
    # its blocks' causal pairs, B (B + 1) / 2 each (tiny: blocks of 32), and the other step nothing
    # (no call, no row)
    assert "attn_*_cp_step" in prof.meta.how
    fwd, bwd = prof.rows("attn_fwd_cp_step"), prof.rows("attn_bwd_cp_step")
    assert sorted(zip(fwd.seq_len, fwd.budget)) == sorted(zip(bwd.seq_len, bwd.budget))
    assert set(fwd.budget) == {1, 3} and (fwd.latency_s > 0).all() and (bwd.latency_s > 0).all()
    from sparsebalance.kernels.moba.cp import blocks_of, cp_token_index

    B = tiny().block_size
    own = [len(blocks_of(cp_token_index(torch.tensor([0, L]), B, 2, "zigzag")[0], [0, L], B)[0]) for L in (160, 256)]
    assert sorted(fwd[fwd.budget == 1].seq_len) == [n * B * (B + 1) // 2 for n in own] == [1584, 2112]
    # the calibration probe re-measures the CP rows as the profile measured them
    from sparsebalance.kernels.calibrate import probe
    from sparsebalance.simulator.cost.calibration import ProbeGrid

    got = probe(prof, ProbeGrid(seq_lens=(160,), budgets=(1, 3), tokens=(32,)), repeats=1, warmup=0)
    assert sorted(got[got.op == "attn_bwd_cp"].budget) == [1, 3] and (got.latency_s > 0).all()
    assert not got.op.str.endswith("_step").any()  # step rows are keyed by pairs, not re-measured
    with pytest.raises(ConfigError, match="^cp: no seq_len of the grid is split by stripe over 4 ranks"):
        from sparsebalance.kernels.profiler import run_profile

        run_profile(tiny(), ProfileGrid(**{**SMALL, "seq_lens": (64, 96)}, cp=4, cp_layout="stripe"),
                    progress=False)
    with pytest.raises(ConfigError, match="^cp_layout: .best. is not allowed; choose one of contiguous, zigzag, stripe$"):
        ProfileGrid(cp=2, cp_layout="best")
