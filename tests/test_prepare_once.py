"""``simulate`` calibrates before it prepares the run, and prepares it once, with the calibrated
profile in memory: that run is exactly the run prepared from the calibrated profile it saves."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from sparsebalance.runconfig import load_run_config
from sparsebalance.runner import prepare, run_simulation
from sparsebalance.simulator.cost import calibration as C
from sparsebalance.simulator.cost.catalog import load_profile


@pytest.mark.filterwarnings("ignore")
def test_a_run_prepared_with_a_profile_in_memory_equals_one_from_its_saved_copy(tmp_path, scaled_probe):
    cfg = load_run_config("examples/cpu_pp2.toml", {"iterations": 3, "policy.tuning": "dst"})
    prof = load_profile(cfg.profile, cfg.base_dir)
    grid = C.probe_grid(prof, max_len=cfg.data.max_length, budget=cfg.policy.k0)
    factors = {op: 1.1 + 0.1 * i for i, op in enumerate(prof.ops)}  # not a power of two: rounding shows
    scaled = C.rescale(prof, C.fit(prof, scaled_probe(prof, grid, factors)))
    saved = replace(cfg, profile=str(scaled.save(tmp_path / "cal")))
    in_memory = prepare(cfg, profile=scaled)
    assert in_memory.latency.profile is scaled
    wall = ["decision_ms"]  # wall clock of the policies: the only column that may differ
    got = run_simulation(saved, progress=False, prepared=replace(in_memory, cfg=saved)).metrics.drop(columns=wall)
    want = run_simulation(saved, progress=False, prepared=prepare(saved)).metrics.drop(columns=wall)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    base = run_simulation(cfg, progress=False).metrics
    assert not base["iteration_time_s"].equals(got["iteration_time_s"])  # the profile did change
