"""StageCost, the array form of the stage cost, against the scalar ``LatencyModel.stage_time`` it
must equal bit for bit (the executor, dst-cp's stage tables and sab-order read only the arrays)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.config import h200_4x8, qwen25_3b
from sparsebalance.simulator.cost.latency import load_latency_model
from sparsebalance.simulator.cost.query import ScalarStageLatency


def _model(**cluster):
    cl = replace(h200_4x8(), **cluster)
    return load_latency_model("analytical-h200", qwen25_3b(), cl, extrapolate="clamp"), cl


def _microbatches(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return [tuple(int(x) for x in rng.integers(64, 40_000, rng.integers(1, 5))) for _ in range(n)]


@pytest.mark.parametrize("cluster", [{"pp": 4, "dp": 2, "tp": 2}, {"pp": 2, "dp": 2, "tp": 1, "schedule": "interleaved",
                                                                      "virtual_stages": 3, "global_batch": 16}])
def test_arrays_equal_stage_time_bitwise(cluster):
    lm, cl = _model(**cluster)
    rng = np.random.default_rng(1)
    mbs = _microbatches(1, 40)
    ks = [int(k) for k in rng.integers(1, 70, len(mbs))]
    got = lm.stage_times(mbs, ks, ("F", "B", "I", "W"))
    pp = cl.pp
    for mode, (bw, part) in {"F": (False, None), "B": (True, None), "I": (True, "input"),
                             "W": (True, "weight")}.items():
        want = np.array([[lm.stage_time(mb, k, vs % pp, backward=bw, chunk=vs // pp, part=part)
                          for mb, k in zip(mbs, ks)] for vs in range(pp * cl.virtual_stages)])
        assert got[mode].shape == want.shape and np.array_equal(got[mode], want), mode


def test_per_layer_budgets_take_stage_time_itself():
    lm, cl = _model(pp=4, dp=2, tp=2)
    rng = np.random.default_rng(2)
    mbs = _microbatches(2, 6)
    budgets = [Budget.per_layer(int(x) for x in rng.integers(1, 40, lm.model.layers)) for _ in mbs]
    budgets[2] = 7  # ints and per-layer budgets mixed
    got = lm.stage_times(mbs, budgets, ("F", "B"))
    for vs in range(cl.pp):
        for i, (mb, b) in enumerate(zip(mbs, budgets)):
            assert got["B"][vs, i] == lm.stage_time(mb, b, vs, backward=True)


def test_weight_part_has_no_attention_and_compose_adds_it_per_layer():
    lm, _ = _model(pp=4, dp=2, tp=2)
    mbs = _microbatches(3, 5)
    tokens = np.array([sum(mb) for mb in mbs])
    w = lm.cost.compose(np.zeros(len(mbs)), tokens, backward=True, part="weight")
    hi = lm.stage_times(mbs, [64] * len(mbs), ("W",))["W"]
    lo = lm.stage_times(mbs, [1] * len(mbs), ("W",))["W"]
    assert np.array_equal(w, hi) and np.array_equal(hi, lo)  # budget-free
    a = lm.cost.attention_sums(np.array([L for mb in mbs for L in mb]), np.array([len(mb) for mb in mbs]),
                               np.full(sum(len(mb) for mb in mbs), 5), backward=False)
    f = lm.cost.compose(a, tokens, backward=False)
    f0 = lm.cost.compose(np.zeros(len(mbs)), tokens, backward=False)
    assert np.allclose(f - f0, lm.cost.layers[:, None] * a, rtol=1e-12, atol=0)


def test_scalar_stage_latency_fills_every_virtual_stage_and_mode():
    class Linear(ScalarStageLatency):
        def __init__(self, cluster):
            self.cluster = cluster

        def stage_time(self, lengths, budget, stage, *, backward, chunk=0, part=None):
            return sum(lengths) * (1 + stage + 10 * chunk) * (2 if backward else 1) * (0.5 if part else 1) + budget

    _, cl = _model(pp=2, dp=2, tp=1, schedule="interleaved", virtual_stages=2, global_batch=16)
    got = Linear(cl).stage_times([(100,), (10, 20)], [3, 4], ("F", "I"))
    assert got["F"].tolist() == [[103, 34], [203, 64], [1103, 334], [1203, 364]]
    assert got["I"].tolist() == [[103, 34], [203, 64], [1103, 334], [1203, 364]]


TOTAL_CASES = {  # profile, model, cluster overrides: each term and fold the totals must carry
    "tp2 measured shard, full recompute": ("cpu-tiny-tp2", "tiny", {"pp": 2, "dp": 1, "tp": 2, "recompute": "full"}),
    "interleaved, selective": ("analytical-h200", "qwen2.5-3b", {"pp": 2, "dp": 2, "tp": 1, "schedule": "interleaved",
                                                                 "virtual_stages": 3, "global_batch": 16,
                                                                 "recompute": "selective"}),
    "cp4 ring": ("analytical-h200", "qwen2.5-3b", {"pp": 2, "dp": 1, "tp": 1, "cp": 4, "cp_layout": "zigzag",
                                                   "cp_comm": "ring", "global_batch": 4}),
    "cp16 per sequence": ("analytical-h200", "qwen2.5-3b", {"pp": 2, "dp": 1, "tp": 1, "cp": 16, "global_batch": 4,
                                                            "cp_layout": "best", "cp_comm": "hierarchical",
                                                            "cp_split": "per-sequence"}),
}


@pytest.mark.parametrize("case", list(TOTAL_CASES))
def test_whole_model_total_is_the_sum_of_its_stages(case):
    """What the policies balance (one micro-batch's forward + backward over the whole model, from
    pre-summed tables) is the stages' times summed: a term added to a stage but not to the totals
    (or the other way round) fails here."""
    from sparsebalance.simulator.config import cluster_from_mapping, model_from_mapping

    profile, preset, over = TOTAL_CASES[case]
    model = model_from_mapping({"preset": preset})
    cl = cluster_from_mapping({"preset": "h200-4x8"} | over)
    lm = load_latency_model(profile, model, cl, extrapolate="clamp", allow_nonmonotone=True)
    rng = np.random.default_rng(5)
    hi = 3000 if preset == "tiny" else 200_000
    mbs = [tuple(int(x) for x in rng.integers(100, hi, rng.integers(1, 4))) for _ in range(12)]
    ks = [int(k) for k in rng.integers(1, 40, len(mbs))]
    st = lm.stage_times(mbs, ks, ("F", "B"))
    want = st["F"].sum(axis=0) + st["B"].sum(axis=0)
    assert lm.microbatch_latencies(mbs, ks) == pytest.approx(want, rel=1e-11)
    assert [lm.microbatch_latency(mb, k) for mb, k in zip(mbs, ks)] == pytest.approx(want, rel=1e-11)


def test_budget_free_part_is_the_stage_less_its_attention():
    lm, _ = _model(pp=4, dp=2, tp=2)
    mbs = _microbatches(6, 8)
    tokens = np.array([sum(mb) for mb in mbs])
    lengths, counts = np.array([L for mb in mbs for L in mb]), np.array([len(mb) for mb in mbs])
    for bw in (False, True):
        a1 = lm.cost.attention_sums(lengths, counts, np.ones_like(lengths), backward=bw)
        a9 = lm.cost.attention_sums(lengths, counts, np.full_like(lengths, 9), backward=bw)
        free = lm.cost.budget_free(a1, tokens, backward=bw)
        assert np.allclose(free, lm.cost.budget_free(a9, tokens, backward=bw), rtol=1e-12, atol=0)
        at9 = lm.stage_times(mbs, [9] * len(mbs), ("B" if bw else "F",))["B" if bw else "F"]
        assert np.allclose(free + lm.cost.layers[:, None] * a9, at9, rtol=1e-12, atol=0)


def test_a_term_priced_in_stagecost_alone_reaches_every_consumer(monkeypatch):
    """docs/architecture.md, "Adding a cost term": a made-up per-layer term (EXTRA seconds per token
    in each pass, say an FSDP gather) written into StageCost only -- the dense term, its array twin
    and the whole-model share the pre-summed table does not hold -- is in the executor's stage
    times, the scalar stage_time, the policies' whole-model totals and the budget-free split."""
    from sparsebalance.simulator.cost.stagecost import StageCost

    extra = 1e-8
    before, _ = _model(pp=4, dp=2, tp=2)
    mbs = _microbatches(7, 10)
    ks = [5] * len(mbs)
    tokens = np.array([sum(mb) for mb in mbs])
    old = before.stage_times(mbs, ks)
    dense, many, untabled = StageCost.dense, StageCost.per_token_many, StageCost.whole_untabled

    def with_term(self, tokens, *, backward=False, part=None):
        return dense(self, tokens, backward=backward, part=part) + (extra * tokens if part != "weight" else 0.0)

    def many_with_term(self, name, tokens, *, backward=False, part=None):
        out = many(self, name, tokens, backward=backward, part=part)
        return out + extra * np.asarray(tokens) if name == "layer" and part != "weight" else out

    def untabled_with_term(self, tokens):
        rest = untabled(self, tokens)
        return self.model_layers * 2 * extra * tokens + (0.0 if rest is None else rest)

    monkeypatch.setattr(StageCost, "dense", with_term)
    monkeypatch.setattr(StageCost, "per_token_many", many_with_term)
    monkeypatch.setattr(StageCost, "whole_untabled", untabled_with_term)
    after, _ = _model(pp=4, dp=2, tp=2)
    new = after.stage_times(mbs, ks)
    for mode in ("F", "B"):
        assert np.allclose(new[mode] - old[mode], after.cost.layers[:, None] * extra * tokens, rtol=1e-9, atol=0)
    assert after.stage_time(mbs[0], 5, 1, backward=True) == new["B"][1, 0]
    total = new["F"].sum(axis=0) + new["B"].sum(axis=0)
    assert after.microbatch_latencies(mbs, ks) == pytest.approx(total, rel=1e-11)
    assert after.microbatch_latency(mbs[0], 5) == pytest.approx(total[0], rel=1e-11)
    a = after.cost.attention_sums(np.array([L for mb in mbs for L in mb]), [len(mb) for mb in mbs],
                                  np.full(sum(len(mb) for mb in mbs), 5), backward=False)
    assert np.allclose(after.cost.budget_free(a, tokens, backward=False) + after.cost.layers[:, None] * a,
                       new["F"], rtol=1e-12, atol=0)
