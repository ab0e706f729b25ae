"""A training loss that turns NaN or infinite stops the run at that iteration (issue 23, item 4): one
line naming the iteration (and the rank and micro-batch), exit code 2 (a bad input: the same config
diverges again wherever it runs), the iterations before it written, the directory marked incomplete.
Checked on the loop with generated reports, on a real 2-process ``train`` (lr = 1e20: finite, so
accepted up front, and the weights overflow after the first step) and on the accuracy experiment."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sparsebalance.loop import NonFiniteLoss, global_batches, run_loop
from sparsebalance.realrun.runtime import check_reported_loss
from sparsebalance.realrun.worker import RankReport

SIM = """
name = "d"
iterations = {iterations}
profile = "analytical-h200"
[model]
preset = "tiny"
[cluster]
pp = 2
dp = 2
global_batch = 8
[data]
distribution = "chatqa2-like"
num_sequences = 32
max_length = 2048
"""


def _reports(rng: random.Random, pp: int, dp: int, bad: tuple[int, int] | None) -> list[RankReport]:
    """One report per rank; last stages carry a loss; ``bad`` = (rank, micro-batch) whose loss is
    non-finite (drawn NaN, +inf or -inf)."""
    reps = []
    for rank in range(pp * dp):
        d, s = divmod(rank, pp)
        rep = RankReport(rank=rank, dp_rank=d, stage=s, loss=rng.uniform(1, 9) if s == pp - 1 else 0.0)
        if bad is not None and rank == bad[0]:
            rep.loss, rep.nonfinite_microbatch = rng.choice([math.nan, math.inf, -math.inf]), bad[1]
        reps.append(rep)
    return reps


@pytest.mark.parametrize("seed", range(5))
def test_reported_loss_names_iteration_rank_and_microbatch(seed):
    rng = random.Random(seed)
    pp, dp = rng.randint(1, 4), rng.randint(1, 3)
    it = rng.randint(0, 10_000)
    check_reported_loss(it, _reports(rng, pp, dp, None), rng.uniform(1, 9))  # finite: no error
    rank = rng.randrange(pp * dp)
    mb = rng.randint(0, 15)
    reps = _reports(rng, pp, dp, (rank, mb))
    with pytest.raises(NonFiniteLoss) as e:
        check_reported_loss(it, reps, sum(r.loss for r in reps))
    d, s = divmod(rank, pp)
    assert f"at iteration {it} (rank {rank}: dp_rank {d}, stage {s}, micro-batch {mb})" in str(e.value)
    assert "realrun.lr" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_loop_stops_at_the_first_nonfinite_loss_and_keeps_the_iterations_before(tmp_path, k):
    """An executor whose reports turn NaN at iteration k: run_loop raises there, is never asked for
    iteration k + 1, and hands the k iterations before it (metrics, trace, plans) to the caller."""
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.runner import prepare
    from sparsebalance.simulator.engine.executor import SimulatorExecutor

    p = tmp_path / "run.toml"
    p.write_text(SIM.format(iterations=8))
    cfg = load_run_config(str(p), {})
    prep = prepare(cfg)
    sim = SimulatorExecutor(prep.latency, cfg.model, cfg.cluster, engine=cfg.engine)
    asked: list[int] = []

    class Diverging:
        name = "diverging"

        def execute(self, iteration, plan, budgets):
            asked.append(iteration)
            res = sim.execute(iteration, plan, budgets)
            reps = _reports(random.Random(iteration), cfg.cluster.pp, cfg.cluster.dp,
                            (1, 0) if iteration == k else None)
            res.extra = {**res.extra, "loss": sum(r.loss for r in reps)}
            check_reported_loss(iteration, reps, res.extra["loss"])
            return res

    batches = global_batches(prep.sequences, cfg.cluster.global_batch, shuffle=True,
                             rng=np.random.default_rng(0))
    with pytest.raises(NonFiniteLoss) as e:
        run_loop(batches=batches, batching=prep.batching, tuning=prep.tuning, executor=Diverging(),
                 ctx=prep.ctx, iterations=cfg.iterations, progress=False)
    assert asked == list(range(k + 1))
    assert f"at iteration {k} (rank 1" in str(e.value)
    part = e.value.partial
    assert list(part.metrics.get("iteration", pd.Series(dtype=int))) == list(range(k))
    assert len(part.plans) == len(part.budgets) == k
    assert part.metrics.get("loss", pd.Series(dtype=float)).map(math.isfinite).all()
    assert set(part.trace.get("iteration", pd.Series(dtype=int))) == set(range(k))


def test_diverged_real_run_stops_names_the_iteration_and_keeps_what_it_wrote(tmp_path):
    """2 CPU workers, lr = 1e20: iteration 0 is finite (no step yet), the step overflows the
    weights, a later iteration's loss is NaN."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from faultkit import sparsebalance

    cfg = tmp_path / "run.toml"
    cfg.write_text(SIM.format(iterations=4).replace("dp = 2\n", "").replace("global_batch = 8", "global_batch = 4")
                   .replace('distribution = "chatqa2-like"', 'source = "text_dir"\npath = "stdlib"')
                   .replace("max_length = 2048", "max_length = 128") + "[realrun]\ntimeout_s = 60\n")
    out = tmp_path / "out"
    p = sparsebalance("train", "--config", cfg, "--set", "realrun.lr=1e20", "--out", out, "--no-progress")
    _, err = p.communicate(timeout=300)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert p.returncode == 2, err[-3000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    m = re.search(r"training loss is (nan|inf|-inf) at iteration (\d+) \(rank 1: dp_rank 0, stage 1, "
                  r"micro-batch \d+\)", lines[0])
    assert m and lines[0].startswith("sparsebalance train: error: "), lines[0]
    k = int(m.group(2))
    assert 1 <= k < 4
    assert json.loads((out / ".sparsebalance.json").read_text())["complete"] is False
    metrics = pd.read_csv(out / "metrics.csv")
    assert list(metrics["iteration"]) == list(range(k)) and metrics["loss"].map(math.isfinite).all()
    assert set(pd.read_csv(out / "measured_trace.csv")["iteration"]) == set(range(k))
    assert len(json.loads((out / "plans.json").read_text())["iterations"]) == k
    # the other rank was released by rank 0 and ended on its own, not killed
    assert json.loads((out / "ranks" / "rank1.json").read_text())["state"] == "done"


@pytest.mark.parametrize("executor", ["single", "realrun"])
def test_diverged_accuracy_run_is_one_line_and_keeps_its_log(tmp_path, run_cli, executor):
    """Both executors of the accuracy experiment: one line naming the iteration and where it diverged
    (the single-process trainer's job; realrun's rank, stage and micro-batch, with its log), exit 2,
    the directory marked incomplete, what ran before kept."""
    pytest.importorskip("torch")
    exp = tmp_path / "exp.toml"
    exp.write_text("lr = 1e20\n")
    out = tmp_path / "acc"
    r = run_cli("accuracy", "--executor", executor, "--quick", "--jobs", "1", "--config", exp, "--out", out)
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert r.code == 2 and len(lines) == 1, r.err[-2000:]
    if executor == "single":
        assert re.search(r"accuracy run \S+ seed 0: training loss is \S+ at iteration \d+ \(dp_rank \d+, "
                         r"micro-batch \d+\)", lines[0]), lines[0]
        assert (out / "jobs.jsonl").exists()
    else:
        m = re.search(r"training loss is \S+ at iteration \d+ \(rank \d+: dp_rank \d+, stage \d+, "
                      r"micro-batch \d+\).* Log: (\S+)$", lines[0])
        assert m, lines[0]
        assert Path(m.group(1)).is_file()
    assert json.loads((out / ".sparsebalance.json").read_text())["complete"] is False


def test_accuracy_step_stops_before_the_optimizer(tmp_path):
    """TrainExecutor checks each micro-batch's loss before the step: the weights stay as they were."""
    torch = pytest.importorskip("torch")
    from sparsebalance.accuracy import model as M
    from sparsebalance.accuracy.executor import TrainExecutor
    from sparsebalance.data.recall import RecallTask
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.simulator.plan import Plan

    c = M.load(M.shipped_path())
    model = c.load_model()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = math.nan  # every logit row reads it: the loss is NaN
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ex = TrainExecutor(model, opt, RecallTask(c.task), None, scale=8, block_size=32, coverage_layer=0)
    plan = Plan.from_lists([[[Sequence(id=1, length=64 * 8)], [Sequence(id=2, length=100 * 8)]]])
    with pytest.raises(NonFiniteLoss, match=r"at iteration 7 \(dp_rank 0, micro-batch 0\)"):
        ex.execute(7, plan, ((8, 8),))
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, model.parameters()))


def test_launcher_turns_a_workers_bad_input_into_exit_2(tmp_path):
    """The status a worker leaves for a ConfigError (code 2) makes the launcher's line an error line
    and its exit code 2; torchrun itself says 1 whatever its workers said."""
    from sparsebalance.realrun.launch import first_failure, first_failure_code

    d = tmp_path / "ranks"
    d.mkdir()
    (d / "rank0.json").write_text(json.dumps({"rank": 0, "pid": 1, "dp_rank": 0, "stage": 0, "state": "failed",
                                              "time": 2.0, "code": 2,
                                              "error": "NonFiniteLoss: training loss is nan at iteration 3"}))
    (d / "rank1.json").write_text(json.dumps({"rank": 1, "pid": 2, "dp_rank": 0, "stage": 1, "state": "done"}))
    assert first_failure_code(d, {}) == 2
    line = first_failure(d, {}, 2, 1, "train", tmp_path / "launch.log")
    assert line.startswith("train: error: training loss is nan at iteration 3. Log: "), line
    (d / "rank0.json").write_text(json.dumps({"rank": 0, "pid": 1, "state": "failed", "time": 2.0,
                                              "error": "RuntimeError: boom"}))  # no code: 1
    assert first_failure_code(d, {}) == 1
