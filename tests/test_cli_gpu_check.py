"""``sparsebalance gpu-check``: the parts that run without a GPU (the no-CUDA exit, the summary table,
the single-device stage validation on the CPU with the chunked backend and the tiny model). The
device path as a whole (offline script, import closure, the orchestrator on the CPU):
tests/test_gpu_check_offline.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest


def test_without_cuda_exits_2_with_one_line_and_leaves_no_directory(run_cli, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = run_cli("gpu-check", "--out", tmp_path / "gc")
    assert r.code == 2
    assert len(r.err.strip().splitlines()) == 1 and r.out == ""
    assert f"needs a CUDA GPU and torch {torch.__version__} sees no CUDA device" in r.err
    assert not (tmp_path / "gc").exists()  # before: a directory holding summary.md


def test_bad_steps_and_budget_are_one_line_before_any_work(run_cli, tmp_path):
    r = run_cli("gpu-check", "--out", tmp_path / "a", "--steps", "accuracy,speeed")
    assert r.code == 2 and "--steps" in r.err and "speeed" in r.err and "accuracy, speed" in r.err
    r = run_cli("gpu-check", "--out", tmp_path / "b", "--budget-s", "0")
    assert r.code == 2 and "--budget-s" in r.err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_summary_table_has_one_row_per_step(tmp_path):
    from sparsebalance.gpucheck.report import write_summary

    rows = [{"step": "accuracy", "status": "ok", "figures": "24/24", "file": "accuracy.csv", "seconds": 12.4},
            {"step": "validate", "status": "skipped", "figures": "one GPU", "file": "", "seconds": 0.0}]
    text = write_summary(rows, {"device": "NVIDIA H100 80GB HBM3"}, tmp_path / "summary.md").read_text()
    assert "- device: NVIDIA H100 80GB HBM3" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert table[0] == "| step | status | figures | file | seconds |"
    assert table[1:] == ["| accuracy | ok | 24/24 | accuracy.csv | 12 |", "| validate | skipped | one GPU |  | 0 |"]


def test_stage_check_runs_on_the_cpu():
    """Tiny model, PP 2, 2 one-sequence micro-batches with SAB + DST budgets: every (stage, micro-batch)
    F and B measured and predicted by both profiles; the iteration composed through the schedule."""
    torch = pytest.importorskip("torch")
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.engine import PipelineInput, simulate
    from sparsebalance.stagecheck import predict_stages, run_stage_check

    cfg = load_run_config("examples/cpu_pp2.toml", {"cluster.global_batch": 2, "data.max_length": 128})
    torch.set_num_threads(1)
    with pytest.warns(UserWarning):
        res = run_stage_check(cfg, {"cpu": "cpu-tiny", "h100": "analytical-h100"}, rounds=1)
    ops = res.ops
    assert len(ops) == 2 * 2 * 2 and set(ops.op) == {"F", "B"}
    assert (ops.measured_s > 0).all() and (ops.pred_cpu_s > 0).all() and (ops.pred_h100_s > 0).all()
    with pytest.warns(UserWarning):
        lm = load_latency_model("cpu-tiny", cfg.model, cfg.cluster, allow_nonmonotone=True, extrapolate="clamp")
    r = ops.iloc[0]
    assert r.pred_cpu_s == pytest.approx(lm.stage_time([int(r.tokens)], int(r.budget), int(r.stage), backward=False))
    f = ops[ops.op == "F"].pivot(index="stage", columns="microbatch", values="measured_s").to_numpy()
    b = ops[ops.op == "B"].pivot(index="stage", columns="microbatch", values="measured_s").to_numpy()
    p2p = np.array([[lm.p2p_time(int(t)) for t in ops[(ops.op == "F") & (ops.stage == 0)].tokens]])[None]
    want = simulate(PipelineInput(schedule="1f1b", pp=2, forward=f[None], backward=b[None], p2p=p2p)).iteration_time
    it = res.iteration.set_index("source")
    assert it.loc["measured", "iteration_time_s"] == pytest.approx(want)
    assert (f + b).sum(axis=1).max() <= it.loc["measured", "iteration_time_s"] <= f.sum() + b.sum() + 2 * p2p.sum()
    assert list(it.index) == ["measured", "cpu", "h100"]
    # predicted again from the measured rows alone (a profile shipped later): the same plan, budgets
    # and figures, bitwise; a third profile adds its column and its iteration
    with pytest.warns(UserWarning):
        again = predict_stages(cfg, ops[["stage", "microbatch", "op", "tokens", "measured_s"]].sample(frac=1, random_state=0),
                               {"cpu": "cpu-tiny", "h100": "analytical-h100", "h200": "analytical-h200"})
    pd.testing.assert_frame_equal(again.ops[ops.columns.drop(["sequences", "budget"])],
                                  ops[ops.columns.drop(["sequences", "budget"])])
    assert again.iteration.iteration_time_s.iloc[:3].tolist() == res.iteration.iteration_time_s.tolist()
    assert list(again.iteration.source) == ["measured", "cpu", "h100", "h200"]
    with pytest.raises(ValueError, match="^ops: 7 rows do not match the plan"):
        predict_stages(cfg, ops.iloc[:7], {"cpu": "cpu-tiny"})
    with pytest.raises(ValueError, match="^profiles: the label 'measured'"):
        predict_stages(cfg, ops, {"measured": "cpu-tiny"})
