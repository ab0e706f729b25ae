"""The measured accuracy experiment end to end on two gloo workers: each arm trains exactly as a
single process trains the same plans (its own weights and optimizer despite the interleaving), its
held-out accuracy and training scores are that model's; the arms, the config checks, and one line for
bad input. A random-initialised long-context checkpoint stands in for the shipped one."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsebalance import cli
from sparsebalance.accuracy import model as M
from sparsebalance.accuracy.measured import MeasuredConfig, arms
from sparsebalance.data.recall import RecallConfig
from sparsebalance.errors import ConfigError

TASK = RecallConfig(min_length=96, max_length=400, tail=1.0)
EXP = """profile = "cpu-tiny"
buckets = [128, 256]
heldout = 3
k0 = 4
pool = 24
global_batch = 4
iterations = 3
warmup = 2
lr = 3e-3
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    net = M.NetConfig(rope_theta=1e6, max_positions=512, seed=5)
    M.save(path, M.build(net), net, TASK, {"coverage_rate": 1.2, "coverage_layer": 2, "seed": 0,
                                           "command": "test fixture"})
    return path


@pytest.fixture(scope="module")
def run(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    exp = out / "exp.toml"
    exp.write_text(EXP)
    rc = cli.main(["accuracy", "--quick", "--checkpoint", str(ckpt), "--config", str(exp),
                   "--iterations", "3", "--out", str(out / "r"), "--force", "--no-progress"])
    assert rc == 0
    return out / "r"


def _reference(ckpt_path, arm_plans, cfg: MeasuredConfig, seed: int):
    """One process: the checkpoint trained on an arm's plans and budgets (answer-only labels, loss over
    the global batch's answers, clip 1, AdamW (0.9, 0.98) with the warm-up), then scored held-out."""
    from sparsebalance.accuracy.executor import count_right, forward, pack_answers
    from sparsebalance.accuracy.lead import lr_schedule, training_pool
    from sparsebalance.data.recall import Example, RecallTask
    from sparsebalance.kernels.qwen2 import lm_loss_sum
    from sparsebalance.realrun.results import load_plans

    c = M.load(ckpt_path)
    model = c.load_model()
    task = RecallTask(c.task)
    seqs = {s.id: s for s in training_pool(task, cfg, seed)}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    plans, budgets = load_plans(arm_plans)
    lr_at, losses = lr_schedule(cfg), []
    for i, (plan, bud) in enumerate(zip(plans, budgets, strict=True)):
        for g in opt.param_groups:
            g["lr"] = lr_at(i)
        opt.zero_grad(set_to_none=True)
        answers = sum(int((seqs[s.id].labels != -100).sum()) for s in plan.sequences())
        total = 0.0
        for r, j, mb in plan.microbatches():
            exs = [Example(tokens=seqs[s.id].tokens, positions=np.flatnonzero(seqs[s.id].labels != -100))
                   for s in mb.sequences]
            batch = pack_answers(exs)
            logits, _ = forward(model, batch, bud[r][j], c.net.dims.block_size)
            loss = lm_loss_sum(logits[None], batch.labels) / answers
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    held = {b: count_right(model, task.heldout(b, cfg.heldout), cfg.k0, c.net.dims.block_size)
            for b in cfg.buckets}
    return losses, held


def test_each_arm_trains_as_one_process_and_scores_that_model(run, ckpt):
    from sparsebalance.configmap import from_mapping

    spec = json.loads((run / "seeds" / "seed0" / "spec.json").read_text())
    cfg = from_mapping(MeasuredConfig, spec["experiment"], "experiment")
    assert [a["name"] for a in spec["arms"]] == ["fixed", "MEAN0.1"]
    its = [json.loads(x) for x in (run / "seeds" / "seed0" / "iterations.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (run / "seeds" / "seed0" / "heldout.jsonl").read_text().splitlines()]
    for arm in ("fixed", "MEAN0.1"):
        losses, counts = _reference(ckpt, run / "seeds" / "seed0" / "plans" / f"{arm}.json", cfg, 0)
        mine = sorted((r for r in its if r["arm"] == arm), key=lambda r: r["iteration"])
        assert [r["iteration"] for r in mine] == [0, 1, 2]
        np.testing.assert_allclose([r["loss"] for r in mine], losses, rtol=2e-4)
        for b in cfg.buckets:
            row = next(h for h in held if h["arm"] == arm and h["bucket"] == b)
            assert (row["right"], row["total"]) == counts[b]
        assert all(0 <= r["answer_accuracy"] <= 1 and r["iteration_time_s"] > 0 and r["predicted_s"] > 0
                   for r in mine)
    # the arms saw the same global batches, in the same order
    a = [r["tokens"] for r in sorted((r for r in its if r["arm"] == "fixed"), key=lambda r: r["iteration"])]
    b = [r["tokens"] for r in sorted((r for r in its if r["arm"] == "MEAN0.1"), key=lambda r: r["iteration"])]
    assert a == b


def test_outputs_and_resume(run, ckpt, capsys):
    import pandas as pd

    s = pd.read_csv(run / "summary.csv")
    assert set(s.arm) == {"fixed", "MEAN0.1"} and set(s.bucket) == {128, 256}
    fixed = s[s.arm == "fixed"].iloc[0]
    assert fixed.measured_speedup == 1.0 and fixed.accuracy_vs_fixed == 0.0
    for f in ("summary.md", "accuracy_at_speed.png", "accuracy_at_speed.svg", "per_seed.csv", "config.json"):
        assert (run / f).is_file()
    host = json.loads((run / "seeds" / "seed0" / "host.json").read_text())
    assert host["wall_s"] > 0
    # --resume keeps the finished seed: no launch, the same summary
    exp = run.parent / "exp.toml"
    assert cli.main(["accuracy", "--quick", "--checkpoint", str(ckpt), "--config", str(exp), "--iterations", "3",
                     "--out", str(run), "--resume", "--json", "--no-progress"]) == 0
    assert "already in" in capsys.readouterr().err
    # ... but not one run with another setting
    assert cli.main(["accuracy", "--quick", "--checkpoint", str(ckpt), "--config", str(exp), "--iterations", "3",
                     "--k0", "5", "--out", str(run), "--resume", "--json", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0] and "k0" in err[0]


def test_arms_of_the_grid():
    names = [a.name for a in arms(MeasuredConfig())]
    assert names[0] == "fixed" and "SAB-fixed" in names and names[-1] == "FREE"
    assert [n for n in names if n.endswith("MAX")] == ["MAX", "LBB-MAX"]  # MAX once: p never binds it
    assert {"MEAN0.1", "MIN0.3", "LBB-MEAN0.2", "LBB-MIN0.1", "fixed-dense"} <= set(names) and len(names) == 18
    dense = next(a for a in arms(MeasuredConfig()) if a.name == "fixed-dense")
    assert (dense.batching, dense.tuning) == ("lbb", "fixed-dense")
    free = next(a for a in arms(MeasuredConfig()) if a.name == "FREE")
    kw = free.policy_fields(MeasuredConfig(), 1.0)
    assert (kw["tuning"], kw["cp_rounds"], kw["cp_raise_tol"]) == ("dst-cp", 0, 0.0)


@pytest.mark.parametrize("kw,field", [({"iterations": 1}, "iterations"), ({"k_max": 8}, "k_max"),
                                      ({"batchings": ("sorted",)}, "batchings"), ({"base": ("dense",)}, "base"),
                                      ({"seeds": (1, 1)}, "seeds"), ({"pool": 4}, "pool"), ({"lr": float("nan")}, "lr")])
def test_bad_measured_config(kw, field):
    with pytest.raises(ConfigError, match=field):
        MeasuredConfig(**kw)


def test_bad_flags_are_one_line(ckpt, tmp_path, capsys):
    for argv, field in ((["--steps", "3"], "--steps"), (["--executor", "single", "--iterations", "3"], "--iterations"),
                        (["--buckets", "64,4096"], "buckets"), (["--anchors", "median"], "anchors")):
        assert cli.main(["accuracy", "--checkpoint", str(ckpt), "--out", str(tmp_path / "o"), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and field in err[0], err


def test_max_anchor_budgets_do_not_depend_on_p():
    """MAX's anchor is the slowest micro-batch at k0, so every k* >= k0 and the coverage floor (<= k0)
    never binds: the budgets are the same for any p (why the grid runs MAX once)."""
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.policies.base import PolicyContext
    from sparsebalance.policies.config import PolicyConfig
    from sparsebalance.policies.coverage import make_coverage_model
    from sparsebalance.policies.registry import make_batching, make_tuning
    from sparsebalance.simulator.config import ClusterConfig, tiny
    from sparsebalance.simulator.cost.latency import load_latency_model

    m = tiny()
    cl = ClusterConfig(name="cpu-pp2", device="cpu", pp=2, dp=1, global_batch=8)
    lat = load_latency_model("cpu-tiny", m, cl)
    rng = np.random.default_rng(0)
    batch = [Sequence(id=i, length=int(n), sensitivity=1.0) for i, n in enumerate(rng.integers(64, 4096, 8))]
    out = []
    for p in (0.1, 0.2, 0.3, 0.9):
        pol = PolicyConfig(batching="lbb", tuning="dst", anchor="max", p=p, k0=8, k_max=32, coverage_rate=0.5)
        ctx = PolicyContext(model=m, cluster=cl, policy=pol, latency=lat, coverage=make_coverage_model(m, pol))
        plan = make_batching(pol).plan(batch, ctx)
        out.append(make_tuning(pol).budgets(plan, ctx))
    assert all(o == out[0] for o in out) and min(b.mean() for r in out[0] for b in r) >= 8


def test_quick_stays_small():
    from sparsebalance.accuracy.measured import quick

    q = quick(MeasuredConfig())
    assert (q.seeds, q.anchors, q.ps, q.batchings, q.base) == ((0,), ("mean",), (0.1,), ("sab",), ())
    assert [a.name for a in arms(q)] == ["fixed", "MEAN0.1"] and q.iterations <= 4 and q.heldout <= 4
