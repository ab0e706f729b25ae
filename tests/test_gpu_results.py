"""What the first GPU run measured stays true of the code: the shipped H100 profiles load with their
provenance, and the simulator with the measured profile predicts the stage check measured on the same
H100 (docs/gpu/h100-2026-11-26/stages.csv, one global batch of a PP-4 SAB + DST plan of qwen2.5-3b).
An independent oracle: the measurement, not a number the simulator produced."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pandas as pd
import pytest

from sparsebalance.runconfig import load_run_config
from sparsebalance.simulator.cost.catalog import load_profile
from sparsebalance.stagecheck import predict_stages

RUN = Path(__file__).resolve().parents[1] / "docs" / "gpu" / "h100-2026-11-26"


@pytest.mark.parametrize("name", ["h100-measured-3b", "h100-measured-0.5b"])
def test_shipped_h100_profiles_carry_their_provenance(name):
    meta = load_profile(name).meta
    assert meta.analytical is False and meta.device == "NVIDIA H100 80GB HBM3"
    assert meta.date == "2026-11-26" and "gpu-check" in meta.command
    assert meta.machine["gpu_driver"] and meta.versions["triton"] and meta.versions["torch"]


def test_measured_profile_predicts_the_measured_h100_iteration_within_10_percent():
    cfg = load_run_config(str(resources.files("sparsebalance.data") / "presets" / "gpu_check_stages.toml"))
    with pytest.warns(UserWarning):
        res = predict_stages(cfg, pd.read_csv(RUN / "stages.csv"),
                             {"h100-measured": "h100-measured-3b", "analytical": "analytical-h100"})
    err = res.iteration.set_index("source").error_vs_measured
    assert abs(err["h100-measured"]) <= 0.10, res.iteration
    # the analytical profile is far off on this GPU (docs/results.md, "On an H100"): while it is, this
    # says so; when the published-run-truth work closes the gap, tighten it
    assert err["analytical"] < -0.5, res.iteration
