"""``simulate`` with a calibrated profile prepares the run once: ``runner.with_profile`` swaps the
latency model into what ``prepare`` built (data, coverage, policies kept) and runs exactly as a run
prepared from scratch with that profile."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from sparsebalance.runconfig import load_run_config
from sparsebalance.runner import prepare, run_simulation, with_profile


@pytest.mark.filterwarnings("ignore")
def test_with_profile_runs_as_a_fresh_prepare():
    cfg = load_run_config("examples/qwen25-3b_h200_dp4pp4.toml",
                          {"iterations": 3, "data.num_sequences": 256, "policy.tuning": "dst"})
    other = replace(cfg, profile="analytical-h100")
    first = prepare(cfg)
    swapped = with_profile(first, other)
    assert swapped.sequences is first.sequences and swapped.batching is first.batching
    assert swapped.latency is not first.latency and swapped.ctx.latency is swapped.latency
    wall = ["decision_ms"]  # wall clock of the policies: the only column that may differ
    got = run_simulation(other, progress=False, prepared=swapped).metrics.drop(columns=wall)
    want = run_simulation(other, progress=False, prepared=prepare(other)).metrics.drop(columns=wall)
    pd.testing.assert_frame_equal(got, want)
    base = run_simulation(cfg, progress=False, prepared=prepare(cfg)).metrics
    assert not base["iteration_time_s"].equals(got["iteration_time_s"])  # the profile did change
