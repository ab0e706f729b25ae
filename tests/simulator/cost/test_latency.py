"""Latency model against hand-computed values on a synthetic profile with known closed forms."""

from __future__ import annotations

import math
import warnings

import pandas as pd
import pytest

from sparsebalance.errors import ConfigError, MeaningWarning
from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.config import ClusterConfig, ModelConfig, h200_4x8, qwen25_3b
from sparsebalance.simulator.cost.latency import load_latency_model
from sparsebalance.simulator.cost.profile import Profile
from sparsebalance.simulator.cost.profilemeta import ProfileMeta

SEQ = (64, 128, 256, 512)
BUD = (1, 2, 4, 8)
TOK = (32, 1024, 4096)


def f_attn(L, k):  # bilinear, so bilinear interpolation reproduces it exactly (and extrapolates it)
    return 1e-4 + 2e-6 * L + 3e-5 * k + 1e-8 * L * k


def g_dense(T):
    return 1e-5 + 1e-8 * T


def e_embed(T):
    return 1e-9 * T


def h_head(T):
    return 2e-6 + 3e-9 * T


MODEL = ModelConfig(name="t", hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256,
                    block_size=32, dtype_bytes=2)
PARAMS_PER_LAYER = 37120  # by hand: q 64*64+64, kv 2*(64*32+32), o 64*64, mlp 3*64*128, norms 2*64
EMBED = 256 * 64


def table(*, optim=False) -> pd.DataFrame:
    rows = [(op, s, k, m * f_attn(s, k)) for op, m in (("attn_fwd", 1), ("attn_bwd", 2))
            for s in SEQ for k in BUD]
    for op, fn in (("layer_fwd", g_dense), ("layer_bwd", lambda t: 2 * g_dense(t)),
                   ("embed_fwd", e_embed), ("embed_bwd", lambda t: 2 * e_embed(t)),
                   ("head_fwd", h_head), ("head_bwd", lambda t: 2 * h_head(t))):
        rows += [(op, t, 0, fn(t)) for t in TOK]
    if optim:
        rows += [("optim", 100_000, 0, 1e-4), ("optim", 1_000_000, 0, 1e-3)]
    return pd.DataFrame(rows, columns=["op", "seq_len", "budget", "latency_s"])


def meta(**over) -> ProfileMeta:
    m = {"format_version": 1, "device": "test", "dtype": "bf16", "analytical": False,
         "model": {"hidden": 64, "layers": 99, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128,
                   "vocab": 256},
         "block_size": 32, "tp": 1, "how": "measured: synthetic", "command": "test", "versions": {},
         "memory_bandwidth": 1e11}
    m.update(over)
    return ProfileMeta.from_json(m, "test")


def cluster(**kw) -> ClusterConfig:
    # one GPU per node (unless a test says otherwise): every DP ring crosses the fabric at one NIC
    # per rank, allreduce_bandwidth, so the closed forms below hold (cost/link.py)
    base = {"device": "test", "pp": 2, "dp": 4, "tp": 1, "global_batch": 16, "p2p_bandwidth": 1e10,
            "p2p_latency": 5e-6, "allreduce_bandwidth": 2e10, "allreduce_latency": 7e-6,
            "gpus_per_node": max(1, kw.get("tp", 1))}
    return ClusterConfig(**(base | kw))


def lm(extrapolate="warn", *, optim=False, m=None, **cl):
    prof = Profile(table=table(optim=optim), meta=m or meta(), source="synthetic")
    return load_latency_model(prof, MODEL, cluster(**cl), extrapolate=extrapolate)


def test_exact_on_grid_points_and_bilinear_between():
    model = lm()
    for s in SEQ:
        for k in BUD:
            if k <= math.ceil(s / 32):
                assert model.attention(s, k) == pytest.approx(f_attn(s, k), rel=1e-12)
                assert model.attention(s, k, backward=True) == pytest.approx(2 * f_attn(s, k), rel=1e-12)
    # between grid points: the bilinear closed form at (200, 3): 1e-4 + 4e-4 + 9e-5 + 6e-6
    assert model.attention(200, 3) == pytest.approx(1e-4 + 4e-4 + 9e-5 + 6e-6, rel=1e-12)
    for t in (32, 500, 1024, 3000, 4096):
        assert model.dense(t) == pytest.approx(g_dense(t), rel=1e-12)
        assert model.dense(t, backward=True) == pytest.approx(2 * g_dense(t), rel=1e-12)


def test_bilinear_on_a_non_bilinear_table_by_hand():
    t = table()
    sel = (t.op == "attn_fwd") & t.seq_len.isin([128, 256]) & t.budget.isin([2, 4])
    corners = {(128, 2): 1.0, (128, 4): 3.0, (256, 2): 5.0, (256, 4): 11.0}
    t.loc[sel, "latency_s"] = [corners[(s, k)] for s, k in zip(t[sel].seq_len, t[sel].budget)]
    # the hand-made corners fall as length grows (5 s -> the table's ms): accepted, it tests arithmetic
    with pytest.warns(UserWarning, match="latency falls as work grows"):
        model = load_latency_model(Profile(table=t, meta=meta(), source="x"), MODEL, cluster(),
                                   allow_nonmonotone=True)
    # (160, 3): 1/4 of the way in seq_len, half-way in budget
    lo, hi = (1.0 + 3.0) / 2, (5.0 + 11.0) / 2
    assert model.attention(160, 3) == pytest.approx(lo + 0.25 * (hi - lo), rel=1e-12)
    assert model.attention(256, 3) == pytest.approx(8.0, rel=1e-12)


def test_effective_budget_at_or_above_block_count_is_dense():
    model = lm()
    # 100 tokens at block 32 = 4 blocks: any top-k >= 4 is the dense value f(100, 4)
    for k in (4, 5, 8, 500):
        assert model.attention(100, k) == pytest.approx(f_attn(100, 4), rel=1e-12)
    assert model.effective_budget(100, 7) == 4 and model.effective_budget(100, 2) == 2
    assert model.attention(100, 3) < model.attention(100, 4)


def test_out_of_range_warns_once_per_op_then_extrapolates_linearly():
    model = lm("warn")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        v = model.attention(1000, 2)
        model.attention(2000, 2)
        model.attention(3000, 1)
    assert [str(w.message)[:50] for w in rec] == ["latency: attn_fwd seq_len 1000 is outside the prof"]
    assert "[64, 512]" in str(rec[0].message) and issubclass(rec[0].category, MeaningWarning)  # always shown by the CLI
    assert v == pytest.approx(f_attn(1000, 2), rel=1e-12)  # linear continuation of the end segment
    with pytest.warns(RuntimeWarning, match="attn_bwd"):
        model.attention(1000, 2, backward=True)
    with pytest.warns(RuntimeWarning, match="layer_fwd tokens 8192"):
        assert model.dense(8192) == pytest.approx(g_dense(8192), rel=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.attention(5000, 1)  # already warned for this op: silent


def test_out_of_range_error_names_op_value_and_range():
    model = lm("error")
    with pytest.raises(ConfigError, match=r"attn_fwd seq_len 1000 is outside the profiled range \[64, 512\]"):
        model.attention(1000, 2)
    with pytest.raises(ConfigError, match=r"attn_fwd budget 16 is outside the profiled range \[1, 8\]"):
        model.attention(512, 16)
    with pytest.raises(ConfigError, match=r"layer_bwd tokens 10 is outside .*\[32, 4096\]"):
        model.dense(10, backward=True)


def test_out_of_range_clamp_uses_the_nearest_profiled_value():
    model = lm("clamp")
    assert model.attention(1000, 2) == pytest.approx(f_attn(512, 2), rel=1e-12)
    assert model.attention(20, 1) == pytest.approx(f_attn(64, 1), rel=1e-12)
    assert model.attention(512, 16) == pytest.approx(f_attn(512, 8), rel=1e-12)
    assert model.dense(10_000) == pytest.approx(g_dense(4096), rel=1e-12)


def test_bad_extrapolate_setting():
    with pytest.raises(ConfigError, match="extrapolate: 'maybe' is not allowed; choose one of warn, error, clamp"):
        lm("maybe")


@pytest.mark.parametrize("layers, pp, vs", [(36, 4, 1), (36, 4, 2), (6, 4, 1), (7, 2, 3), (24, 8, 3),
                                            (5, 5, 1), (28, 3, 2)])
def test_stage_layers_cover_every_layer_once(layers, pp, vs):
    m = ModelConfig(hidden=64, layers=layers, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256,
                    block_size=32)
    sched = {"schedule": "interleaved", "virtual_stages": vs} if vs > 1 else {}
    model = load_latency_model(Profile(table=table(), meta=meta(), source="x"), m,
                               cluster(pp=pp, dp=1, **sched))
    virtual = [model.stage_layers(v % pp, v // pp) for v in range(pp * vs)]
    assert [i for r in virtual for i in r] == list(range(layers))  # contiguous, in virtual order
    sizes = [len(r) for r in virtual]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # the remainder goes to the first virtual stages


def test_interleaved_chunk_is_virtual_stage_c_times_pp_plus_s():
    m = ModelConfig(hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256, block_size=32)
    model = load_latency_model(Profile(table=table(), meta=meta(), source="x"), m,
                               cluster(pp=2, dp=1, schedule="interleaved", virtual_stages=2))
    assert model.stage_layers(0, 0) == range(2) and model.stage_layers(1, 0) == range(2, 4)
    assert model.stage_layers(0, 1) == range(4, 6) and model.stage_layers(1, 1) == range(6, 8)
    with pytest.raises(ConfigError, match="chunk in 0..1"):
        model.stage_layers(0, 2)


def test_too_many_stages_for_the_layers():
    with pytest.raises(ConfigError, match="pp x virtual_stages = 8 exceeds model.layers = 6"):
        lm(pp=8, dp=1, global_batch=8)


def test_stage_time_and_microbatch_latency_by_hand():
    model = lm()  # pp 2: stage 0 = layers 0..2 (+ embedding), stage 1 = layers 3..5 (+ head)
    lengths, T = [100, 300], 400
    budget = Budget.per_layer((1, 1, 2, 4, 8, 8))
    f0 = sum(f_attn(L, 1) + f_attn(L, 1) + f_attn(L, 2) for L in lengths) + 3 * g_dense(T) + e_embed(T)
    assert model.stage_time(lengths, budget, 0, backward=False) == pytest.approx(f0, rel=1e-12)
    # 100 tokens = 4 blocks: budget 8 is dense (4); 300 tokens = 10 blocks but the grid ends at 8
    b1 = 2 * (sum(f_attn(100, k) for k in (4, 4, 4)) + sum(f_attn(300, k) for k in (4, 8, 8)))
    b1 += 2 * 3 * g_dense(T) + 2 * h_head(T)
    assert model.stage_time(lengths, budget, 1, backward=True) == pytest.approx(b1, rel=1e-12)
    whole = sum(3 * f_attn(L, min(k, math.ceil(L / 32))) for L in lengths for k in budget.ks)
    whole += 6 * 3 * g_dense(T) + 3 * e_embed(T) + 3 * h_head(T)
    assert model.microbatch_latency(lengths, budget) == pytest.approx(whole, rel=1e-12)
    per_stage = sum(model.stage_time(lengths, budget, s, backward=b) for s in (0, 1) for b in (False, True))
    assert per_stage == pytest.approx(whole, rel=1e-12)
    assert model.microbatch_latency(lengths, 2) == pytest.approx(
        sum(6 * 3 * f_attn(L, 2) for L in lengths) + 18 * g_dense(T) + 3 * e_embed(T) + 3 * h_head(T),
        rel=1e-12)


def test_bad_budget_shape():
    with pytest.raises(ConfigError, match=r"one int per layer \(6\), got 2"):
        lm().microbatch_latency([100], Budget.per_layer((1, 2)))
    with pytest.raises(ConfigError, match="Budget.per_layer"):  # a bare tuple is not a budget
        lm().microbatch_latency([100], (1, 2))
    with pytest.raises(ConfigError, match="budget >= 1"):
        lm().attention(100, 0)


def test_p2p_time_closed_form():
    assert lm().p2p_time(1000) == pytest.approx(5e-6 + 1000 * 64 * 2 / 1e10, rel=1e-12)


def test_allreduce_ring_closed_form():
    model = lm()  # pp 2, dp 4, tp 1, untied
    s0 = 3 * PARAMS_PER_LAYER + EMBED
    s1 = 3 * PARAMS_PER_LAYER + 64 + EMBED
    assert model.stage_params(0) == s0 and model.stage_params(1) == s1
    for s, p in ((0, s0), (1, s1)):
        assert model.allreduce_time(s) == pytest.approx(2 * 3 / 4 * p * 2 / 2e10 + 7e-6, rel=1e-12)
    assert lm(dp=1).allreduce_time(0) == 0.0


def test_tied_embeddings_counted_once_without_pipeline_and_twice_with_one():
    tied = ModelConfig(hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256,
                       block_size=32, tie_embeddings=True)
    prof = Profile(table=table(), meta=meta(), source="x")
    one_meta = load_latency_model(Profile(table=table(), meta=meta(tp=2), source="x"), tied,
                                  cluster(pp=1, dp=2, tp=2))
    assert one_meta.stage_params(0) == 6 * PARAMS_PER_LAYER + EMBED + 64
    p = 6 * PARAMS_PER_LAYER + EMBED + 64
    assert one_meta.allreduce_time(0) == pytest.approx(2 * 1 / 2 * p / 2 * 2 / 2e10 + 7e-6, rel=1e-12)
    two = load_latency_model(prof, tied, cluster(pp=2, dp=2))
    assert two.stage_params(0) == 3 * PARAMS_PER_LAYER + EMBED
    assert two.stage_params(1) == 3 * PARAMS_PER_LAYER + 64 + EMBED


def test_optimizer_from_optim_rows_or_memory_bandwidth():
    model = lm()
    p0 = 3 * PARAMS_PER_LAYER + EMBED
    # 32 bytes per parameter: fp32 master + 2 moments read and written (24), the bf16 gradient read
    # twice (step, clipping norm) and zeroed (6), the bf16 weight written (2)
    assert model.optimizer_time(0) == pytest.approx(p0 * 32 / 1e11, rel=1e-12)
    # an fp32 gradient buffer (Megatron's main_grad, grad_reduce_bytes = 4): its 3 passes at 4 bytes
    assert lm(grad_reduce_bytes=4).optimizer_time(0) == pytest.approx(p0 * (24 + 3 * 4 + 2) / 1e11, rel=1e-12)
    with_rows = lm(optim=True)
    # optim rows: 1e-4 s at 1e5 params, 1e-3 s at 1e6 params -> linear in between
    assert with_rows.optimizer_time(0) == pytest.approx(1e-4 + (p0 - 1e5) * (9e-4 / 9e5), rel=1e-12)


def test_measured_profile_must_match_the_run():
    prof = Profile(table=table(), meta=meta(), source="measured.csv")
    with pytest.raises(ConfigError, match=r"tp 1 \(run: cluster.tp = 2\)"):
        load_latency_model(prof, MODEL, cluster(tp=2))
    with pytest.raises(ConfigError, match=r"block_size 32 \(run: model.block_size = 64\)"):
        load_latency_model(prof, ModelConfig(hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16,
                                             ffn=128, vocab=256, block_size=64), cluster())
    with pytest.raises(ConfigError, match=r"model.ffn 128 \(run: 256\)"):
        load_latency_model(prof, ModelConfig(hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16,
                                             ffn=256, vocab=256, block_size=32), cluster())
    # layers may differ (the table is per layer): sidecar says 99, the model has 6
    assert load_latency_model(prof, MODEL, cluster()).model.layers == 6


def test_analytical_profile_is_re_derived_for_another_model():
    from sparsebalance.simulator.cost.roofline import H200, attention_time, dense_time

    model = load_latency_model("analytical-h200", MODEL, cluster(tp=1, device="h200"))
    assert "re-derived" in model.profile.source
    # tables price the path the kernel's dispatcher picks (roofline.build_table, kernelcost.choose_path)
    for L in (1024, 8192):  # a sequence alone is a call of its own: its row + the call's fixed part
        assert model.attention(L, 4) + model.call[False] == pytest.approx(
            float(attention_time(L, 4, MODEL, 1, 32, H200)), rel=1e-12)
    assert model.dense(4096, backward=True) == pytest.approx(
        float(dense_time(4096, MODEL, 1, H200, backward=True)), rel=1e-12)


def test_shipped_profile_is_used_as_is_for_its_own_model():
    model = load_latency_model("analytical-h200", qwen25_3b(), h200_4x8())
    assert "re-derived" not in model.profile.source
    assert model.profile.meta.analytical is True


@pytest.mark.parametrize("name", ["cpu-tiny", "cpu-tiny-long"])
def test_shipped_cpu_profile_round_trip_every_profiled_point(name):
    """The measured CPU profiles load in the simulator, and at every profiled point the prediction is
    the measured latency (issue 4: within 5 %; interpolation makes it exact on the grid)."""
    from sparsebalance.simulator.config import tiny
    from sparsebalance.simulator.cost.catalog import load_profile

    prof = load_profile(name)
    lm = load_latency_model(name, tiny(), ClusterConfig(device="cpu", pp=1, dp=1, global_batch=1))
    query = {
        "attn_fwd": lambda n, k: lm.attention(n, k), "attn_bwd": lambda n, k: lm.attention(n, k, backward=True),
        "layer_fwd": lambda n, k: lm.dense(n), "layer_bwd": lambda n, k: lm.dense(n, backward=True),
        "embed_fwd": lambda n, k: lm.embed(n), "embed_bwd": lambda n, k: lm.embed(n, backward=True),
        "head_fwd": lambda n, k: lm.head(n), "head_bwd": lambda n, k: lm.head(n, backward=True),
    }
    rows = prof.table[prof.table.op.isin(list(query))]
    assert len(rows) > 100
    for op, n, k, measured in rows[["op", "seq_len", "budget", "latency_s"]].itertuples(index=False):
        k_eff = min(int(k), math.ceil(n / 32)) if op.startswith("attn") else int(k)
        if op.startswith("attn") and k_eff != k:
            continue  # a budget beyond the block count is the dense point, profiled separately
        assert query[op](int(n), int(k)) == pytest.approx(measured, rel=0.05), (op, n, k)


def test_vectorised_microbatch_latencies_match_the_closed_form():
    model = lm("warn")
    mbs = [[100], [64, 512], [300, 200, 40], [], [1000]]  # 40 and 1000 are outside [64, 512]
    ks = [1, 2, 8, 3, 2]
    want = []
    for mb, k in zip(mbs, ks):
        T = sum(mb)
        dense = 0.0 if T == 0 else 18 * g_dense(T) + 3 * e_embed(T) + 3 * h_head(T)
        want.append(sum(6 * 3 * f_attn(L, min(k, math.ceil(L / 32))) for L in mb) + dense)
    with pytest.warns(RuntimeWarning):
        got = model.microbatch_latencies(mbs, ks)
    assert got == pytest.approx(want, rel=1e-12)
    assert model.microbatch_latencies(mbs[:3], 2) == pytest.approx(
        [model.microbatch_latency(mb, 2) for mb in mbs[:3]], rel=1e-12)
    with pytest.raises(ConfigError, match="one budget per micro-batch"):
        model.microbatch_latencies(mbs, [1, 2])


def test_device_mismatch_warns():
    prof = Profile(table=table(), meta=meta(), source="x")
    with pytest.warns(UserWarning, match="device 'test' but cluster.device is 'h20'"):
        load_latency_model(prof, MODEL, cluster(device="h20"))


# -- split backward (zero-bubble schedules) ---------------------------------------------------------
def test_format_1_profile_derives_the_split_as_halves_and_says_so_once():
    model = lm()  # the synthetic table has no split rows (format 1)
    assert model.notes == []  # nothing derived is used yet: no note
    with pytest.warns(RuntimeWarning, match="no split-backward rows: I = W = half of layer_bwd and head_bwd"):
        i = model.dense(1024, backward=True, part="input")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        w = model.dense(1024, backward=True, part="weight")
        assert i == w == g_dense(1024)  # half of layer_bwd = 2 g
        assert model.head(32, backward=True, part="input") == pytest.approx(h_head(32), rel=1e-12)
    assert len(model.notes) == 1


def test_stage_time_parts_sum_to_the_backward_and_attention_is_all_input():
    split_rows = [(f"{n}_bwd_{p}", t, 0, f(t)) for n, f in (("layer", g_dense), ("head", h_head))
                  for p in ("input", "weight") for t in TOK]
    tab = pd.concat([table(), pd.DataFrame(split_rows, columns=["op", "seq_len", "budget", "latency_s"])])
    model = load_latency_model(Profile(table=tab, meta=meta(format_version=2), source="v2"), MODEL,
                               cluster(pp=2))
    lengths, k = (100, 300), 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a format-2 profile needs no note
        for stage in (0, 1):
            b = model.stage_time(lengths, k, stage, backward=True)
            i = model.stage_time(lengths, k, stage, backward=True, part="input")
            w = model.stage_time(lengths, k, stage, backward=True, part="weight")
            assert i + w == pytest.approx(b, rel=1e-12)
            attn = 3 * sum(2 * f_attn(L, k) for L in lengths)  # 3 layers per stage, all in I
            dense_w = 3 * g_dense(400) + (2 * e_embed(400) if stage == 0 else h_head(400))
            assert w == pytest.approx(dense_w, rel=1e-12)
            assert i == pytest.approx(attn + 3 * g_dense(400) + (h_head(400) if stage == 1 else 0.0),
                                      rel=1e-12)
    assert model.notes == []
    with pytest.raises(ConfigError, match="part must be one of input, weight"):
        model.dense(10, part="input")


def test_v_placement_puts_embedding_and_head_on_device_0():
    tied = ModelConfig(hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256,
                       block_size=32, tie_embeddings=True)
    model = load_latency_model(Profile(table=table(), meta=meta(), source="x"), tied,
                               cluster(pp=2, dp=2, schedule="zbv", virtual_stages=2))
    # vstages 0 and 3 (two layers each) on device 0, with the embedding, the final norm and the tied head
    assert model.stage_params(0) == 4 * PARAMS_PER_LAYER + EMBED + 64
    assert model.stage_params(1) == 4 * PARAMS_PER_LAYER


def test_tp_allreduces_are_added_to_a_shard_profile_only():
    """A measured profile at tp = 2 (one shard, no communication): each layer gets 2 all-reduces
    forward and 2 in the backward's input part, ring cost by hand; an analytical one is as is."""
    c = cluster(tp=2, tp_bandwidth=1e9, tp_latency=3e-6)
    shard = load_latency_model(Profile(table=table(), meta=meta(tp=2), source="s"), MODEL, c)
    ar = 3e-6 + 2 * 1 / 2 * 1024 * 64 * 2 / 1e9
    assert shard.tp_allreduce_time(1024) == pytest.approx(ar, rel=1e-12)
    assert shard.dense(1024) == pytest.approx(g_dense(1024) + 2 * ar, rel=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the derived split's note
        assert shard.dense(1024, backward=True, part="input") == pytest.approx(g_dense(1024) + 2 * ar, rel=1e-12)
        assert shard.dense(1024, backward=True, part="weight") == pytest.approx(g_dense(1024), rel=1e-12)
    assert shard.dense(1024, backward=True) == pytest.approx(2 * g_dense(1024) + 2 * ar, rel=1e-12)
    # micro-batch latency (fused fast path and vectorised) carries the same 4 all-reduces per layer
    plain = load_latency_model(Profile(table=table(), meta=meta(tp=2, tp_comm_included=True), source="p"),
                               MODEL, c)
    lat = shard.microbatch_latency((200, 300), 4)
    assert lat == pytest.approx(plain.microbatch_latency((200, 300), 4) + 6 * 4 * shard.tp_allreduce_time(500),
                                rel=1e-12)
    assert shard.microbatch_latencies([(200, 300)], 4)[0] == pytest.approx(lat, rel=1e-12)


def test_recompute_prices_the_forward_again_in_the_backward_by_hand():
    """cluster.recompute: selective adds one attention forward per layer to each backward, full also
    one dense forward per layer; forwards, embedding and head unchanged; the policies' fused
    micro-batch latency gains exactly the same (docs/costmodel.md, 'Recomputation')."""
    lengths, T = [100, 300], 400
    att = {L: f_attn(L, min(4, math.ceil(L / 32))) for L in lengths}  # budget 4
    base, sel, full = lm(), lm(recompute="selective"), lm(recompute="full")
    again_attn = 3 * sum(att.values())  # 3 layers per stage
    for s in (0, 1):
        f = base.stage_time(lengths, 4, s, backward=False)
        b = base.stage_time(lengths, 4, s, backward=True)
        assert sel.stage_time(lengths, 4, s, backward=False) == f == full.stage_time(lengths, 4, s, backward=False)
        assert sel.stage_time(lengths, 4, s, backward=True) == pytest.approx(b + again_attn, rel=1e-12)
        assert full.stage_time(lengths, 4, s, backward=True) == pytest.approx(
            b + again_attn + 3 * g_dense(T), rel=1e-12)
        # the split backward: the forward again is in the input part; the weight part is unchanged
        w = base.stage_time(lengths, 4, s, backward=True, part="weight")
        assert full.stage_time(lengths, 4, s, backward=True, part="weight") == w
        assert full.stage_time(lengths, 4, s, backward=True, part="input") == pytest.approx(
            base.stage_time(lengths, 4, s, backward=True, part="input") + again_attn + 3 * g_dense(T), rel=1e-12)
    whole = base.microbatch_latency(lengths, 4)
    assert sel.microbatch_latency(lengths, 4) == pytest.approx(whole + 6 * sum(att.values()), rel=1e-12)
    assert full.microbatch_latency(lengths, 4) == pytest.approx(
        whole + 6 * sum(att.values()) + 6 * g_dense(T), rel=1e-12)
    got = full.microbatch_latencies([lengths, [64]], [4, 2])
    assert got[0] == pytest.approx(full.microbatch_latency(lengths, 4), rel=1e-12)


def test_full_recompute_runs_the_forward_tp_all_reduces_again():
    """A measured one-shard profile at tp 2: the model adds 2 TP all-reduces per layer forward, 2 per
    backward, and under full recomputation the forward's 2 again in the backward."""
    m2 = meta(tp=2)
    base = load_latency_model(Profile(table=table(), meta=m2, source="x"), MODEL, cluster(tp=2))
    full = load_latency_model(Profile(table=table(), meta=m2, source="x"), MODEL, cluster(tp=2, recompute="full"))
    ar = base.tp_allreduce_time(500)
    assert ar > 0
    assert full.dense(500) == base.dense(500) == pytest.approx(g_dense(500) + 2 * ar, rel=1e-12)
    assert full.dense(500, backward=True) == pytest.approx(2 * g_dense(500) + g_dense(500) + 4 * ar, rel=1e-12)
    assert full.dense(500, backward=True, part="weight") == base.dense(500, backward=True, part="weight")
    assert full.microbatch_latency([500], 1) == pytest.approx(
        base.microbatch_latency([500], 1) + 6 * (f_attn(500, 1) + g_dense(500) + 2 * ar), rel=1e-12)


def test_recompute_field_reads_old_booleans_and_refuses_other_values():
    from sparsebalance.configmap import from_mapping

    assert from_mapping(ClusterConfig, {"recompute": True}, "cluster").recompute == "full"
    assert from_mapping(ClusterConfig, {"recompute": False}, "cluster").recompute == "none"
    with pytest.raises(ConfigError, match="cluster.recompute: 'some' is not allowed; choose one of none, selective, full"):
        from_mapping(ClusterConfig, {"recompute": "some"}, "cluster")


def test_grad_sync_buckets_against_the_closed_form_and_zero1_collectives():
    """Bucketed reduction overlapped with the last backward action of length W: equal buckets
    (n_b, T seconds in all) leave max(T / n_b, T - W (n_b - 1) / n_b) exposed; ZeRO-1 replaces the
    all-reduce by a reduce-scatter ((n-1)/n x bytes / bw) and adds the parameters' all-gather."""
    p0 = 3 * PARAMS_PER_LAYER + EMBED  # stage 0's parameters (tp 1)
    bucket = p0 // 4 + 1  # four buckets: three full ones and a smaller last one
    plain, ov = lm(), lm(dp_overlap=True, grad_bucket_params=bucket)
    ring = 2 * 3 / 4 * p0 * 2 / 2e10 + 7e-6
    assert plain.allreduce_time(0) == pytest.approx(ring, rel=1e-12)
    n_b = 4
    a = [2 * 3 / 4 * p * 2 / 2e10 + 7e-6 for p in (bucket, bucket, bucket, p0 - 3 * bucket)]
    total = sum(a)
    assert ov.allreduce_time(0) == pytest.approx(total, rel=1e-12)  # 4 latencies, not one
    for window in (0.0, 1e-6, 1e-5, 1e-4, 1.0):  # comm-bound and compute-bound
        ready = [window * min(1.0, (i + 1) * bucket / p0) for i in range(n_b)]
        end = 0.0
        for r, sec in zip(ready, a):  # brute force: collectives one at a time
            end = max(end, r) + sec
        assert ov.grad_sync_exposed(0, window) == pytest.approx(max(0.0, end - window), rel=1e-12, abs=1e-15)
    eq = lm(dp_overlap=True, grad_bucket_params=p0 // 2 + p0 % 2)  # two (almost) equal buckets
    t, w = eq.allreduce_time(0), 3e-5
    assert eq.grad_sync_exposed(0, w) == pytest.approx(max(t / 2, t - w / 2), rel=1e-6)
    assert lm(dp_overlap=True).grad_sync_exposed(0, 1.0) == pytest.approx(ring, rel=1e-12)  # default: 1 bucket
    z = lm(zero1=True, optim=True)
    assert z.allreduce_time(0) == pytest.approx(3 / 4 * p0 * 2 / 2e10 + 7e-6, rel=1e-12)
    shard = round(p0 / 4)
    step = 1e-4 + (shard - 100_000) * (1e-3 - 1e-4) / 900_000  # the optim rows, linear
    assert z.optimizer_time(0) == pytest.approx(step + 3 / 4 * p0 * 2 / 2e10 + 7e-6, rel=1e-9)
    assert lm(zero1=True, dp=1).optimizer_time(0) == lm(dp=1).optimizer_time(0)


@pytest.mark.parametrize("field,value", [("grad_bucket_params", 0), ("grad_bucket_params", 1.5),
                                         ("dp_overlap", "yes")])
def test_bad_gradient_sync_fields(field, value):
    with pytest.raises(ConfigError, match=field):
        cluster(**{field: value})


def test_gradients_reduced_in_fp32_double_the_ring_bytes():
    p0 = 3 * PARAMS_PER_LAYER + EMBED
    assert lm(grad_reduce_bytes=4).allreduce_time(0) == pytest.approx(2 * 3 / 4 * p0 * 4 / 2e10 + 7e-6, rel=1e-12)
    with pytest.raises(ConfigError, match="grad_reduce_bytes: 3 is not allowed"):
        cluster(grad_reduce_bytes=3)


def test_an_attention_call_is_paid_once_per_packed_microbatch():
    """An analytical profile's rows leave out the call's fixed seconds (the launches every call makes:
    kernelcost.call_fixed) and the model adds them once per layer and micro-batch, however many
    sequences it packs: stage times, the fused micro-batch latency and the arrays agree."""
    from sparsebalance.simulator.cost.kernelcost import call_fixed
    from sparsebalance.simulator.cost.roofline import H200

    model = load_latency_model("analytical-h200", MODEL, cluster(tp=1, device="h200"))
    assert model.call == {False: call_fixed(H200), True: call_fixed(H200, backward=True)}
    assert model.call[False] == 1 * H200.launch_overhead and model.call[True] == 4 * H200.launch_overhead
    lengths = [128] * 8  # eight short sequences in one micro-batch: one call, not eight
    for bw in (False, True):
        attn = sum(model.attention(L, 2, backward=bw) for L in lengths) + model.call[bw]
        want = 3 * attn + 3 * model.dense(1024, backward=bw) + model.embed(1024, backward=bw)  # stage 0
        assert model.stage_time(lengths, 2, 0, backward=bw) == pytest.approx(want, rel=1e-12)
    whole = sum(model.stage_time(lengths, 2, s, backward=b) for s in (0, 1) for b in (False, True))
    assert model.microbatch_latency(lengths, 2) == pytest.approx(whole, rel=1e-12)
    arr = model.stage_times([tuple(lengths), (4000,)], [2, 2])
    assert arr["B"][0, 0] == model.stage_time(lengths, 2, 0, backward=True)  # bit for bit
    assert model.microbatch_latencies([lengths, [4000]], 2)[0] == pytest.approx(whole, rel=1e-12)
    # a measured table's rows include the call (one sequence per timed call): nothing is added
    assert lm().call == {False: 0.0, True: 0.0}
    full = load_latency_model("analytical-h200", MODEL, cluster(tp=1, device="h200", recompute="full"))
    assert full.call[True] == pytest.approx(model.call[True] + model.call[False], rel=1e-15)


@pytest.mark.parametrize("window", [1e-5, 3e-5, 1e-3])
def test_overlapped_zero1_gather_against_the_closed_form(window):
    """--overlap-param-gather: n_b equal buckets of gather g each under a first forward of W seconds
    leave max(g, n_b g - W (n_b - 1) / n_b) exposed (the gradient buckets' closed form, mirrored), and
    the optimizer step no longer carries the gather."""
    p0 = 3 * PARAMS_PER_LAYER + EMBED
    assert p0 % 4 == 0
    z = lm(zero1=True, param_gather_overlap=True, grad_bucket_params=p0 // 4, optim=True)
    g = 3 / 4 * (p0 // 4) * MODEL.dtype_bytes / 2e10 + 7e-6
    assert z.param_gather_exposed(0, window) == pytest.approx(max(g, 4 * g - window * 3 / 4), rel=1e-9)
    plain = lm(zero1=True, optim=True)
    assert z.optimizer_time(0) == pytest.approx(plain.optimizer_time(0) - (3 / 4 * p0 * MODEL.dtype_bytes / 2e10 + 7e-6),
                                                rel=1e-9)
    assert lm(zero1=True).param_gather_exposed(0, window) == 0.0
    with pytest.raises(ConfigError, match="param_gather_overlap"):
        cluster(param_gather_overlap=True)
