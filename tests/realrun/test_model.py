"""The Qwen2 + MoBA model, packing, stage split and realrun config (single process, fast)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsebalance.errors import ConfigError
from sparsebalance.kernels.qwen2 import MobaArgs, build_qwen2, full_forward_loss, pack
from sparsebalance.realrun.stage import build_stage
from sparsebalance.simulator.config import tiny
from sparsebalance.simulator.layout import split_layers


def _seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n) for n in lengths]


def test_pack_by_hand():
    b = pack([np.array([5, 6, 7]), np.array([9, 8])])
    assert b.input_ids.tolist() == [[5, 6, 7, 9, 8]]
    assert b.labels.tolist() == [[6, 7, -100, 8, -100]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert b.cu_seqlens.tolist() == [0, 3, 5] and b.cu_seqlens.dtype == torch.int32
    assert b.label_tokens == 3


def test_pack_with_given_labels_and_the_message_counts_them():
    """A sequence that names its labels (answer-only targets) keeps them; one that does not gets the
    next tokens; the iteration's loss divisor counts the labelled positions."""
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.realrun.runtime import make_message
    from sparsebalance.simulator.plan import Plan, uniform_budgets

    b = pack([np.array([5, 6, 7]), np.array([9, 8, 4])], labels=[None, np.array([-100, 3, -100])])
    assert b.labels.tolist() == [[6, 7, -100, -100, 3, -100]] and b.label_tokens == 3
    with pytest.raises(ValueError, match="label"):
        pack([np.array([5, 6, 7])], labels=[np.array([1, 2])])
    seqs = [Sequence(id=1, length=3, tokens=np.array([5, 6, 7])),
            Sequence(id=2, length=3, tokens=np.array([9, 8, 4]), labels=np.array([-100, 3, -100]))]
    plan = Plan.from_lists([[seqs]])
    msg = make_message(0, plan, uniform_budgets(plan, 2))
    assert msg.label_tokens == 2 + 1
    assert len(msg.ranks[0][0][0]) == 2 and msg.ranks[0][0][1][2].tolist() == [-100, 3, -100]
    with pytest.raises(ValueError, match="labels"):
        Sequence(id=3, length=3, tokens=np.array([1, 2, 3]), labels=np.array([1]))


def test_full_budget_packed_equals_hf_dense_per_sequence():
    # MoBA with top-k >= number of blocks is dense causal attention: compare against HF's own sdpa
    # path run on each sequence alone (independent code path, float64)
    net = build_qwen2(tiny(), seed=1, dtype="float64")
    seqs = _seqs([70, 33, 101])
    b = pack(seqs)
    loss = full_forward_loss(net, b, MobaArgs(cu_seqlens=b.cu_seqlens, budget=64, block_size=32))
    net.config._attn_implementation = "sdpa"
    ref = 0.0
    with torch.no_grad():
        for s in seqs:
            x = torch.tensor(s)[None]
            lg = net(input_ids=x).logits[0]
            ref += float(torch.nn.functional.cross_entropy(lg[:-1], x[0, 1:], reduction="sum"))
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-10)


def test_packed_budget_equals_separate_runs():
    # a micro-batch's budget applies to every sequence packed in it, each attending only itself
    net = build_qwen2(tiny(), seed=2, dtype="float64")
    seqs = _seqs([130, 97], seed=3)
    b = pack(seqs)
    packed = full_forward_loss(net, b, MobaArgs(cu_seqlens=b.cu_seqlens, budget=1, block_size=32))
    alone = 0.0
    for s in seqs:
        bi = pack([s])
        alone += float(full_forward_loss(net, bi, MobaArgs(cu_seqlens=bi.cu_seqlens, budget=1,
                                                           block_size=32)).detach())
    assert float(packed.detach()) == pytest.approx(alone, rel=1e-10)
    # and the budget matters: top-1 differs from dense on a sequence with several blocks
    dense = float(full_forward_loss(net, b, MobaArgs(cu_seqlens=b.cu_seqlens, budget=64,
                                                     block_size=32)).detach())
    assert abs(dense - float(packed.detach())) > 1e-6


def test_per_layer_budget_tuple_selects_by_layer():
    net = build_qwen2(tiny(), seed=4, dtype="float64")
    b = pack(_seqs([200], seed=5))
    def run(budget):
        return float(full_forward_loss(net, b, MobaArgs(cu_seqlens=b.cu_seqlens, budget=budget,
                                                        block_size=32)).detach())
    assert run((2, 2, 2, 2)) == pytest.approx(run(2), rel=1e-12)
    assert run((2, 64, 64, 64)) != pytest.approx(run(64), rel=1e-9)


@pytest.mark.parametrize("pp", [2, 3])
def test_stages_chained_equal_full_model(pp):
    net = build_qwen2(tiny(), seed=6, dtype="float64")
    b = pack(_seqs([90, 40], seed=7))
    moba = MobaArgs(cu_seqlens=b.cu_seqlens, budget=2, block_size=32)
    full = float(full_forward_loss(net, b, moba).detach())
    h = None
    for s in range(pp):
        h = build_stage(net, s, pp, split_layers(4, pp)[s])(h, b, moba)
    assert float(h.detach()) == pytest.approx(full, rel=1e-12)
    names = set()
    for s in range(pp):
        names |= set(build_stage(net, s, pp, split_layers(4, pp)[s]).global_state_dict())
    assert names == set(net.state_dict())


def _cfg(**realrun):
    from sparsebalance.runconfig import run_config_from_mapping

    return run_config_from_mapping({
        "model": {"preset": "tiny"}, "cluster": {"pp": 2, "dp": 1, "global_batch": 4},
        "data": {"source": "text_dir", "path": "stdlib"}, "realrun": realrun})


@pytest.mark.parametrize("table,field", [
    ({"backend": "mpi"}, "realrun.backend"),
    ({"backend": "nccl"}, "realrun.backend"),
    ({"attention_backend": "flash"}, "realrun.attention_backend"),
    ({"layer_impl": "fused"}, "realrun.layer_impl"),
    ({"coverage_layer": 4}, "realrun.coverage_layer"),
    ({"threads": 0}, "realrun.threads"),
    ({"fail_rank": 2}, "realrun.fail_rank"),
    ({"lrr": 1.0}, "realrun.lrr"),
])
def test_bad_realrun_config_names_field(table, field):
    from sparsebalance.realrun.config import realrun_config

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        realrun_config(_cfg(**table))


def test_bad_cluster_for_realrun():
    from sparsebalance.realrun.config import realrun_config
    from sparsebalance.runconfig import run_config_from_mapping

    cfg = run_config_from_mapping({"model": {"preset": "tiny"},
                                   "cluster": {"pp": 2, "schedule": "dualpipev", "virtual_stages": 2,
                                               "global_batch": 8},
                                   "data": {"source": "text_dir", "path": "stdlib"}})
    with pytest.raises(ConfigError, match="cluster.schedule"):  # V placement: simulated only
        realrun_config(cfg)
    cfg = run_config_from_mapping({"model": {"preset": "tiny"}, "cluster": {"pp": 5, "global_batch": 5},
                                   "data": {"source": "text_dir", "path": "stdlib"}})
    with pytest.raises(ConfigError, match="cluster.pp"):
        realrun_config(cfg)
    cfg = run_config_from_mapping({"model": {"preset": "tiny"}, "cluster": {"pp": 2, "global_batch": 4}})
    with pytest.raises(ConfigError, match="data.source"):
        realrun_config(cfg)


def test_plans_json_round_trip():
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.realrun.results import load_plans, plans_to_json
    from sparsebalance.simulator.plan import Budget, Plan

    plan = Plan.from_lists([[[Sequence(id=3, length=10), Sequence(id=5, length=7)], [Sequence(id=1, length=4)]]])
    bud = ((Budget.uniform(2), Budget.per_layer((1, 2, 3, 4))),)
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "plans.json"
        p.write_text(json.dumps(plans_to_json([plan], [bud])))
        plans, buds = load_plans(p)
    assert plans[0] == plan and buds[0] == bud
