"""``simulate`` / ``validate`` with a measured profile: probe, rescale, say so; --profile-as-is;
fingerprints written by ``profile``. The probe is replaced by an exact fake (no timing in tests)."""

from __future__ import annotations

import json
import os
import shutil

import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsebalance.simulator.cost.catalog import SHIPPED_DIR

SIM = """
name = "cal"
iterations = 2
seed = 0
profile = "{profile}"
latency_extrapolate = "clamp"
output_dir = "{out}"
[model]
preset = "tiny"
[cluster]
device = "cpu"
pp = 1
dp = 1
global_batch = 4
[data]
source = "distribution"
distribution = "chatqa2-like"
num_sequences = 16
max_length = 2048
min_length = 64
[policy]
batching = "sequential"
tuning = "fixed"
k0 = 4
"""


@pytest.fixture
def measured(tmp_path):
    """A copy of cpu-tiny whose sidecar says it was measured on another CPU."""
    d = tmp_path / "prof"
    shutil.copytree(SHIPPED_DIR / "cpu-tiny", d)
    meta = json.loads((d / "profile.json").read_text())
    meta["machine"] = {"device_kind": "cpu", "cpu_model": "Some Other CPU", "cores": 64, "torch_threads": 1}
    (d / "profile.json").write_text(json.dumps(meta))
    return d


def test_simulate_probes_rescales_and_says_so(tmp_path, run_cli, monkeypatch, measured, scaled_probe):
    import sparsebalance.kernels.calibrate as K

    cfg = tmp_path / "run.toml"
    cfg.write_text(SIM.format(profile=measured, out=tmp_path / "res"))
    ops = ("attn_fwd", "attn_bwd", "layer_fwd", "layer_bwd", "embed_fwd", "embed_bwd", "head_fwd", "head_bwd")
    monkeypatch.setattr(K, "probe", lambda prof, grid: scaled_probe(prof, grid, dict.fromkeys(ops, 2.0)))
    import sparsebalance.simulator.cost.latency as L

    loads, load = [], L.load_latency_model
    monkeypatch.setattr(L, "load_latency_model", lambda p, *a, **k: loads.append(p) or load(p, *a, **k))
    r = run_cli("simulate", "--config", cfg, "--no-progress")
    assert r.code == 0, r.err
    # calibrated before the run was prepared: one latency model, built on the rescaled profile
    assert len(loads) == 1 and "calibrated on this machine" in loads[0].source
    lines = [x for x in r.out.splitlines() if x.startswith("calibration:")]
    assert len(lines) == 1 and "attn_bwd x2.00" in lines[0] and "cpu_model: Some Other CPU ->" in lines[0]
    rec = json.loads((tmp_path / "res" / "cal" / "calibration.json").read_text())
    assert rec["status"] == "rescaled" and rec["scales"]["attn_fwd"] == pytest.approx(2.0)
    assert rec["fingerprint_mismatch"]
    scaled = pd.read_csv(tmp_path / "res" / "cal" / "metrics.csv")["iteration_time_s"]

    def no_probe(*a, **k):
        raise AssertionError("--profile-as-is must not probe")

    monkeypatch.setattr(K, "probe", no_probe)
    # its own --out: a second run into res/cal would go to a new timestamped directory, not overwrite
    r = run_cli("simulate", "--config", cfg, "--no-progress", "--profile-as-is", "--out", tmp_path / "asis")
    assert r.code == 0, r.err
    assert "calibration: off (--profile-as-is)" in r.out and "fingerprint differs" in r.out
    as_is = pd.read_csv(tmp_path / "asis" / "metrics.csv")["iteration_time_s"]
    # PP 1 x DP 1: no communication, every op (optim too, by the median scale) doubled
    pd.testing.assert_series_equal(scaled, 2 * as_is, rtol=1e-9)


def test_analytical_profiles_are_never_probed(tmp_path, run_cli, monkeypatch):
    import sparsebalance.kernels.calibrate as K

    monkeypatch.setattr(K, "probe", lambda *a, **k: (_ for _ in ()).throw(AssertionError("probed")))
    cfg = tmp_path / "run.toml"
    cfg.write_text(SIM.format(profile="analytical-h200", out=tmp_path / "res").replace('"cpu"', '"h200"'))
    r = run_cli("simulate", "--config", cfg, "--no-progress")
    assert r.code == 0, r.err
    assert "calibration" not in r.out


def test_profile_writes_the_machine_fingerprint(tmp_path, run_cli):
    out = tmp_path / "p"
    r = run_cli("profile", "--device", "cpu", "--model", "tiny", "--out", out, "--seq-lens", "64,128",
                "--budgets", "1,2", "--tokens", "64,128", "--params", "100,1000", "--repeats", "1",
                "--warmup", "0", "--threads", "1", "--no-progress")
    assert r.code == 0, r.err
    fp = json.loads((out / "profile.json").read_text())["machine"]
    assert fp["device_kind"] == "cpu" and fp["torch_threads"] == 1 and fp["cores"] >= 1 and fp["cpu_model"]
    from sparsebalance.kernels.calibrate import machine_fingerprint
    from sparsebalance.simulator.cost.calibration import fingerprint_mismatch

    assert fingerprint_mismatch(fp, machine_fingerprint("cpu", threads=1)) == []
    # the measurement judged itself: its host load and verdict in the sidecar and beside the summary
    from sparsebalance.analysis.disturbance import judge

    host = json.loads((out / "profile.json").read_text())["host"]
    assert host["own_cpu_s"] > 0 and host["run_cores"] == 1 and host["foreign_cores"] is not None
    want = judge([host], cores=1, host_cores=os.cpu_count())
    assert (host["disturbed"], host["disturbed_reasons"]) == (want.disturbed, want.reasons)
    assert "host during the measurement: other processes used" in r.out
    assert ("DISTURBED (" in next(ln for ln in r.out.splitlines() if ln.startswith("wrote"))) == host["disturbed"]


def test_probes_between_rounds_enter_one_fit(tmp_path, measured, scaled_probe):
    """validate's per-round probes: the machine ran 1x the profile at one probe and 2x at the next
    (drift); the scale is their geometric mean, sqrt(2), for every op, and the spread says so."""
    import math

    from sparsebalance.calibrate import Prober
    from sparsebalance.commands._calibrate import CALIBRATED_DIR, save_calibrated
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.simulator.cost.catalog import load_profile

    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(SIM.format(profile=measured, out=tmp_path / "res"))
    cfg = load_run_config(str(cfg_path))
    ops = ("attn_fwd", "attn_bwd", "layer_fwd", "layer_bwd", "embed_fwd", "embed_bwd", "head_fwd", "head_bwd")
    factors = iter([1.0, 2.0])

    def drifting(prof, grid):
        return scaled_probe(prof, grid, dict.fromkeys(ops, next(factors)))

    lines: list[str] = []
    prober = Prober(cfg, as_is=False, measure=drifting, emit=lines.append)
    prober.probe()
    prober.probe()
    probed = prober.finish()
    new_cfg, rec = save_calibrated(cfg, tmp_path / "out", probed), probed.record
    assert rec["status"] == "rescaled" and rec["probes"] == 2
    for op in ops:
        assert rec["scales"][op] == pytest.approx(math.sqrt(2), rel=1e-12)
        # half the points at log 0, half at log 2: sample sd of n points is ln2/2 * sqrt(n/(n-1))
        n = int((pd.read_csv(tmp_path / "out" / "calibration.csv")["op"] == op).sum())
        assert rec["spreads"][op] == pytest.approx(math.log(2) / 2 * math.sqrt(n / (n - 1)), rel=1e-9)
    assert len(lines) == 1 and "(2 probes, one per round)" in lines[0]
    base = load_profile(str(measured), ".").table
    out = load_profile(str(tmp_path / "out" / CALIBRATED_DIR), ".").table
    attn = (base["op"] == "attn_fwd").to_numpy()
    assert (out["latency_s"].to_numpy()[attn] / base["latency_s"].to_numpy()[attn]) == pytest.approx(math.sqrt(2))
    assert new_cfg.profile == str((tmp_path / "out" / CALIBRATED_DIR).resolve())


def test_prober_as_is_never_probes(tmp_path, measured):
    from sparsebalance.calibrate import Prober
    from sparsebalance.runconfig import load_run_config

    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(SIM.format(profile=measured, out=tmp_path / "res"))
    cfg = load_run_config(str(cfg_path))

    def no_probe(*a, **k):
        raise AssertionError("--profile-as-is must not probe")

    lines: list[str] = []
    prober = Prober(cfg, as_is=True, measure=no_probe, emit=lines.append)
    for _ in range(3):
        prober.probe()
    probed = prober.finish()
    assert probed.record["status"] == "as-is" and probed.profile is None and len(lines) == 1


def test_cuda_profile_without_cuda_here_is_used_as_is(tmp_path, monkeypatch):
    """A measured GPU profile on a machine without CUDA: no probe (it would build its model on a
    GPU that is not there), one line saying so, the profile used as measured."""
    import torch

    from sparsebalance.calibrate import Prober
    from sparsebalance.runconfig import load_run_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(SIM.format(profile="h100-measured-0.5b", out=tmp_path / "res")
                        .replace('preset = "tiny"', 'preset = "qwen2.5-0.5b"'))
    cfg = load_run_config(str(cfg_path))

    def no_probe(*a, **k):
        raise AssertionError("a CUDA profile must not be probed without CUDA")

    lines: list[str] = []
    prober = Prober(cfg, as_is=False, measure=no_probe, emit=lines.append)
    prober.probe()
    probed = prober.finish()
    assert probed.record["status"] == "device-not-here" and probed.profile is None
    assert len(lines) == 1 and "which this machine cannot run; used as is" in lines[0], lines
