"""``profile --trainer torchtitan`` (torchtitan's Qwen3 pieces timed) and ``validate --trainer
torchtitan`` end to end: the job run for the policy and the baseline, measured inside torchtitan's
trainer, replayed by the simulator, compared."""

from __future__ import annotations

import json

import pandas as pd
import pytest

pytest.importorskip("torchtitan")


def test_profile_times_torchtitans_pieces(run_cli, tmp_path):
    r = run_cli("profile", "--trainer", "torchtitan", "--model", "tiny", "--out", tmp_path / "p",
                "--seq-lens", "64,128", "--budgets", "1,2", "--tokens", "64,128", "--params", "1000,2000",
                "--repeats", "1", "--warmup", "0", "--no-progress")
    assert r.code == 0, r.err
    table = pd.read_csv(tmp_path / "p" / "profile.csv")
    assert (table.latency_s > 0).all()
    assert {"attn_fwd", "layer_fwd", "layer_bwd_input", "head_bwd_weight", "embed_fwd"} <= set(table.op)
    meta = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert "torchtitan Qwen3TransformerBlock" in meta["how"]
    assert meta["model"]["qkv_bias"] is False


@pytest.mark.slow
def test_validate_runs_the_torchtitan_job_and_compares(run_cli, tmp_path):
    out = tmp_path / "v"
    r = run_cli("validate", "--trainer", "torchtitan", "--config", "sparsebalance_tiny_pp2", "--rounds", "1",
                "--retries", "0", "--iterations", "2", "--out", out, "--json")
    assert r.code == 0, r.err
    s = json.loads(r.out)
    assert s["trainer"] == "torchtitan" and s["policy"] == "sab+dst" and s["baseline"] == "baseline"
    its = pd.read_csv(out / "iterations.csv")
    assert set(its.policy) == {"baseline", "sab+dst"} and len(its) == 4
    assert (its.measured > 0).all() and (its.predicted > 0).all()
    assert (its.predicted_tokens == its.measured_tokens).all()  # the replay ran the job's own plans
    stages = pd.read_csv(out / "stages.csv")
    assert set(stages.stage) == {0, 1}
    for pol in ("sab_dst", "baseline"):
        assert (out / "runs" / pol / "round0" / "trace_rank1.csv").is_file()
    assert (out / "probe" / "baseline-0" / "trace_rank1.csv").is_file()  # the round's trainer probe
    probe = s["trainer_probe"]  # one line per (stage, op), fitted to the probe's own plans
    assert {(ln["stage"], ln["op"]) for ln in probe["lines"]} == {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
    assert all(ln["scale"] > 0 and ln["points"] == 4 for ln in probe["lines"])  # 1 step x 4 micro-batches
    assert probe["iterations"] == 1 and probe["probes_taken"] == 1 and "mean_abs_error" in s["uncalibrated"]


def test_the_calibration_probe_times_a_titan_profile_with_its_own_bench():
    """A profile measured on torchtitan's Qwen3 names its bench; the probe re-times the same model
    (its arch, not Qwen2's defaults) with the same bench, and the points agree with the table's
    order of magnitude (a probe of the wrong model would be off by far more)."""
    from sparsebalance.kernels.calibrate import probe, profile_model
    from sparsebalance.simulator.config import ARCH_FIELDS
    from sparsebalance.simulator.cost.calibration import ProbeGrid
    from sparsebalance.simulator.cost.catalog import load_profile

    prof = load_profile("cpu-titan-tiny")
    assert prof.meta.bench == "sparsebalance.titan.profile:TitanBench"
    model = profile_model(prof)
    for k in ARCH_FIELDS:
        if k in prof.meta.model:
            assert getattr(model, k) == prof.meta.model[k], k
    got = probe(prof, ProbeGrid(seq_lens=(128,), budgets=(2,), tokens=(256,)), repeats=1, warmup=1)
    assert {"attn_fwd", "layer_fwd"} <= set(got["op"])
    table = prof.rows("layer_fwd")
    want = float(table.loc[table["seq_len"] == 256, "latency_s"].iloc[0])
    have = float(got.loc[got["op"] == "layer_fwd", "latency_s"].iloc[0])
    assert want / 10 < have < want * 10, (have, want)
